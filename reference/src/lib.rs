//! # packshard-reference
//!
//! The ground truth of packshard: plain, readable CPU code in `f64` (no
//! threads, no `unsafe`, no cleverness) that every optimized kernel, and every
//! framework author's kernel, is checked against.
//!
//! ## Shape legend
//!
//! | name | meaning |
//! |---|---|
//! | `n` | sequences (or tokens, for token-level ops) |
//! | `n_tok` | total tokens of a packed batch |
//! | `b` | segments (sequences) in a packed batch |
//! | `max_seq_len` | tokens per pack (row) |
//! | `h` | attention heads, or the hidden size where noted |
//! | `d` | head dimension |
//! | `v` | vocabulary size |
//! | `p` | vocabulary shards (ranks) |
//!
//! `cu_seqlens: [b + 1]` always starts at 0 and excludes padding.
//!
//! ## Modules
//!
//! - [`packing`]: length histograms, SPFHP / LPFHP / NNLSHP (Krell et al.,
//!   arXiv:2107.02027), FFD / BFD, LPHP and the LP lower bound on packs
//!   (column generation, [`packing::lphp`]), plans on explicit lengths, packed batches.
//! - [`vocab`]: vocabulary-parallel softmax, cross-entropy and input
//!   embedding (Yeung et al., arXiv:2411.05288): the unsharded reference, the
//!   [`vocab::Collective`] trait and the `naive`, `alg1`, `alg2` algorithms.
//! - [`attention`]: dense masked and variable-length attention (GQA,
//!   `cu_seqlens_q` / `cu_seqlens_k`, bottom-right causal), forward and backward.
//! - [`bert`]: a plain f64 BERT with hand-written backward passes, padded and
//!   packed batches, MLM/NSP losses.
//! - [`decoder`]: a plain f64 causal decoder (Llama / GPT-NeoX shape: RMSNorm or
//!   LayerNorm, rotary embeddings, GQA, SwiGLU or GELU, tied or untied head) with
//!   hand-written backward passes, over varlen or dense layouts and key/value caches.
//! - [`ops`]: the op families, one trait each, that every implementation
//!   (this reference, the optimized and GPU kernels, a user's kernel) meets.
//! - [`precision`]: what an implementation computes in ([`ops::Precision`]),
//!   each format's unit roundoff and the one rounding to f32, bf16 and f16.
//! - [`faults`]: the fault catalogue of `docs/FAULTS.md` as data, each kind's canonical example.
//! - [`error`]: the one typed error, mapped onto the `eval` error kinds.

#![forbid(unsafe_code)]
#![warn(missing_docs)]

/// A per-layer parameter struct `$ty<A = f64>` (f64 for the reference,
/// another element type `A` for a kernel's copy), declared from one table of
/// its fields in declaration order, each an `Array2<A>` (a matrix) or an
/// `Array1<A>` (a vector) with its Hugging Face name within the layer, and
/// the tensor-wise methods that table gives: `try_map`, `map`, `zeros_like`,
/// `from_fn`, `named` and `named_mut`, all visiting the tensors in that order.
macro_rules! layer_params {
    (
        $(#[$meta:meta])*
        pub struct $ty:ident {
            $($(#[$fmeta:meta])* $field:ident: $arr:ident $name:literal),* $(,)?
        }
    ) => {
        $(#[$meta])*
        pub struct $ty<A = f64> {
            $($(#[$fmeta])* pub $field: ndarray::$arr<A>,)*
        }

        impl<A> $ty<A> {
            /// Each tensor through `m` (the matrices) or `v` (the vectors),
            /// called with the tensor's Hugging Face name within the layer
            /// in field order.
            ///
            /// # Errors
            /// The first error of `m` or `v`.
            pub fn try_map<B, E>(
                &self,
                mut m: impl FnMut(
                    &str,
                    &ndarray::Array2<A>,
                ) -> std::result::Result<ndarray::Array2<B>, E>,
                mut v: impl FnMut(
                    &str,
                    &ndarray::Array1<A>,
                ) -> std::result::Result<ndarray::Array1<B>, E>,
            ) -> std::result::Result<$ty<B>, E> {
                Ok($ty {
                    $($field: layer_params!(@pick $arr, m, v)($name, &self.$field)?,)*
                })
            }

            /// Each tensor built from its Hugging Face name within the
            /// layer by `m` (the matrices) or `v` (the vectors), in field order.
            pub fn from_fn(
                mut m: impl FnMut(&str) -> ndarray::Array2<A>,
                mut v: impl FnMut(&str) -> ndarray::Array1<A>,
            ) -> Self {
                $ty {
                    $($field: layer_params!(@pick $arr, m, v)($name),)*
                }
            }

            /// Each tensor, as a view, with its Hugging Face name within the
            /// layer, in field order.
            pub fn named(&self) -> Vec<(&'static str, ndarray::ArrayViewD<'_, A>)> {
                vec![$(($name, self.$field.view().into_dyn())),*]
            }

            /// As `named`, mutable.
            pub fn named_mut(&mut self) -> Vec<(&'static str, ndarray::ArrayViewMutD<'_, A>)> {
                vec![$(($name, self.$field.view_mut().into_dyn())),*]
            }

            /// Each tensor through `m` (the matrices) or `v` (the vectors).
            pub fn map<B>(
                &self,
                m: impl Fn(&ndarray::Array2<A>) -> ndarray::Array2<B>,
                v: impl Fn(&ndarray::Array1<A>) -> ndarray::Array1<B>,
            ) -> $ty<B> {
                let mapped = self.try_map(
                    |_, a| Ok::<_, std::convert::Infallible>(m(a)),
                    |_, a| Ok(v(a)),
                );
                match mapped {
                    Ok(p) => p,
                    Err(never) => match never {},
                }
            }
        }

        impl<A: ndarray::LinalgScalar> $ty<A> {
            /// The same shapes, all zero (a gradient accumulator).
            pub fn zeros_like(&self) -> Self {
                self.map(
                    |a| ndarray::Array2::zeros(a.raw_dim()),
                    |a| ndarray::Array1::zeros(a.raw_dim()),
                )
            }
        }
    };
    (@pick Array2, $m:ident, $v:ident) => { $m };
    (@pick Array1, $m:ident, $v:ident) => { $v };
}

/// A model's parameter struct `$ty` (f64), declared from one table of its
/// fields in declaration order (the `head` tensors, the `layers`, the `tail`
/// tensors; each tensor an `Array2` or `Array1` with its Hugging Face name),
/// and its `named_all` and `named_all_mut`: every tensor (as a view, or a
/// mutable one) with its name, in that order, a layer's tensors named
/// `$prefix{i}.` and the layer's [`layer_params!`] name.
macro_rules! model_params {
    (
        $(#[$meta:meta])*
        pub struct $ty:ident {
            head { $($(#[$hmeta:meta])* $h:ident: $harr:ident $hn:literal),* $(,)? }
            $(#[$lmeta:meta])*
            layers: Vec<$layer:ident> $prefix:literal,
            tail { $($(#[$tmeta:meta])* $t:ident: $tarr:ident $tn:literal),* $(,)? }
        }
    ) => {
        $(#[$meta])*
        pub struct $ty {
            $($(#[$hmeta])* pub $h: ndarray::$harr<f64>,)*
            $(#[$lmeta])*
            pub layers: Vec<$layer>,
            $($(#[$tmeta])* pub $t: ndarray::$tarr<f64>,)*
        }

        impl $ty {
            fn named_all(&self) -> Vec<(String, ndarray::ArrayViewD<'_, f64>)> {
                model_params!(@list self, view, named, iter, $prefix, [$($h $hn),*], [$($t $tn),*])
            }

            fn named_all_mut(&mut self) -> Vec<(String, ndarray::ArrayViewMutD<'_, f64>)> {
                model_params!(
                    @list self, view_mut, named_mut, iter_mut, $prefix, [$($h $hn),*], [$($t $tn),*]
                )
            }
        }
    };
    (
        @list $s:ident, $view:ident, $layer:ident, $iter:ident, $prefix:literal,
        [$($h:ident $hn:literal),*], [$($t:ident $tn:literal),*]
    ) => {{
        let mut out = vec![$(($hn.to_string(), $s.$h.$view().into_dyn())),*];
        for (i, l) in $s.layers.$iter().enumerate() {
            let named = l.$layer().into_iter();
            out.extend(named.map(|(name, t)| (format!("{}{i}.{name}", $prefix), t)));
        }
        out.extend([$(($tn.to_string(), $s.$t.$view().into_dyn())),*]);
        out
    }};
}

pub mod attention;
pub mod bert;
pub mod decoder;
pub mod error;
pub mod faults;
pub mod limits;
pub mod ops;
pub mod packing;
pub mod precision;
pub mod step;
pub mod vocab;

#[cfg(test)]
mod testutil;

pub use error::{Error, Result};
