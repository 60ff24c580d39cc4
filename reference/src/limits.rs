//! Resource limits shared by the commands: the memory budget an input may
//! ask for before anything is allocated (README, "Limits").
//!
//! The budget is [`DEFAULT_MEMORY_BUDGET`] bytes, or the value of the
//! environment variable [`MEMORY_BUDGET_ENV`]. Every allocation whose size
//! comes from input is estimated from the shapes first and refused with
//! [`Error::InvalidArgument`] naming the field when the estimate is over the
//! budget ([`check_memory`], [`check_estimate`]), so bad input never aborts
//! the process on a failed allocation.

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
    bytes_from_env(
        MEMORY_BUDGET_ENV,
        DEFAULT_MEMORY_BUDGET,
        "4294967296 or 4GiB",
    )
}

/// The byte count in the environment variable `name` ([`parse_bytes`]), or
/// `default` when it is unset; an error naming `name` (with `example` of
/// what it takes) when it is set but is not a byte count.
fn bytes_from_env(name: &str, default: u64, example: &str) -> Result<u64> {
    match std::env::var(name) {
        Ok(text) => parse_bytes(&text).ok_or_else(|| {
            Error::invalid(
                name,
                format!(
                    "{:?} is not a byte count (e.g. {example})",
                    crate::error::brief(&text)
                ),
            )
        }),
        Err(_) => Ok(default),
    }
}

/// The environment variable that sets how many freed bytes the Python
/// extension keeps for reuse (`packshard_optimized::alloc::KeptBlocks`):
/// bytes as [`MEMORY_BUDGET_ENV`]'s, `0` keeps nothing.
pub const KEPT_BYTES_ENV: &str = "PACKSHARD_KEPT_BYTES";

/// [`KEPT_BYTES_ENV`] if set, else `default`.
///
/// # Errors
/// [`Error::InvalidArgument`] naming `PACKSHARD_KEPT_BYTES` when the
/// variable is set but is not a byte count (the Python package refuses to
/// import; the allocator, which cannot fail, then keeps nothing).
pub fn kept_bytes(default: u64) -> Result<u64> {
    bytes_from_env(KEPT_BYTES_ENV, default, "536870912 or 512MiB")
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
                "{what} needs about {}, over the memory budget of {} (set {MEMORY_BUDGET_ENV} to raise it)",
                fmt_bytes(bytes),
                fmt_bytes(budget)
            ),
        ));
    }
    Ok(())
}

/// [`check_memory`] of an estimate that may have overflowed (`None`: more
/// than 2^64 bytes, refused whatever the budget).
///
/// # Errors
/// As [`check_memory`].
pub fn check_estimate(field: &str, bytes: Option<u64>, what: &str) -> Result<()> {
    match bytes {
        Some(b) => check_memory(field, b, what),
        None => {
            let budget = memory_budget()?;
            Err(Error::invalid(
                field,
                format!(
                    "{what} needs more than 2^64 bytes, over the memory budget of {} (set {MEMORY_BUDGET_ENV} to raise it)",
                    fmt_bytes(budget)
                ),
            ))
        }
    }
}

/// A byte count in the largest binary unit it fills at least once, to 3
/// significant digits rounded down (`512 bytes`, `3 KiB`, `1.02 MiB`,
/// `4 GiB`): a budget under 1 MiB never reads as "0 MiB", and a need just
/// over a budget never prints as the budget.
pub fn fmt_bytes(bytes: u64) -> String {
    let Some(&(unit, shift)) = [("GiB", 30), ("MiB", 20), ("KiB", 10)]
        .iter()
        .find(|&&(_, shift)| bytes >> shift > 0)
    else {
        return format!("{bytes} bytes");
    };
    let x = bytes as f64 / (1u64 << shift) as f64;
    let digits = if x >= 100.0 {
        0
    } else if x >= 10.0 {
        1
    } else {
        2
    };
    let p = 10f64.powi(digits);
    let text = format!("{:.*}", digits as usize, (x * p).floor() / p);
    let text = if text.contains('.') {
        text.trim_end_matches('0').trim_end_matches('.')
    } else {
        &text
    };
    format!("{text} {unit}")
}

/// `f64` bytes of a tensor of `dims` (`None` on overflow).
pub fn f64_bytes(dims: &[usize]) -> Option<u64> {
    dims.iter()
        .try_fold(8u64, |acc, &d| acc.checked_mul(d as u64))
}

/// The sum of estimates (`None` if any is `None` or the sum overflows).
pub fn total(parts: &[Option<u64>]) -> Option<u64> {
    parts
        .iter()
        .try_fold(0u64, |acc, p| p.and_then(|p| acc.checked_add(p)))
}

#[cfg(test)]
mod tests {
    use super::{f64_bytes, fmt_bytes, parse_bytes, total};

    #[test]
    fn byte_counts_print_in_the_largest_unit_they_fill() {
        assert_eq!(fmt_bytes(0), "0 bytes");
        assert_eq!(fmt_bytes(1000), "1000 bytes");
        assert_eq!(fmt_bytes(4096), "4 KiB");
        assert_eq!(fmt_bytes((1 << 20) - 1), "1023 KiB");
        assert_eq!(fmt_bytes(5 << 20), "5 MiB");
        // Rounded down: just over 1 MiB is not "1 MiB", never "1.03".
        assert_eq!(fmt_bytes((1 << 20) + 20_000), "1.01 MiB");
        assert_eq!(fmt_bytes(3 << 9), "1.5 KiB");
        assert_eq!(fmt_bytes(4 << 30), "4 GiB");
    }

    #[test]
    fn byte_counts_parse_with_binary_suffixes() {
        assert_eq!(parse_bytes("4096"), Some(4096));
        assert_eq!(parse_bytes("4GiB"), Some(4 << 30));
        assert_eq!(parse_bytes(" 512 MiB"), Some(512 << 20));
        assert_eq!(parse_bytes("3KiB"), Some(3072));
        assert_eq!(parse_bytes("lots"), None);
        assert_eq!(parse_bytes("-1"), None);
        assert_eq!(parse_bytes("18446744073709551615GiB"), None);
    }

    #[test]
    fn estimates_overflow_to_none() {
        assert_eq!(f64_bytes(&[3, 5]), Some(120));
        assert_eq!(f64_bytes(&[usize::MAX, 2]), None);
        assert_eq!(total(&[Some(1), Some(2)]), Some(3));
        assert_eq!(total(&[Some(1), None]), None);
        assert_eq!(total(&[Some(u64::MAX), Some(1)]), None);
    }
}
