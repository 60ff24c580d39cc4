"""The causal-LM packing ops as numpy (or torch) functions (issue 36).

:func:`causal_labels` and :func:`causal_conversions` are ``packshard eval``'s
ops of the same names (docs/INTERFACE.md), run in-process, with arrays in
and out instead of lists. Per-token inputs may be ``[n]`` or ``[1, n]``
(Hugging Face's one-row form; results come back in the same form), numpy
arrays, lists, or torch tensors on any device: a tensor is copied to the
CPU (the ops are integer bookkeeping) unless ``allow_move=False``, and the
results come back as tensors on the input's device. ``cu_seqlens`` comes
back int32 for torch input (flash-attention's ``flash_attn_varlen_func``
requires ``torch.int32`` offsets) and int64 for numpy input (``batch``'s),
or as ``cu_dtype`` says.
"""

from typing import Any, Dict, Optional

import numpy as np

__all__ = ["causal_labels", "causal_conversions"]


class _Form:
    """How the caller's per-token input came: torch (device) or numpy, and
    ``[1, n]`` or ``[n]``."""

    def __init__(self, torch_device=None, row=False):
        self.torch_device, self.row = torch_device, row

    def tokens(self, a, dtype=np.int64):
        a = np.asarray(a, dtype=dtype)
        if self.row:
            a = a.reshape(1, -1)
        return self.out(a)

    def out(self, a):
        if self.torch_device is None:
            return a
        import torch

        return torch.from_numpy(np.ascontiguousarray(a)).to(self.torch_device)


def _error(field, message):
    from . import _error as make

    return make("invalid_argument", field, f"{field}: {message}")


def _read(x, name, allow_move, form=None):
    """``x`` as a 1-D int64 array and its form; ``None`` stays ``None``."""
    if x is None:
        return None, form
    device = None
    if hasattr(x, "detach") and hasattr(x, "device"):  # a torch tensor
        device = x.device
        if device.type != "cpu" and not allow_move:
            raise _error(name, f"a tensor on {device}; allow_move=False keeps it there, "
                               f"and the causal ops run on the CPU")
        x = x.detach().to("cpu").numpy()
    a = np.asarray(x)
    row = a.ndim == 2 and a.shape[0] == 1
    if row:
        a = a[0]
    if a.ndim != 1:
        raise _error(name, f"shape {list(np.shape(x))}, expected [n] or [1, n]")
    if a.size and a.dtype.kind not in "iub":
        raise _error(name, f"dtype {a.dtype}, expected integers")
    if form is None:
        form = _Form(device, row)
    return a.astype(np.int64), form


def _cu_out(form, cu, cu_dtype):
    dtype = cu_dtype or (np.int32 if form.torch_device is not None else np.int64)
    return form.out(np.asarray(cu, dtype=dtype))


def causal_labels(input_ids: Any, doc_ids: Any = None, cu_seqlens: Any = None, *,
                  eos_token_id: Optional[int] = None, ignore_index: int = -100,
                  num_documents: Optional[int] = None,
                  allow_move: bool = True) -> Dict[str, Any]:
    """Next-token labels inside each document and the loss weights
    (docs/FAULTS.md C1, C2, C7; ``packshard_reference::decoder::packing``).

    ``input_ids`` ``[n]`` or ``[1, n]``; exactly one of ``doc_ids`` (``[n]``,
    0 = padding anywhere, C4) or ``cu_seqlens`` (``[b + 1]`` over every
    slot). ``eos_token_id``: each document's last token predicts it (absent:
    predicts nothing); ``num_documents``: the unpacked batch's documents
    (default those given). Returns a dict: ``labels`` (shifted: slot ``i``
    holds slot ``i``'s target; Hugging Face's unshifted form is
    ``labels[i - 1]`` at slot ``i``, docs/HF.md), ``loss_weights_per_token``,
    ``loss_weights_per_document``, ``loss_weights_per_row`` (float64),
    ``doc_ids``, in the input's form, and ``num_predicted``,
    ``num_documents``, ``ignore_index``. Raises ``PackshardError`` naming
    the field and index.
    """
    from . import eval as _eval

    ids, form = _read(input_ids, "input_ids", allow_move)
    d, _ = _read(doc_ids, "doc_ids", allow_move, form)
    cu, _ = _read(cu_seqlens, "cu_seqlens", allow_move, form)
    case = {"op": "causal_labels", "input_ids": ids, "ignore_index": int(ignore_index)}
    for key, v in (("doc_ids", d), ("cu_seqlens", cu)):
        if v is not None:
            case[key] = v
    if eos_token_id is not None:
        case["eos_token_id"] = int(eos_token_id)
    if num_documents is not None:
        case["num_documents"] = int(num_documents)
    r = _eval(case)
    out = {k: r[k] for k in ("num_predicted", "num_documents", "ignore_index")}
    out["labels"] = form.tokens(r["labels"])
    out["doc_ids"] = form.tokens(r["doc_ids"])
    for k in ("loss_weights_per_token", "loss_weights_per_document", "loss_weights_per_row"):
        out[k] = form.tokens(r[k], np.float64)
    return out


def causal_conversions(position_ids: Any = None, cu_seqlens: Any = None, seq_idx: Any = None,
                       doc_ids: Any = None, *, num_segments: Optional[int] = None,
                       first_offset: Optional[int] = None,
                       position_offset: Optional[int] = None, cu_dtype: Any = None,
                       allow_move: bool = True) -> Dict[str, Any]:
    """The four ways a packed row names its documents, into one another
    (docs/FAULTS.md C3, C4, C6).

    Exactly one of ``position_ids`` (``[n_tok]``: a document starts wherever
    a position is not its predecessor's plus one, so ``[0, 1, 2, 0, 0, 1]``
    is ``[3, 1, 2]`` and ``[5, 6, 7, 0, 1]`` is ``[3, 2]``), ``cu_seqlens``
    (``[b + 1]``), ``seq_idx`` (``[n_tok]``, with ``num_segments``) or
    ``doc_ids`` (``[n_slots]``, 0 = padding). ``first_offset``: the first
    segment's first position (a continuation chunk, C6);
    ``position_offset``: every other segment's (``batch``'s, RoBERTa's 2), so
    ``batch(..., position_offset=2)``'s positions round-trip. Returns a dict:
    ``cu_seqlens`` (``[b + 1]``, int32 for torch input), ``position_ids``,
    ``seq_idx`` (``[n_tok]``), ``slots`` (``[n_tok]``), ``doc_ids``
    (``[n_slots]``) in the input's form, and ``max_seqlen``,
    ``num_segments``, ``n_tok``, ``n_slots``.
    """
    from . import eval as _eval

    given = [(k, v) for k, v in (("position_ids", position_ids), ("cu_seqlens", cu_seqlens),
                                 ("seq_idx", seq_idx), ("doc_ids", doc_ids)) if v is not None]
    if len(given) != 1:
        names = "position_ids, cu_seqlens, seq_idx, doc_ids"
        raise _error(given[1][0] if given else "position_ids",
                     f"give exactly one of {names} ({len(given)} given)")
    key, value = given[0]
    a, form = _read(value, key, allow_move)
    if key == "cu_seqlens":
        form.row = False  # offsets are never a row
    case = {"op": "causal_conversions", key: a}
    for k, v in (("num_segments", num_segments), ("first_offset", first_offset),
                 ("position_offset", position_offset)):
        if v is not None:
            case[k] = int(v)
    r = _eval(case)
    out = {k: r[k] for k in ("max_seqlen", "num_segments", "n_tok", "n_slots")}
    out["cu_seqlens"] = _cu_out(form, r["cu_seqlens"], cu_dtype)
    for k in ("position_ids", "seq_idx", "slots", "doc_ids"):
        out[k] = form.tokens(r[k])
    return out
