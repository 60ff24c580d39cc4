//! Which vocabulary entries each shard holds: even or uneven splits, or
//! Megatron-style padding to equal shards.

use ndarray::{Array2, ArrayView2, Axis, Slice};
use serde::Serialize;

use super::super::collective::MAX_RANKS;
use crate::error::{Error, Result};

/// The most shards a [`ShardMap`] may have (each in-process rank is a thread).
pub const MAX_SHARDS: usize = MAX_RANKS;

/// How `v` entries are split over `p` shards when `p` does not divide `v`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ShardLayout {
    /// Contiguous shards of `ceil(v / p)` or `floor(v / p)` entries, the
    /// larger ones first (`numpy.array_split`, `torch.tensor_split`).
    #[default]
    Uneven,
    /// The vocabulary padded to `p * ceil(v / p)` (Megatron's padded vocab);
    /// every shard holds `ceil(v / p)` columns, the last ones padding.
    Padded,
}

named_options!(ShardLayout, field "layout", unknown "shard layout", {
    Uneven => "uneven",
    Padded => "padded",
});

/// One shard: the columns `start .. start + width` of the (padded)
/// vocabulary, of which the first `real` are real entries (`< v`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct Shard {
    /// Its rank.
    pub rank: usize,
    /// Global index of its first column.
    pub start: usize,
    /// Columns it holds (`w_r`).
    pub width: usize,
    /// Of which real (the rest is padding).
    pub real: usize,
}

/// The split of a vocabulary of `v` entries over `p` shards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub struct ShardMap {
    vocab_size: usize,
    num_shards: usize,
    layout: ShardLayout,
}

impl ShardMap {
    /// `v` entries over `p` shards.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for `v = 0`, `p = 0`, `p > v` (a shard
    /// would hold no entry) or `p > MAX_SHARDS`. `p` need not divide `v`
    /// (docs/FAULTS.md V4).
    pub fn new(vocab_size: usize, num_shards: usize, layout: ShardLayout) -> Result<Self> {
        if vocab_size == 0 {
            return Err(Error::invalid("vocab_size", "the vocabulary is empty"));
        }
        if num_shards == 0 {
            return Err(Error::invalid("num_shards", "must be at least 1"));
        }
        if num_shards > vocab_size {
            return Err(Error::invalid(
                "num_shards",
                format!("{num_shards} shards for a vocabulary of {vocab_size}: p must be <= v"),
            ));
        }
        if num_shards > MAX_SHARDS {
            return Err(Error::invalid(
                "num_shards",
                format!("{num_shards} shards; at most {MAX_SHARDS} are supported"),
            ));
        }
        Ok(ShardMap {
            vocab_size,
            num_shards,
            layout,
        })
    }

    /// `v`, the real vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// `p`.
    pub fn num_shards(&self) -> usize {
        self.num_shards
    }

    /// The layout.
    pub fn layout(&self) -> ShardLayout {
        self.layout
    }

    /// Columns over all shards: `v` (uneven) or `p * ceil(v / p)` (padded).
    pub fn padded_vocab_size(&self) -> usize {
        match self.layout {
            ShardLayout::Uneven => self.vocab_size,
            ShardLayout::Padded => self.num_shards * self.vocab_size.div_ceil(self.num_shards),
        }
    }

    /// Shard `rank` (`rank < p`).
    pub fn shard(&self, rank: usize) -> Shard {
        let (v, p) = (self.vocab_size, self.num_shards);
        match self.layout {
            ShardLayout::Uneven => {
                let (base, extra) = (v / p, v % p);
                let width = base + usize::from(rank < extra);
                Shard {
                    rank,
                    start: rank * base + rank.min(extra),
                    width,
                    real: width,
                }
            }
            ShardLayout::Padded => {
                let k = v.div_ceil(p);
                let start = rank * k;
                Shard {
                    rank,
                    start,
                    width: k,
                    real: v.saturating_sub(start).min(k),
                }
            }
        }
    }

    /// Every shard, in rank order.
    pub fn shards(&self) -> Vec<Shard> {
        (0..self.num_shards).map(|r| self.shard(r)).collect()
    }

    /// The shard holding vocabulary entry `id` and its local column; `None`
    /// for `id >= v`.
    pub fn owner(&self, id: usize) -> Option<(usize, usize)> {
        self.shards()
            .into_iter()
            .find(|s| id >= s.start && id < s.start + s.real)
            .map(|s| (s.rank, id - s.start))
    }

    /// The shards' column ranges, e.g. `v 10, p 3, padded to 12: [0, 4) [4, 8)
    /// [8, 10) + 2 padding` or `v 10, p 3, uneven: [0, 4) [4, 7) [7, 10)`
    /// (the layout named once: a padded layout says by how much).
    pub fn describe(&self) -> String {
        let ranges: Vec<String> = self
            .shards()
            .iter()
            .map(|s| {
                let pad = s.width - s.real;
                let range = format!("[{}, {})", s.start, s.start + s.real);
                if pad > 0 {
                    format!("{range} + {pad} padding")
                } else {
                    range
                }
            })
            .collect();
        let layout = match self.layout {
            ShardLayout::Padded if self.padded_vocab_size() > self.vocab_size => {
                format!("padded to {}", self.padded_vocab_size())
            }
            l => l.name().to_string(),
        };
        format!(
            "v {}, p {}, {layout}: {}",
            self.vocab_size,
            self.num_shards,
            ranges.join(" ")
        )
    }

    /// Splits `full: [n, w]` (`w >= v`; columns `v..` are padding values)
    /// into the `p` shards `[n, w_r]`. Padding columns the caller did not give
    /// are NaN: anything that reads them shows.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when `w < v`.
    pub fn split_columns(&self, full: ArrayView2<f64>, field: &str) -> Result<Vec<Array2<f64>>> {
        let (n, w) = full.dim();
        self.check_width(field, w, &[n, w], "[n, v]")?;
        Ok(self.split_along(full, Axis(1), f64::NAN))
    }

    /// Splits `full: [w, h]` (`w >= v` rows, rows `v..` padding) into the `p`
    /// shards `[w_r, h]`; missing padding rows are NaN.
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] when `w < v`.
    pub fn split_rows(&self, full: ArrayView2<f64>, field: &str) -> Result<Vec<Array2<f64>>> {
        let (w, h) = full.dim();
        self.check_width(field, w, &[w, h], "[v, h]")?;
        Ok(self.split_along(full, Axis(0), f64::NAN))
    }

    /// Splits `full` along the vocabulary `axis` (the columns of `[n, w]`,
    /// `Axis(1)`, or the rows of `[w, h]`, `Axis(0)`) into the `p` shards,
    /// slots past the given `w` entries holding `fill`, for any element
    /// type (the f32 kernels split with NaN too). The caller checks `w >=
    /// v` ([`ShardMap::check_width`]).
    pub fn split_along<A: Clone>(
        &self,
        full: ArrayView2<A>,
        axis: Axis,
        fill: A,
    ) -> Vec<Array2<A>> {
        let w = full.len_of(axis);
        let columns = axis == Axis(1);
        self.shards()
            .iter()
            .map(|s| {
                let mut shape = full.raw_dim();
                shape[axis.index()] = s.width;
                Array2::from_shape_fn(shape, |(i, j)| {
                    let g = s.start + if columns { j } else { i };
                    match (g < w, columns) {
                        (false, _) => fill.clone(),
                        (true, true) => full[[i, g]].clone(),
                        (true, false) => full[[g, j]].clone(),
                    }
                })
            })
            .collect()
    }

    /// Checks that `w` columns (rows) cover the `v` real entries: `field`
    /// of shape `actual` (`legend` its shape in the legend, e.g. `[n, v]`).
    ///
    /// # Errors
    /// [`Error::ShapeMismatch`] naming `field` when `w < v`.
    pub fn check_width(&self, field: &str, w: usize, actual: &[usize], legend: &str) -> Result<()> {
        if w < self.vocab_size {
            return Err(Error::ShapeMismatch {
                field: field.into(),
                expected: format!(
                    "{legend} with at least v = {} vocabulary entries",
                    self.vocab_size
                ),
                actual: actual.to_vec(),
            });
        }
        Ok(())
    }

    /// The real columns of the shards `parts[r]: [n, w_r]`, side by side:
    /// `[n, v]`.
    pub fn gather_columns(&self, parts: &[Array2<f64>]) -> Array2<f64> {
        let n = parts.first().map_or(0, |a| a.nrows());
        let mut out = Array2::zeros((n, self.vocab_size));
        for (s, part) in self.shards().iter().zip(parts).filter(|(s, _)| s.real > 0) {
            out.slice_axis_mut(Axis(1), Slice::from(s.start..s.start + s.real))
                .assign(&part.slice_axis(Axis(1), Slice::from(..s.real)));
        }
        out
    }

    /// The real rows of the shards `parts[r]: [w_r, h]`, stacked: `[v, h]`.
    pub fn gather_rows(&self, parts: &[Array2<f64>]) -> Array2<f64> {
        let h = parts.first().map_or(0, |a| a.ncols());
        let mut out = Array2::zeros((self.vocab_size, h));
        for (s, part) in self.shards().iter().zip(parts).filter(|(s, _)| s.real > 0) {
            out.slice_axis_mut(Axis(0), Slice::from(s.start..s.start + s.real))
                .assign(&part.slice_axis(Axis(0), Slice::from(..s.real)));
        }
        out
    }
}
