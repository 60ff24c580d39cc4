"""flash-attention's options of ``flash_attn_varlen_func`` beyond ``causal``,
as the package takes them (docs/INTERFACE.md, ``attention``):

- ``window_size = (left, right)``: query ``r`` of a segment of ``l_q`` queries
  over ``l_k`` keys sees key ``c`` only if ``r + l_k - l_q - left <= c <= r +
  l_k - l_q + right`` (bottom-right aligned, flash-attention >= 2.1); ``-1``
  is unbounded; ``causal`` is ``right = 0``; never across segments;
- ``softcap``: each scaled score ``s`` becomes ``softcap * tanh(s / softcap)``
  before the mask (``0``/``None``: none);
- ``alibi_slopes``: ``[h]`` floats, one per query head; the bias ``-slope *
  |r + l_k - l_q - c|`` is added after the cap;
- ``seqused_k``: ``[b]`` ints, segment ``s`` uses only its first
  ``seqused_k[s]`` keys (and ``l_k`` above is that count).

The reference checks the values (naming ``window_size[0]``, ``softcap``,
``alibi_slopes[a]``, ``seqused_k[s]``, ...); here they are only put in the
native call's types.
"""

import numpy as _np

# The option names, as flash_attn_varlen_func spells them.
NAMES = ("window_size", "softcap", "alibi_slopes", "seqused_k")


def native(window_size=None, softcap=None, alibi_slopes=None, seqused_k=None, *, error):
    """The four options as the native functions take them (``None``: absent):
    ``window_size`` a pair of ints, ``softcap`` a float, ``alibi_slopes`` a
    list of floats, ``seqused_k`` a list of ints. ``error(kind, field,
    message)`` builds the ``PackshardError`` for a value of the wrong form."""
    w = None
    if window_size is not None:
        pair = _np.asarray(window_size)
        if pair.shape != (2,) or pair.dtype.kind not in "iu":
            raise error("invalid_argument", "window_size",
                        f"window_size: {window_size!r} is not two integers (left, right); "
                        "-1 is unbounded")
        w = (int(pair[0]), int(pair[1]))
    cap = None if softcap is None else float(softcap)
    slopes = None
    if alibi_slopes is not None:
        a = _np.asarray(alibi_slopes, dtype=_np.float64)
        if a.ndim != 1:
            raise error("shape_mismatch", "alibi_slopes",
                        f"alibi_slopes: shape {list(a.shape)} does not match the expected [h] "
                        "(one slope per query head; flash-attention's [b, h] form is not taken)")
        slopes = a.tolist()
    used = None
    if seqused_k is not None:
        u = _np.asarray(seqused_k)
        if u.ndim != 1 or (u.size and u.dtype.kind not in "iu"):
            raise error("invalid_argument", "seqused_k",
                        f"seqused_k: expected [b] integers, found shape {list(u.shape)} "
                        f"dtype {u.dtype}")
        used = [int(x) for x in u]
    return {"window_size": w, "softcap": cap, "alibi_slopes": slopes, "seqused_k": used}


def given(args):
    """The options a case's ``args`` set (present and not None)."""
    return [n for n in NAMES if args.get(n) is not None]
