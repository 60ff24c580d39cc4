//! The typed runner of the `attention` op: the one place that checks and
//! runs it. `packshard eval` (JSON, `eval/attention.rs`) and the Python
//! package (`python/src/py.rs`) read their inputs into [`AttentionArgs`]
//! (offsets through [`offsets`], flash-attention's options through
//! [`AttnOptions::from_flash`]) and call [`attention`], so both front doors
//! give the same checks in the same order, the same errors and the same
//! fields.
//!
//! What each door reads first, in its own types: `eval` the JSON (field
//! names, nesting, integers), Python its numpy arrays (dtype, rank). Both
//! then read the offsets and the options with the functions here (a negative
//! offset or key count, a window side below -1). The checks of
//! [`attention`], in order: `impl` (a name of the attention family, as
//! `eval` checks it for every op); every input finite (`q`, `k`, `v`,
//! `grad_output`, `alibi_slopes`; the flat index in row-major order);
//! `impl` able to run here; then the implementation's own (the reference's
//! checks of shapes and `cu_seqlens`, and a refusal of any option or form
//! the implementation does not declare).
//!
//! Shape legend as in `packshard-reference`: `n_q` queries, `n_k` keys, `b`
//! segments, `h` query heads, `h_kv` key heads, `d` head dim.

use ndarray::{Array2, Array3, ArrayView3};
use packshard_reference::attention::default_scale;
use packshard_reference::attention::options::Window;
use packshard_reference::error::check_finite;
use packshard_reference::ops::{Grad, Qkv, Varlen};

use super::fields::{Fields, Out};
use super::{make, EvalError};
use crate::registry;

/// Non-negative offsets (or key counts) given as `i64`, as `usize`.
///
/// # Errors
/// `invalid_argument` naming `field[i]` for a negative value, with the
/// message `eval` gives for a negative integer in a JSON list.
pub fn offsets(field: &str, xs: &[i64]) -> Result<Vec<usize>, EvalError> {
    xs.iter()
        .enumerate()
        .map(|(i, &x)| {
            usize::try_from(x).map_err(|_| {
                EvalError::invalid(
                    &format!("{field}[{i}]"),
                    format!("expected a non-negative integer, found the negative number {x}"),
                )
            })
        })
        .collect()
}

/// flash-attention's options of `flash_attn_varlen_func` beyond `causal`:
/// `window_size = (left, right)` (-1 unbounded, bottom-right aligned),
/// `softcap` (0: none), `alibi_slopes: [h]` and `seqused_k: [b]`
/// (docs/INTERFACE.md, `attention`; the math is
/// `packshard_reference::attention::options`). [`Default`] is none of them
/// (the results without options, bit for bit).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AttnOptions {
    /// `window_size` (bottom-right aligned; [`Window::UNBOUNDED`]: none).
    pub window: Window,
    /// `softcap` (0: none).
    pub softcap: f64,
    /// `alibi_slopes: [h]`, one per query head.
    pub alibi_slopes: Option<Vec<f64>>,
    /// `seqused_k: [b]`, each at most its segment's `l_k`.
    pub seqused_k: Option<Vec<usize>>,
}

impl AttnOptions {
    /// From flash-attention's arguments (`None`: the option's default). The
    /// values are checked by [`attention`] and the reference when the call
    /// runs; here only what cannot be held at all.
    ///
    /// # Errors
    /// The reference's error naming `window_size[0]` / `window_size[1]`
    /// (below -1); `invalid_argument` naming `seqused_k[s]` (negative,
    /// [`offsets`]).
    pub fn from_flash(
        window_size: Option<(i64, i64)>,
        softcap: Option<f64>,
        alibi_slopes: Option<Vec<f64>>,
        seqused_k: Option<&[i64]>,
    ) -> Result<Self, EvalError> {
        let window = match window_size {
            Some((left, right)) => Window::from_flash(left, right)?,
            None => Window::UNBOUNDED,
        };
        let seqused_k = seqused_k.map(|u| offsets("seqused_k", u)).transpose()?;
        Ok(AttnOptions {
            window,
            softcap: softcap.unwrap_or(0.0),
            alibi_slopes,
            seqused_k,
        })
    }

    /// `p` with these options.
    pub fn apply<'a>(&'a self, p: Varlen<'a>) -> Varlen<'a> {
        p.with_window(self.window)
            .with_softcap(self.softcap)
            .with_alibi_slopes(self.alibi_slopes.as_deref())
            .with_seqused_k(self.seqused_k.as_deref())
    }

    /// The keys segment `s` (of `l_k` keys) uses: `seqused_k[s]` when given
    /// (bounded by `l_k`), else `l_k`.
    pub fn used_keys(&self, s: usize, lk: usize) -> Option<usize> {
        self.seqused_k
            .as_ref()
            .and_then(|u| u.get(s).copied())
            .map(|u| u.min(lk))
    }
}

/// The integer and option arguments of an `attention` call as
/// flash-attention spells them (the Python package's arguments), not yet
/// read: `cu_seqlens: [b + 1]` (the query offsets), `cu_seqlens_k: [b + 1]`
/// (`None`: self-attention), and the options of [`AttnOptions::from_flash`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FlashArgs {
    /// `[b + 1]`, the query offsets.
    pub cu_seqlens: Vec<i64>,
    /// `[b + 1]`, the key offsets; `None`: `cu_seqlens`.
    pub cu_seqlens_k: Option<Vec<i64>>,
    /// `(left, right)`, -1 unbounded.
    pub window_size: Option<(i64, i64)>,
    /// `c` of `c * tanh(s / c)`; `None` or 0: none.
    pub softcap: Option<f64>,
    /// `[h]`.
    pub alibi_slopes: Option<Vec<f64>>,
    /// `[b]`.
    pub seqused_k: Option<Vec<i64>>,
}

/// What [`FlashArgs::read`] gives: the query offsets (`[b + 1]`), the key
/// offsets (`None`: self-attention) and the options.
pub type ReadFlash = (Vec<usize>, Option<Vec<usize>>, AttnOptions);

impl FlashArgs {
    /// The offsets and options, read in the order `eval` reads them:
    /// `cu_seqlens`, `cu_seqlens_k`, then the options. The query offsets are
    /// named as `eval` names them: `cu_seqlens` for self-attention,
    /// `cu_seqlens_q` beside a `cu_seqlens_k`.
    ///
    /// # Errors
    /// As [`offsets`] (naming `cu_seqlens[i]`, `cu_seqlens_q[i]`,
    /// `cu_seqlens_k[i]`) and [`AttnOptions::from_flash`].
    pub fn read(self) -> Result<ReadFlash, EvalError> {
        let name = if self.cu_seqlens_k.is_some() {
            "cu_seqlens_q"
        } else {
            "cu_seqlens"
        };
        let cu = offsets(name, &self.cu_seqlens)?;
        let cu_k = self
            .cu_seqlens_k
            .map(|c| offsets("cu_seqlens_k", &c))
            .transpose()?;
        let options = AttnOptions::from_flash(
            self.window_size,
            self.softcap,
            self.alibi_slopes,
            self.seqused_k.as_deref(),
        )?;
        Ok((cu, cu_k, options))
    }
}

/// The arguments of the `attention` op (flash_attn_varlen_func's form):
/// `q, grad_output: [n_q, h, d]`, `k, v: [n_k, h_kv, d]` (`h_kv` dividing
/// `h`; query head `a` reads key head `a / (h / h_kv)`); `cu_seqlens: [b +
/// 1]` the query offsets (and the key offsets unless `cu_seqlens_k` is
/// given). `T`: `f64`, or `f32` for the Python package's in-place f32 call.
#[derive(Debug, Clone)]
pub struct AttentionArgs<'a, T = f64> {
    /// `[n_q, h, d]`.
    pub q: ArrayView3<'a, T>,
    /// `[n_k, h_kv, d]`.
    pub k: ArrayView3<'a, T>,
    /// `[n_k, h_kv, d]`.
    pub v: ArrayView3<'a, T>,
    /// `[b + 1]`, leading 0, last `n_q`: `cu_seqlens_q`.
    pub cu_seqlens: Vec<usize>,
    /// `[b + 1]`, leading 0, last `n_k`; `None`: self-attention
    /// (`cu_seqlens`).
    pub cu_seqlens_k: Option<Vec<usize>>,
    /// Causal (bottom-right) mask within each segment.
    pub causal: bool,
    /// `1/sqrt(d)` when `None`.
    pub scale: Option<f64>,
    /// `[n_q, h, d]`: with it, the backward too.
    pub grad_output: Option<ArrayView3<'a, T>>,
    /// flash-attention's `window_size`, `softcap`, `alibi_slopes`,
    /// `seqused_k` ([`AttnOptions`]; default none).
    pub options: AttnOptions,
}

impl<T> AttentionArgs<'_, T> {
    /// The scale: as given, or `1/sqrt(d)` (`d` at least 1).
    pub fn scale(&self) -> f64 {
        self.scale
            .unwrap_or_else(|| default_scale(self.q.dim().2.max(1)))
    }

    /// The key offsets: `cu_seqlens_k`, or `cu_seqlens` for self-attention.
    pub fn cu_k(&self) -> &[usize] {
        self.cu_seqlens_k.as_deref().unwrap_or(&self.cu_seqlens)
    }

    /// The problem: offsets, mask, scale and options.
    pub fn problem(&self) -> Varlen<'_> {
        self.options.apply(Varlen::cross(
            &self.cu_seqlens,
            self.cu_k(),
            self.causal,
            self.scale(),
        ))
    }
}

fn t2(a: Array2<f64>) -> Out {
    Out::Tensor(a.into_dyn())
}
fn t3(a: Array3<f64>) -> Out {
    Out::Tensor(a.into_dyn())
}

/// `attention` through the registered implementation `imp` (`reference`:
/// the f64 reference; an optimized one gets its inputs rounded to its
/// precision and gives its results widened). Fields, in order: `output:
/// [n_q, h, d]`, `lse: [h, n_q]`, `impl` (not for the reference), and with
/// a `grad_output` `grad_q: [n_q, h, d]`, `grad_k`, `grad_v: [n_k, h_kv,
/// d]`.
///
/// # Errors
/// The checks of the module docs, in their order: `invalid_argument` on
/// `impl` (not of the family: `eval`'s [`super::no_impl`]; unable to run
/// here); `non_finite_input` naming the tensor and flat index; the
/// implementation's errors (`shape_mismatch`, `invalid_argument` on
/// `cu_seqlens[i]`, on a window or an option it does not declare, ...).
pub fn attention(imp: &str, a: &AttentionArgs<'_>) -> Result<Fields, EvalError> {
    let list = registry::attention();
    super::loss::known(&list, "attention", imp)?;
    check_finite("q", a.q.iter())?;
    check_finite("k", a.k.iter())?;
    check_finite("v", a.v.iter())?;
    if let Some(go) = &a.grad_output {
        check_finite("grad_output", go.iter())?;
    }
    if let Some(s) = &a.options.alibi_slopes {
        check_finite("alibi_slopes", s.iter())?;
    }
    let op = make(&list, imp)?;
    let p = a.problem();
    let x = Qkv::new(a.q, a.k, a.v);
    let fwd = op.varlen_forward(x, &p)?;
    let grads = match a.grad_output {
        Some(go) => Some(op.varlen_backward(x, &p, Grad::new(&fwd, go))?),
        None => None,
    };
    let mut out: Fields = vec![("output", t3(fwd.output)), ("lse", t2(fwd.lse))];
    if imp != registry::REFERENCE {
        out.push(("impl", Out::Str(imp.into())));
    }
    if let Some(g) = grads {
        out.push(("grad_q", t3(g.grad_q)));
        out.push(("grad_k", t3(g.grad_k)));
        out.push(("grad_v", t3(g.grad_v)));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flash_arguments_are_read_and_bad_ones_named() {
        let o = AttnOptions::from_flash(Some((3, -1)), Some(5.0), None, Some(&[2, 0])).unwrap();
        assert_eq!(o.window.to_flash(), (3, -1));
        assert_eq!(o.seqused_k, Some(vec![2, 0]));
        let e = AttnOptions::from_flash(Some((-2, 0)), None, None, None).unwrap_err();
        assert!(e.to_string().contains("window_size[0]"), "{e}");
        let e = AttnOptions::from_flash(None, None, None, Some(&[1, -1])).unwrap_err();
        assert_eq!(
            e.message,
            "seqused_k[1]: expected a non-negative integer, found the negative number -1"
        );
        assert_eq!(
            AttnOptions::from_flash(None, None, None, None).unwrap(),
            AttnOptions::default()
        );
    }
}
