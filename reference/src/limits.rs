//! The limits every entry point checks before it works: one memory budget
//! for allocations sized by input, and the caps on work that would take
//! longer than an oracle call should (README, "Limits").
//!
//! The budget is [`DEFAULT_MEMORY_BUDGET`] bytes, or the value of the
//! environment variable [`MEMORY_BUDGET_ENV`] (bytes, a positive integer).
//! Every allocation whose size comes from input is estimated from the
//! shapes first and refused with [`Error::InvalidArgument`] naming the field
//! when the estimate is over the budget, so bad input never aborts the
//! process on a failed allocation.

use crate::error::{Error, Result};

/// The environment variable that overrides the memory budget (bytes).
pub const MEMORY_BUDGET_ENV: &str = "PACKSHARD_MEMORY_BUDGET";

/// The default memory budget: 4 GiB.
pub const DEFAULT_MEMORY_BUDGET: u64 = 4 << 30;

/// The most tokens (`n_tok`) the f64 reference attention takes in one call:
/// its work grows as `n_tok^2` in the worst case (one segment), and 16384
/// tokens of one segment at `h * d` = 64 take ~10 s on one core.
pub const MAX_ATTENTION_TOKENS: usize = 1 << 14;

/// The memory budget in bytes: [`MEMORY_BUDGET_ENV`] when set, else
/// [`DEFAULT_MEMORY_BUDGET`].
///
/// # Errors
/// [`Error::InvalidArgument`] naming the variable when it is set but not a
/// positive integer.
pub fn memory_budget() -> Result<u64> {
    match std::env::var(MEMORY_BUDGET_ENV) {
        Err(_) => Ok(DEFAULT_MEMORY_BUDGET),
        Ok(text) => match text.trim().parse::<u64>() {
            Ok(b) if b > 0 => Ok(b),
            _ => Err(Error::invalid(
                MEMORY_BUDGET_ENV,
                format!(
                    "expected a positive number of bytes, found {:?}",
                    crate::error::brief(&text)
                ),
            )),
        },
    }
}

/// Checks that `bytes` (an estimate from the input's shapes; `None` when
/// the product overflowed) fit the memory budget, before they are
/// allocated.
///
/// # Errors
/// [`Error::InvalidArgument`] naming `field` and the budget.
pub fn check_memory(field: &str, bytes: Option<u64>, what: &str) -> Result<()> {
    let budget = memory_budget()?;
    match bytes {
        Some(b) if b <= budget => Ok(()),
        _ => Err(Error::invalid(
            field,
            format!(
                "{what} needs {} bytes, over the memory budget of {budget} bytes (set {MEMORY_BUDGET_ENV} to change it)",
                bytes.map_or_else(|| "more than 2^64".to_string(), |b| b.to_string())
            ),
        )),
    }
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
