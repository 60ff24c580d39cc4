//! flash-attention's options of `flash_attn_varlen_func` beyond `causal`, as
//! the Python package passes them: `window_size = (left, right)` (-1
//! unbounded, bottom-right aligned), `softcap` (0 or `None`: none),
//! `alibi_slopes: [h]` and `seqused_k: [b]` (docs/INTERFACE.md, `attention`;
//! the math is `packshard_reference::attention::options`). The values are
//! checked by the reference (`check_varlen`, the ALiBi check) when the call
//! runs; here only what cannot be held at all: a window side below -1 and a
//! negative key count.

use packshard_oracle::eval::EvalError;
use packshard_reference::attention::options::Window;
use packshard_reference::ops::Varlen;

/// The four options of one attention call; [`Default`] is none of them
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
    /// From flash-attention's arguments (`None`: the option's default).
    ///
    /// # Errors
    /// `invalid_argument` naming `window_size[0]` / `window_size[1]` (below
    /// -1) or `seqused_k[s]` (negative).
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
        let seqused_k = match seqused_k {
            Some(u) => Some(
                u.iter()
                    .enumerate()
                    .map(|(s, &x)| {
                        usize::try_from(x).map_err(|_| {
                            EvalError::invalid(
                                &format!("seqused_k[{s}]"),
                                format!("{x}: a key count is at least 0"),
                            )
                        })
                    })
                    .collect::<Result<Vec<_>, _>>()?,
            ),
            None => None,
        };
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
        assert!(e.to_string().contains("seqused_k[1]"), "{e}");
        assert_eq!(
            AttnOptions::from_flash(None, None, None, None).unwrap(),
            AttnOptions::default()
        );
    }
}
