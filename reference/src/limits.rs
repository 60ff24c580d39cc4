//! Resource limits shared by the commands: the memory budget an input may
//! ask for before anything is allocated.

use crate::error::{Error, Result};

/// The environment variable that sets the memory budget, in bytes (a plain
/// integer, or with a `KiB`, `MiB` or `GiB` suffix).
pub const MEMORY_BUDGET_ENV: &str = "PACKSHARD_MEMORY_BUDGET";

/// The memory budget when [`MEMORY_BUDGET_ENV`] is unset: 4 GiB.
pub const DEFAULT_MEMORY_BUDGET: u64 = 4 << 30;

/// The memory budget in bytes: [`MEMORY_BUDGET_ENV`] if set, else
/// [`DEFAULT_MEMORY_BUDGET`].
///
/// # Errors
/// [`Error::InvalidArgument`] naming `PACKSHARD_MEMORY_BUDGET` when the
/// variable is set but is not a byte count.
pub fn memory_budget() -> Result<u64> {
    match std::env::var(MEMORY_BUDGET_ENV) {
        Ok(text) => parse_bytes(&text).ok_or_else(|| {
            Error::invalid(
                MEMORY_BUDGET_ENV,
                format!("{text:?} is not a byte count (e.g. 4294967296 or 4GiB)"),
            )
        }),
        Err(_) => Ok(DEFAULT_MEMORY_BUDGET),
    }
}

/// Parses `123`, `64KiB`, `512MiB` or `4GiB`.
fn parse_bytes(text: &str) -> Option<u64> {
    let t = text.trim();
    let (digits, shift) = [("GiB", 30), ("MiB", 20), ("KiB", 10)]
        .iter()
        .find_map(|&(suffix, shift)| t.strip_suffix(suffix).map(|d| (d.trim(), shift)))
        .unwrap_or((t, 0));
    digits.parse::<u64>().ok()?.checked_mul(1u64 << shift)
}

/// Refuses `bytes` over the [`memory_budget`], naming `field` and what the
/// memory is for.
///
/// # Errors
/// [`Error::InvalidArgument`] naming `field` when `bytes` is over the budget;
/// the errors of [`memory_budget`].
pub fn check_memory(field: &str, bytes: u64, what: &str) -> Result<()> {
    let budget = memory_budget()?;
    if bytes > budget {
        return Err(Error::invalid(
            field,
            format!(
                "{what} needs about {} MiB, over the memory budget of {} MiB (set {MEMORY_BUDGET_ENV} to raise it)",
                bytes >> 20,
                budget >> 20
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn byte_counts_parse_with_binary_suffixes() {
        assert_eq!(parse_bytes("4096"), Some(4096));
        assert_eq!(parse_bytes("4GiB"), Some(4 << 30));
        assert_eq!(parse_bytes(" 512 MiB"), Some(512 << 20));
        assert_eq!(parse_bytes("3KiB"), Some(3072));
        assert_eq!(parse_bytes("lots"), None);
        assert_eq!(parse_bytes("-1"), None);
    }
}
