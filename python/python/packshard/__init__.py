"""packshard: the correctness oracle for transformer kernels, from Python.

Every op of the registry as a numpy function, with keyword arguments named as
in docs/INTERFACE.md (the ``packshard eval`` contract): the f64 reference by
default, any registered implementation by name (``impl="attention_varlen_tiled"``).
Tensors are numpy arrays read in place (no copy for float64 input of any
layout; other dtypes are converted once to float64), except that
``attention(..., impl="attention_varlen_tiled")`` reads float32 arrays in place
too. Results are new arrays in the kernel's precision: float64 from the
reference, float32 from an f32 or bf16 kernel (exactly the values it computed),
unless the call asks for ``dtype=numpy.float64``.
Bad input raises :class:`PackshardError` with ``kind``, ``field``, ``index``
and ``message``.

Shape legend: ``n_tok`` tokens, ``b`` segments, ``h`` heads, ``d`` head dim,
``n`` rows, ``v`` vocabulary, ``w >= v`` given columns/rows, ``p`` shards.
See docs/PYTHON.md for every function.
"""

import json as _json

import numpy as _np

from . import _native
from ._native import PackshardError

__version__: str = _native.__version__

__all__ = [
    "__version__",
    "PackshardError",
    "attention",
    "cross_entropy",
    "linear_cross_entropy",
    "embedding",
    "pack",
    "batch",
    "eval",
    "implementations",
    "testing",
    "causal_labels",
    "causal_conversions",
]

REFERENCE = "reference"
# The kernel that reads float32 arrays in place (core::F32_NATIVE on the Rust side).
_F32_NATIVE = "attention_varlen_tiled"


def _f64(x, name):
    """``x`` as a float64 array, without a copy when it already is one;
    narrow floats of ``ml_dtypes`` (``bfloat16``, ...) through float32, which
    holds each of their values exactly."""
    a = _np.asarray(x)
    if a.dtype != _np.float64:
        if a.dtype.kind == "V" and _np.dtype(a.dtype).itemsize <= 2:  # ml_dtypes floats
            a = a.astype(_np.float32)
        elif a.dtype.kind not in "fiub":
            raise _error("invalid_argument", name, f"{name}: dtype {a.dtype} is not numeric")
        a = a.astype(_np.float64)
    return a


def _ints(x, name):
    a = _np.asarray(x)
    if a.size == 0:
        return _np.zeros(0, dtype=_np.int64)
    if a.dtype.kind not in "iub":
        raise _error("invalid_argument", name, f"{name}: expected integers, found dtype {a.dtype}")
    if a.ndim != 1:
        raise _error(
            "shape_mismatch", name, f"{name}: shape {list(a.shape)} does not match the expected [n]"
        )
    return a.astype(_np.int64, copy=False)


def _error(kind, field, message):
    e = PackshardError(message)
    e.kind, e.field, e.index, e.message = kind, field, None, message
    return e


def _rank(a, ndim, name, legend):
    if a.ndim != ndim:
        raise _error(
            "shape_mismatch", name, f"{name}: shape {list(a.shape)} does not match the expected {legend}"
        )
    return a


def _want_grad(want_grad, grad, name):
    if want_grad is None:
        return grad is not None
    if grad is not None and not want_grad:
        raise _error("invalid_argument", name, f"{name}: given without want_grad=True")
    if want_grad and grad is None:
        raise _error("missing_field", name, f"{name}: required field is missing")
    return bool(want_grad)


_PRECISIONS = {}


def _wants_f64(impl, dtype):
    """Whether the results of ``impl`` are returned as float64: asked for with
    ``dtype``, or the kernel's own precision (the reference, any f64 kernel; an
    unknown name too, so that its error is the native call's)."""
    if dtype is not None:
        d = _np.dtype(dtype)
        if d not in (_np.float32, _np.float64):
            raise _error("invalid_argument", "dtype",
                         f"dtype: {d} is neither float32 nor float64")
        return d == _np.float64
    if not _PRECISIONS:
        _PRECISIONS.update((r["name"], r["precision"]) for r in _native.registry_list())
    return _PRECISIONS.get(impl, "f64") == "f64"


def _results_as(r, f64):
    """The float arrays of ``r`` as float64 (``f64``) or float32 (exact for a
    kernel of at most f32 precision), each converted only where it is not one."""
    want = _np.float64 if f64 else _np.float32
    return {key: x.astype(want) if isinstance(x, _np.ndarray) and x.dtype.kind == "f"
            and x.dtype != want else x for key, x in r.items()}


from . import attention_options as _attention_options  # noqa: E402


def _f32_in_place(xs):
    """``xs`` as arrays when every one is float32 (then read in place), else None."""
    arrays = [_np.asarray(x) for x in xs]
    return arrays if all(a.dtype == _np.float32 for a in arrays) else None


def attention(q, k, v, cu_seqlens=None, *, causal=False, scale=None, grad_output=None,
              want_grad=None, impl=REFERENCE, cu_seqlens_q=None, cu_seqlens_k=None,
              max_seqlen_q=None, max_seqlen_k=None, dtype=None, window_size=None, softcap=None,
              alibi_slopes=None, seqused_k=None):
    """Varlen attention (flash_attn_varlen_func's form).

    ``q``: ``[n_q, h, d]``; ``k``, ``v``: ``[n_k, h_kv, d]`` (``h_kv`` divides
    ``h``; query head ``a`` reads key head ``a // (h // h_kv)``);
    ``cu_seqlens_q`` (or ``cu_seqlens``, the self-attention form) and
    ``cu_seqlens_k`` (default: the query offsets): ``[b + 1]`` ints, leading
    0, last ``n_q`` / ``n_k``; ``causal`` masks are bottom-right aligned
    (query ``r`` of a segment sees keys ``c <= r + l_k - l_q``);
    ``max_seqlen_q``/``max_seqlen_k``, when given, must bound the segments;
    ``scale`` default ``1/sqrt(d)``; with ``grad_output`` (``[n_q, h, d]``)
    also the backward. Returns a dict: ``output`` ``[n_q, h, d]``, ``lse``
    ``[h, n_q]`` (natural log), and ``grad_q``, ``grad_k``, ``grad_v``
    (``[n_k, h_kv, d]``) with a ``grad_output``.

    flash-attention's options, each absent by default
    (:mod:`packshard.attention_options`): ``window_size=(left, right)`` (-1
    unbounded, bottom-right aligned), ``softcap`` (``c * tanh(s / c)`` on the
    scores before the mask), ``alibi_slopes`` (``[h]``, bias ``-slope * |r +
    l_k - l_q - c|``), ``seqused_k`` (``[b]`` keys used per segment). A
    kernel that does not implement one refuses it (``invalid_argument``
    naming the field), never ignores it.

    The arrays are float32 for an f32 or bf16 ``impl`` (its own values, not
    widened) and float64 for the reference; ``dtype=numpy.float64`` (or
    ``numpy.float32``) asks for that dtype instead. ``impl="attention_varlen_tiled"``
    reads float32 ``q``, ``k``, ``v``, ``grad_output`` in place (C-contiguous:
    no copy); other inputs go through float64 as for every kernel.
    """
    f64 = _wants_f64(impl, dtype)
    if impl == _F32_NATIVE:
        given = (q, k, v) if grad_output is None else (q, k, v, grad_output)
        f32 = _f32_in_place(given)
        if f32 is not None:
            q, k, v = f32[:3]
            if grad_output is not None:
                grad_output = f32[3]
    else:
        f32 = None
    if f32 is None:
        q, k, v = _f64(q, "q"), _f64(k, "k"), _f64(v, "v")
    q = _rank(q, 3, "q", "[n_q, h, d]")
    k = _rank(k, 3, "k", "[n_k, h_kv, d]")
    v = _rank(v, 3, "v", "[n_k, h_kv, d]")
    if cu_seqlens is None and cu_seqlens_q is None:
        raise _error("missing_field", "cu_seqlens_q", "cu_seqlens_q: required field is missing")
    cu_q = _ints(cu_seqlens_q if cu_seqlens_q is not None else cu_seqlens,
                 "cu_seqlens_q" if cu_seqlens_q is not None else "cu_seqlens")
    if cu_seqlens is not None and cu_seqlens_q is not None and not _np.array_equal(
            _ints(cu_seqlens, "cu_seqlens"), cu_q):
        raise _error("invalid_argument", "cu_seqlens_q",
                     "cu_seqlens_q: differs from cu_seqlens (give one of the two)")
    cu_k = None if cu_seqlens_k is None else _ints(cu_seqlens_k, "cu_seqlens_k")
    for name, bound, cu in (("max_seqlen_q", max_seqlen_q, cu_q),
                            ("max_seqlen_k", max_seqlen_k, cu_q if cu_k is None else cu_k)):
        longest = int(_np.diff(cu).max()) if cu.size > 1 else 0
        if bound is not None and int(bound) < longest:
            raise _error("invalid_argument", name,
                         f"{name}: {int(bound)} is below the longest segment ({longest})")
    want = _want_grad(want_grad, grad_output, "grad_output")
    go = grad_output if f32 is not None else None if not want else _f64(grad_output, "grad_output")
    go = _rank(go, 3, "grad_output", "[n_q, h, d]") if want else None
    run = _native.attention if f32 is None else _native.attention_f32
    opts = _attention_options.native(window_size, softcap, alibi_slopes, seqused_k, error=_error)
    r = run(q, k, v, cu_q, bool(causal), None if scale is None else float(scale), go, impl, cu_k,
            **opts)
    # The native call gives eval's fields (the shared runner), `impl` among
    # them; this dict has held arrays only, and kernels written as
    # `{k: v.astype(...) for k, v in r.items()}` rely on it.
    r.pop("impl", None)
    return _results_as(r, f64)


def _loss_options(ignore_index, label_smoothing, smoothing, z_loss, reduction, vocab_size,
                  num_shards, algorithm, layout, softcap, grad_output=None):
    return {
        "softcap": None if softcap is None else float(softcap),
        "grad_output": None if grad_output is None
        else _np.asarray(grad_output, dtype=_np.float64).reshape(-1).tolist(),
        "ignore_index": None if ignore_index is None else int(ignore_index),
        "label_smoothing": None if label_smoothing is None else float(label_smoothing),
        "smoothing": smoothing,
        "z_loss": None if z_loss is None else float(z_loss),
        "reduction": reduction,
        "vocab_size": None if vocab_size is None else int(vocab_size),
        "num_shards": None if num_shards is None else int(num_shards),
        "algorithm": algorithm,
        "layout": layout,
    }


def cross_entropy(logits, targets, *, ignore_index=-100, label_smoothing=0.0, smoothing=None,
                  z_loss=0.0, reduction="mean", vocab_size=None, num_shards=None, algorithm=None,
                  layout=None, softcap=None, want_grad=False, grad_output=None, impl=REFERENCE,
                  dtype=None):
    """Cross-entropy of ``logits`` ``[n, w]`` against ``targets`` ``[n]``.

    Columns ``vocab_size..w`` are padding, never read (NaN allowed there);
    ``-inf`` logits are masked entries. Unsharded by default; ``num_shards``
    runs the vocabulary-parallel form (``algorithm`` ``naive``, ``alg1``,
    ``alg2`` (default), ``layout`` ``uneven`` or ``padded``). ``softcap`` ``c``
    caps the logits to ``c * tanh(z / c)`` first (Gemma 2). ``grad_output``
    (with ``want_grad``) is the upstream gradient: ``[n]`` under
    ``reduction="none"`` (token ``i``'s gradient times ``grad_output[i]``),
    ``[1]`` otherwise. Returns a dict:
    ``loss``, ``per_token_loss`` ``[n]``, ``logsumexp`` ``[n]``,
    ``num_tokens``, ``algorithm``, ``grad_logits`` ``[n, w]`` with
    ``want_grad`` (padding columns 0), and for sharded runs ``num_shards``,
    ``layout``, ``collectives``, ``peak_bytes_per_shard``, ``shards``.
    Arrays in the kernel's precision unless ``dtype`` says (as :func:`attention`).
    """
    f64 = _wants_f64(impl, dtype)
    logits = _rank(_f64(logits, "logits"), 2, "logits", "[n, v]")
    return _results_as(_native.cross_entropy(
        logits, _ints(targets, "targets"),
        _loss_options(ignore_index, label_smoothing, smoothing, z_loss, reduction, vocab_size,
                      num_shards, algorithm, layout, softcap, grad_output),
        bool(want_grad), impl), f64)


def linear_cross_entropy(hidden, weight, targets, *, ignore_index=-100, label_smoothing=0.0,
                         smoothing=None, z_loss=0.0, reduction="mean", vocab_size=None,
                         num_shards=None, algorithm=None, layout=None, softcap=None,
                         want_grad=False, grad_output=None, impl=REFERENCE, dtype=None):
    """The output layer ``hidden @ weight.T`` and its cross-entropy.

    ``hidden`` ``[n, h]``, ``weight`` ``[w, h]`` (rows ``vocab_size..`` padding),
    ``targets`` ``[n]``; options as :func:`cross_entropy`. Adds ``grad_hidden``
    ``[n, h]`` and ``grad_weight`` ``[w, h]`` with ``want_grad``, and
    ``vocab_size``. Arrays in the kernel's precision unless ``dtype`` says (as
    :func:`attention`).
    """
    f64 = _wants_f64(impl, dtype)
    hidden = _rank(_f64(hidden, "hidden"), 2, "hidden", "[n, h]")
    weight = _rank(_f64(weight, "weight"), 2, "weight", "[v, h]")
    return _results_as(_native.linear_cross_entropy(
        hidden, weight, _ints(targets, "targets"),
        _loss_options(ignore_index, label_smoothing, smoothing, z_loss, reduction, vocab_size,
                      num_shards, algorithm, layout, softcap, grad_output),
        bool(want_grad), impl), f64)


def embedding(ids, weight, *, vocab_size=None, num_shards=None, layout=None, grad_output=None,
              want_grad=None, impl=REFERENCE, dtype=None):
    """The embedding lookup ``weight[ids]`` and its weight gradient.

    ``ids`` ``[n]`` ints (outside ``0..vocab_size``: ``index_out_of_range``),
    ``weight`` ``[w, h]``, ``grad_output`` ``[n, h]``. Returns ``output``
    ``[n, h]``, ``grad_weight`` ``[w, h]`` with a ``grad_output``, and for
    sharded runs ``num_shards``, ``layout``, ``collectives``. Arrays in the
    kernel's precision unless ``dtype`` says (as :func:`attention`).
    """
    f64 = _wants_f64(impl, dtype)
    weight = _rank(_f64(weight, "weight"), 2, "weight", "[v, h]")
    want = _want_grad(want_grad, grad_output, "grad_output")
    go = _rank(_f64(grad_output, "grad_output"), 2, "grad_output", "[n, h]") if want else None
    return _results_as(_native.embedding(_ints(ids, "ids"), weight,
                                         None if vocab_size is None else int(vocab_size),
                                         None if num_shards is None else int(num_shards), layout,
                                         go, impl), f64)


def _json_default(x):
    if isinstance(x, _np.ndarray):
        return x.tolist()
    if isinstance(x, _np.integer):
        return int(x)
    if isinstance(x, _np.floating):
        return float(x)
    raise TypeError(f"{type(x).__name__} is not JSON serializable")


def eval(case):
    """One ``packshard eval`` case (a dict, or JSON text); the result as a dict.

    Runs in-process through the same code as the command line, so every op
    (``bert`` included) and every error are the contract's.
    """
    text = case if isinstance(case, str) else _json.dumps(case, default=_json_default)
    return _json.loads(_native.eval_json(text))


def _packing_case(op, **fields):
    return {"op": op, **{k: v for k, v in fields.items() if v is not None}}


def pack(lengths=None, max_seq_len=None, *, histogram=None, algorithm="spfhp",
         max_sequences_per_pack=None, overlong=None):
    """Packs sequence ``lengths`` (``[n]`` ints) or a ``histogram`` (``[[length, count], ...]``
    or an ``{length: count}`` dict) into rows of ``max_seq_len``.

    Returns the ``pack`` result of docs/INTERFACE.md: ``strategies``, for
    ``lengths`` also ``packs`` (the plan: per pack ``[{"sequence", "offset",
    "length"}]``), the metrics (``num_packs``, ``efficiency``, ``speedup``, ...)
    and the LP bound (``bound_packs``, ``bound_efficiency``).
    """
    if isinstance(histogram, dict):
        histogram = sorted([int(k), int(c)] for k, c in histogram.items())
    return eval(_packing_case("pack", lengths=lengths, histogram=histogram,
                              max_seq_len=max_seq_len, algorithm=algorithm,
                              max_sequences_per_pack=max_sequences_per_pack, overlong=overlong))


def batch(sequences, max_seq_len, *, algorithm="spfhp", max_sequences_per_pack=None,
          overlong=None, pad_token_id=None, position_offset=None):
    """Packs token ``sequences`` (a list of int lists or arrays) into rows.

    Returns the ``batch`` result with ``input_ids``, ``position_ids``,
    ``sequence_ids`` as int64 arrays ``[num_packs, max_seq_len]``,
    ``cu_seqlens`` (per pack an int64 array ``[seqs_in_pack + 1]``),
    ``max_seqlen``, ``sequence_index``, ``packs``, ``num_packs``, ...
    """
    seqs = [_np.asarray(s).tolist() for s in sequences]
    r = eval(_packing_case("batch", sequences=seqs, max_seq_len=max_seq_len, algorithm=algorithm,
                           max_sequences_per_pack=max_sequences_per_pack, overlong=overlong,
                           pad_token_id=pad_token_id, position_offset=position_offset))
    rows = max_seq_len
    for key in ("input_ids", "position_ids", "sequence_ids"):
        r[key] = _np.asarray(r[key], dtype=_np.int64).reshape(-1, rows)
    r["cu_seqlens"] = [_np.asarray(c, dtype=_np.int64) for c in r["cu_seqlens"]]
    return r


def step_plan(documents, *, grad_accum=1, dp=1, cp=1, reduction="per-token", eos_token_id=None):
    """The training step's split of a global batch of ``documents`` (token id
    lists or arrays) over ``grad_accum`` steps (``G``), ``dp`` data-parallel
    ranks (``D``) and ``cp`` context-parallel ranks (``C``, TransformerEngine's
    and Megatron's load-balanced THD split: each document padded to a multiple
    of ``2 C`` and cut into ``2 C`` chunks, rank ``r`` holding chunks ``r`` and
    ``2 C - 1 - r``), with the loss weights of the step's global denominator
    (``reduction``: ``per-token``, ``per-document`` or ``per-row``), to check a
    partitioner and a loss scaling against (docs/STEP.md, docs/FAULTS.md
    D1-D8).

    Returns the ``step_plan`` result of docs/INTERFACE.md with every per-rank
    sequence as an array: ``token_index``, ``cu_seqlens``,
    ``cu_seqlens_padded``, ``position_ids``, ``input_ids``, ``labels``
    (int64; -100 where nothing is predicted) and ``loss_weights`` (float64:
    ``1 / M`` per predicted token or ``1 / (docs m_j)`` per document, both
    summing to 1 over the whole step; ``1 / R`` per token for ``per-row``,
    ``loss.sum(-1).mean()`` over the ``R`` documents of the unpacked batch). Bad input raises ``PackshardError``
    naming the field (``cp``, ``docs``, ``documents[i][j]``, ``reduction``).
    """
    docs = [_np.asarray(d).tolist() for d in documents]
    r = eval(_packing_case("step_plan", documents=docs, grad_accum=grad_accum, dp=dp, cp=cp,
                           reduction=reduction, eos_token_id=eos_token_id))
    ints = ("token_index", "cu_seqlens", "cu_seqlens_padded", "position_ids", "input_ids",
            "labels")
    for m in r["microbatches"]:
        for key in ("cu_seqlens", "cu_seqlens_padded"):
            m[key] = _np.asarray(m[key], dtype=_np.int64)
        for rank in m["ranks"]:
            for key in ints:
                rank[key] = _np.asarray(rank[key], dtype=_np.int64)
            rank["loss_weights"] = _np.asarray(rank["loss_weights"], dtype=_np.float64)
    return r


def implementations(op=None):
    """Every registered implementation (``family``, ``op``, ``name``, ``changed``,
    ``precision``, ``needs``); with ``op``, those of that op."""
    rows = _native.registry_list()
    return [r for r in rows if op is None or r["op"] == op]


from . import testing  # noqa: E402  (testing uses the functions above)
from .collator import check_collator  # noqa: E402,F401  (issue 36; docs/HF.md)
from .causal import causal_conversions, causal_labels  # noqa: E402,F401  (issue 36)
