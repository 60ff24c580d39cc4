//! Packing and batching on arbitrary lengths, configs and token ids (docs/FAULTS.md
//! P1, P3–P6), checked from first principles: every token placed once or
//! its loss reported, positions reset per segment, padding never a segment,
//! `cu_seqlens` over real tokens only (see [`crate::packing::check_packer`]
//! and [`crate::packing::check_batcher`]). Plans are not compared with the
//! reference's: any valid plan passes.
//!
//! The case layout ([`PackFuzzCase`]) is that of the original `pack_batch`
//! fuzz target, so its committed inputs keep their meaning.

use arbitrary::{Arbitrary, Unstructured};
use packshard_reference::packing::{Algorithm, Overlong, PackingConfig};

use super::{brief, catch_panic, Failure, Outcome};
use crate::compare::Mismatch;
use crate::packing::{check_batcher, check_packer, BatchInput, Batcher, Packer};

/// Most sequences of a case (the rest of the bytes is ignored).
pub const MAX_SEQUENCES: usize = 64;

/// An arbitrary packing case, as raw bytes: lengths up to 255 tokens, `max_seq_len` up
/// to 255 (0 is a config error), any algorithm, an optional sequence limit
/// (0 is a config error; NNLSHP's depth is capped at 3 to keep it quick),
/// any overlong policy, a position offset and a pad id.
#[derive(Debug, Clone, PartialEq, Eq, Arbitrary)]
pub struct PackFuzzCase {
    /// Sequence lengths (the first [`MAX_SEQUENCES`] are used).
    pub lengths: Vec<u8>,
    /// `max_seq_len`.
    pub max_seq_len: u8,
    /// Index into [`Algorithm::ALL`] (modulo).
    pub algorithm: u8,
    /// `max_sequences_per_pack`.
    pub limit: Option<u8>,
    /// Index into error, split, truncate, drop (modulo).
    pub overlong: u8,
    /// The position offset of the batch: a negative one must be refused,
    /// and the batch is checked at its absolute value.
    pub position_offset: i8,
    /// The pad token id.
    pub pad: i16,
}

impl PackFuzzCase {
    /// The case `data` describes (every byte string describes one).
    ///
    /// # Errors
    /// Never in practice: bytes that run out read as zeros.
    pub fn from_bytes(data: &[u8]) -> arbitrary::Result<Self> {
        Self::arbitrary(&mut Unstructured::new(data))
    }

    /// The packing config the bytes describe.
    pub fn config(&self) -> PackingConfig {
        let algorithm = self.algorithm();
        let overlong = [
            Overlong::Error,
            Overlong::Split,
            Overlong::Truncate,
            Overlong::Drop,
        ][self.overlong as usize % 4];
        // NNLSHP builds every exact-fill pack: keep its depth small enough to be quick.
        let limit = self.limit.map(|k| {
            if algorithm == Algorithm::Nnlshp {
                (k % 4) as usize
            } else {
                k as usize
            }
        });
        PackingConfig::new(algorithm, self.max_seq_len as usize)
            .with_max_sequences_per_pack(limit)
            .with_overlong(overlong)
    }

    fn algorithm(&self) -> Algorithm {
        Algorithm::ALL[self.algorithm as usize % Algorithm::ALL.len()]
    }

    /// The lengths used (at most [`MAX_SEQUENCES`]).
    pub fn lengths(&self) -> Vec<usize> {
        self.lengths
            .iter()
            .take(MAX_SEQUENCES)
            .map(|&l| l as usize)
            .collect()
    }

    /// Recognisable token sequences of the lengths: `7 + 1000 i + t`.
    pub fn sequences(&self) -> Vec<Vec<i64>> {
        self.lengths()
            .iter()
            .enumerate()
            .map(|(i, &l)| (0..l as i64).map(|t| 7 + i as i64 * 1000 + t).collect())
            .collect()
    }

    /// A one-line description for failure reports.
    pub fn describe(&self) -> String {
        format!(
            "lengths {}, config {:?}, position_offset {}, pad {}",
            brief(&self.lengths()),
            self.config(),
            self.position_offset,
            self.pad
        )
    }
}

/// The packing fuzz body: `data` as a [`PackFuzzCase`]. An invalid config
/// (`max_seq_len` 0, a limit of 0) must be a typed error from both traits,
/// and so must a negative `position_offset` from the batcher; otherwise the
/// plan and the batch (at `|position_offset|`) must pass [`check_packer`]
/// and [`check_batcher`].
///
/// # Errors
/// A [`Failure`] describing the case and the first violation.
pub fn run<I: Packer + Batcher>(imp: &I, data: &[u8]) -> Result<Outcome, Failure> {
    let Ok(case) = PackFuzzCase::from_bytes(data) else {
        return Ok(Outcome::default());
    };
    let fail = |m: Mismatch| Failure::new("pack_batch", Packer::name(imp), case.describe(), m);
    let config = case.config();
    let lengths = case.lengths();
    let sequences = case.sequences();
    let offset = i64::from(case.position_offset);
    let input = BatchInput::new(&sequences, &config, offset).with_pad(i64::from(case.pad));
    if config.max_seq_len == 0 || config.max_sequences_per_pack == Some(0) {
        let packed = catch_panic("pack", || imp.pack(&lengths, &config)).map_err(fail)?;
        let batched = catch_panic("batch", || imp.batch(input)).map_err(fail)?;
        if packed.is_ok() || batched.is_ok() {
            return Err(fail(Mismatch::new(
                "config",
                "max_seq_len 0 or a limit of 0 must be a typed error, got a plan",
            )));
        }
        return Ok(Outcome::errors_alike());
    }
    if offset < 0 {
        // A negative offset names no row of a position-embedding table: it
        // must be a typed error (issue #14), naming `position_offset` where
        // the same batch at `|offset|` is valid. The batch is then checked
        // at `|offset|`.
        let at = |o: i64| catch_panic("batch", || imp.batch(input.with_offset(o)));
        let refused = at(offset).map_err(fail)?;
        let valid = at(-offset).map_err(fail)?.is_ok();
        match refused {
            Ok(_) => {
                return Err(fail(Mismatch::new(
                    "position_offset",
                    format!("{offset} must be a typed error, got a batch"),
                )))
            }
            Err(e) if valid && !e.to_string().starts_with("position_offset") => {
                return Err(fail(Mismatch::new(
                    "position_offset",
                    format!("{offset} must be refused naming position_offset, got: {e}"),
                )))
            }
            Err(_) => {}
        }
    }
    let input = input.with_offset(offset.abs());
    catch_panic("pack", || check_packer(imp, &lengths, &config))
        .and_then(|r| r)
        .map_err(fail)?;
    catch_panic("batch", || check_batcher(imp, input))
        .and_then(|r| r)
        .map_err(fail)?;
    let overlong = lengths.iter().any(|&l| l > config.max_seq_len);
    Ok(if overlong && config.overlong == Overlong::Error {
        Outcome::errors_alike()
    } else {
        Outcome::compared(lengths.iter().sum(), 0.0)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The batch check finds each token by its value, so `sequences` must
    /// give every (sequence, position) its own token: a formula that maps
    /// two of them to one value (all first tokens 0, say) would let a
    /// batcher that swaps them pass. The long sequence comes first, where a
    /// token counting down from 7 would reach the pad id 0 and below.
    #[test]
    fn every_token_of_a_case_is_its_own() {
        let case = PackFuzzCase {
            lengths: vec![200, 3, 5, 1, 4],
            max_seq_len: 255,
            algorithm: 0,
            limit: None,
            overlong: 0,
            position_offset: 0,
            pad: 0,
        };
        let seqs = case.sequences();
        assert_eq!(
            seqs.iter().map(Vec::len).collect::<Vec<_>>(),
            [200, 3, 5, 1, 4]
        );
        let mut all: Vec<i64> = seqs.iter().flatten().copied().collect();
        assert!(all.iter().all(|&t| t > 0), "token ids are positive");
        let n = all.len();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), n, "two (sequence, position) pairs share a token");
    }
}
