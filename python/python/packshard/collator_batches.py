"""Checks a collator of packed causal-LM batches of one row or many, with
packshard's Rust judge (``packshard_equivalence::collator``; issue 36,
docs/HF.md).

:func:`check_batches` is :func:`packshard.collator.check_collator` for
collators that spread the documents over several rows (``[r, n]``): a
packing collator's rows of ``max_seq_len`` slots (any packing order,
documents longer than a row split, each piece keeping its positions),
``DataCollatorForLanguageModeling``'s one padded document per row, or one
flattened row (``DataCollatorWithFlattening``). Every generated token id is
unique in its case, so the judge reads from ``input_ids`` alone which slot
holds which document's token, and judges every other field against that
layout. :func:`judge_batch` judges one batch.
"""

import json
from typing import Any, Callable, Dict, List, Optional

import numpy as np

__all__ = ["check_batches", "judge_batch", "batch_cases", "BatchFailure"]

# The names a field goes by (packshard's, flash-attention's varlen API,
# Hugging Face's FlashAttentionKwargs), as packshard.collator reads them.
CU_FIELDS = ("cu_seqlens", "cu_seqlens_q", "cu_seqlens_k", "cu_seq_lens_q", "cu_seq_lens_k")
MAX_FIELDS = ("max_seqlen", "max_seqlen_q", "max_seqlen_k", "max_length_q", "max_length_k")
COUNT_FIELDS = ("num_items_in_batch", "num_tokens", "num_predicted")


class BatchFailure(AssertionError):
    """A batch judged wrong: ``field``, ``row``, ``index`` (the slot; the
    query slot of a mask; the offset's index of ``cu_seqlens``),
    ``message``; with :func:`check_batches` also ``features`` (replay with
    :func:`judge_batch`), ``describe`` and ``source``."""

    def __init__(self, failure, features=None, describe=None, source=None):
        self.field, self.row = failure.get("field"), failure.get("row")
        self.index, self.message = failure.get("index"), failure.get("message")
        self.features, self.describe, self.source = features, describe, source
        text = failure.get("text") or f"{self.field}: {self.message}"
        if describe is not None:
            text = f"case: {describe} ({source})\n  {text}\n  features: {features}"
        super().__init__(text)


def _call(request, mask=None):
    from . import _error, _native

    answer = json.loads(_native.collator_json(json.dumps(request, default=_plain), mask))
    if "error" in answer:
        e = answer["error"]
        raise _error(e.get("kind", "invalid_argument"), e.get("field"), e["message"])
    return answer


def _plain(x):
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.integer):
        return int(x)
    raise TypeError(f"{type(x).__name__} is not JSON serializable")


def _options(cases=100, seed=0, labels="shifted", ignore_index=-100, eos_token_id=None,
             separator_id=None, pad_token_id=0, max_seq_len=None, kinds=None,
             require_boundaries=True):
    o = {"cases": int(cases), "seed": int(seed), "labels": labels,
         "ignore_index": int(ignore_index), "pad_token_id": int(pad_token_id),
         "require_boundaries": bool(require_boundaries)}
    for k, v in (("eos_token_id", eos_token_id), ("separator_id", separator_id),
                 ("max_seq_len", max_seq_len)):
        if v is not None:
            o[k] = int(v)
    if kinds is not None:
        o["kinds"] = list(kinds)
    return o


def batch_cases(**options: Any) -> List[Dict[str, Any]]:
    """The cases :func:`check_batches` runs (same options): a list of dicts
    with ``features`` (Hugging Face's, ids unique in the case), ``source``,
    ``describe`` and ``tokens``."""
    return _call({"op": "cases", "options": _options(**options)})


def _np(x):
    if hasattr(x, "detach"):  # a torch tensor on any device
        x = x.detach().cpu()
        if x.is_floating_point():  # bf16 has no numpy dtype
            x = x.double()
        x = x.numpy()
    return np.asarray(x)


class _Wrong(Exception):
    """A field the judge cannot read: ``failure`` dict."""

    def __init__(self, field, message):
        super().__init__(message)
        self.failure = {"field": field, "row": None, "index": None, "message": message,
                        "text": f"{field}: {message}"}


def _rows(out, key, r=None):
    """A per-token field as ``[r, n]`` int lists (``[n]`` is one row)."""
    a = _np(out[key])
    if a.ndim == 1:
        a = a[None, :]
    if a.ndim != 2:
        raise _Wrong(key, f"shape {list(a.shape)}, expected [r, n] or [n]")
    if a.size and a.dtype.kind not in "iub":
        raise _Wrong(key, f"dtype {a.dtype}, expected integers")
    return a.astype(np.int64)


def _cu(out, key, r, cu_dtype):
    v = out[key]
    if isinstance(v, (list, tuple)) and v and not np.isscalar(v[0]) and np.ndim(_np(v[0])) == 1:
        rows = [_np(x) for x in v]  # one array per row (packshard's batch)
    else:
        a = _np(v)
        rows = [a[p] for p in range(a.shape[0])] if a.ndim == 2 and a.shape[0] > 1 else None
        if rows is None:
            a = a.reshape(-1)
            if cu_dtype is not None and hasattr(v, "dtype") and a.dtype != np.dtype(cu_dtype):
                raise _Wrong(key, f"dtype {a.dtype}, expected {np.dtype(cu_dtype)} "
                                  f"(flash_attn_varlen_func requires torch.int32 offsets)")
            if a.size and a.dtype.kind not in "iu":
                raise _Wrong(key, f"dtype {a.dtype}, expected integers")
            return "cu_seqlens", a.astype(np.int64)
    for p, x in enumerate(rows):
        if x.ndim != 1 or (x.size and x.dtype.kind not in "iu"):
            raise _Wrong(key, f"row {p}: shape {list(x.shape)} dtype {x.dtype}, expected [b + 1] "
                              f"integers")
    return "cu_seqlens_per_row", [x.astype(np.int64) for x in rows]


def _scalar(out, key):
    a = _np(out[key]).reshape(-1)
    if a.size != 1 or a.dtype.kind not in "iu":
        raise _Wrong(key, f"{a.size} values of dtype {a.dtype}, expected one integer")
    if int(a[0]) < 0:
        raise _Wrong(key, f"is {int(a[0])}, expected a count (>= 0)")
    return int(a[0])


def _batches(out, labels, mask, cu_dtype):
    """The judge's requests for ``out``: one per name a field goes by
    (each ``cu_seqlens`` name, each ``max_seqlen`` name, ``shift_labels``)."""
    if not hasattr(out, "keys"):
        raise _Wrong("batch", f"returned {type(out).__name__}, expected a dict of fields")
    for key in ("input_ids", "labels"):
        if key not in out:
            raise _Wrong(key, f"required field is missing (keys: {sorted(out.keys())})")
    b = {"input_ids": _rows(out, "input_ids"), "labels": _rows(out, "labels")}
    for key in ("position_ids", "seq_idx"):
        if key in out:
            b[key] = _rows(out, key)
    counts = [k for k in COUNT_FIELDS if k in out]
    if counts:
        b["num_items_in_batch"] = _scalar(out, counts[0])
    m4, form = None, None
    if "attention_mask" in out:
        a = _np(out["attention_mask"])
        if a.ndim == 4:
            form = mask or ("additive" if a.dtype.kind == "f" else "bool")
            if form == "bool" and a.dtype != bool and not np.isin(a, (0, 1)).all():
                raise _Wrong("attention_mask", "values other than 0 and 1 in a boolean mask")
            m4 = np.ascontiguousarray(a, dtype=np.float64)
        else:
            b["attention_mask"] = _rows(out, "attention_mask")
    elif mask is not None:
        raise _Wrong("attention_mask", f"not returned (mask={mask!r} declares a 4D mask)")
    variants = []
    cus = [k for k in CU_FIELDS if k in out] or [None]
    maxes = [k for k in MAX_FIELDS if k in out] or [None]
    for c in cus:
        for m in maxes:
            v = dict(b)
            if c is not None:
                name, value = _cu(out, c, b["input_ids"].shape[0], cu_dtype)
                v[name] = value
            if m is not None:
                v["max_seqlen"] = _scalar(out, m)
            variants.append((labels, v, (c, m)))
    if "shift_labels" in out:
        v = dict(variants[0][1], labels=_rows(out, "shift_labels"))
        variants.append(("shifted", v, ("shift_labels", None)))
    return variants, m4, form


def _rename(failure, names):
    """The judge names fields as packshard does; give the collator's name."""
    cu, mx = names
    field = failure.get("field")
    if field == "cu_seqlens" and cu:
        field = cu
    elif field == "max_seqlen" and mx:
        field = mx
    elif field == "labels" and cu == "shift_labels":
        field = "shift_labels"
    if field != failure.get("field"):
        failure = dict(failure, field=field,
                       text=failure.get("text", "").replace(failure["field"], field, 1))
    return failure


def judge_batch(features: List[Dict[str, Any]], out: Any, *, labels: str = "shifted",
                ignore_index: int = -100, eos_token_id: Optional[int] = None,
                separator_id: Optional[int] = None, pad_token_id: int = 0,
                mask: Optional[str] = None, require_boundaries: bool = True,
                cu_dtype: Any = "int32") -> Dict[str, Any]:
    """Judges ``out`` (a mapping of numpy arrays, lists or torch tensors) as
    the batch of ``features``. Per-token fields ``[r, n]`` (or ``[n]``):
    ``input_ids``, ``labels`` (``"shifted"`` or ``"unshifted"``),
    ``position_ids``, ``seq_idx``, a 2D ``attention_mask``; ``cu_seqlens``
    under any of its names, flat over the ``r * n`` slots (Hugging Face's
    and flash-attention's; ``cu_dtype``, default int32, checked when it has
    a dtype; None: any) or one array per row (packshard's ``batch``);
    ``max_seqlen`` / ``max_length_q/k``; ``num_items_in_batch``; a 4D
    ``attention_mask`` ``[r, 1, n, n]`` (``mask="bool"`` / ``"additive"``,
    undeclared: additive when float); ``shift_labels`` judged shifted.
    Token ids of ``features`` must be unique (outside a final EOS).
    Returns a dict (``rows``, ``slots``, ``fields``); raises
    :class:`BatchFailure` naming the field, row and index.
    """
    opts = _options(labels=labels, ignore_index=ignore_index, eos_token_id=eos_token_id,
                    separator_id=separator_id, pad_token_id=pad_token_id,
                    require_boundaries=require_boundaries)
    del opts["cases"], opts["seed"]
    try:
        variants, m4, form = _batches(out, labels, mask, cu_dtype)
    except _Wrong as w:
        raise BatchFailure(w.failure) from None
    except (ValueError, TypeError) as e:  # ragged or unreadable
        raise BatchFailure({"field": "batch", "message": f"a field numpy cannot read: {e}"}) \
            from None
    verdict = None
    for form_labels, b, names in variants:
        req = {"op": "judge", "features": features, "batch": b,
               "options": dict(opts, labels=form_labels), "mask_form": form}
        verdict = _call(req, m4)
        if not verdict["ok"]:
            raise BatchFailure(_rename(verdict["failure"], names))
    return {k: verdict[k] for k in ("rows", "slots", "fields")}


def check_batches(fn: Callable[[List[Dict[str, Any]]], Any], *, cases: int = 100,
                  seed: int = 0, max_seq_len: Optional[int] = None, labels: str = "shifted",
                  ignore_index: int = -100, eos_token_id: Optional[int] = None,
                  separator_id: Optional[int] = None, pad_token_id: int = 0,
                  mask: Optional[str] = None, kinds: Optional[List[str]] = None,
                  require_boundaries: bool = True, cu_dtype: Any = "int32",
                  raise_on_failure: bool = True) -> Dict[str, Any]:
    """Runs the collator ``fn(features)`` on the fixed cases of issue 36 and
    docs/FAULTS.md and ``cases`` random ones (seed ``seed``) and judges each
    batch with :func:`judge_batch`.

    ``features``: Hugging Face's (``input_ids``, ``labels`` with a prompt's
    tokens -100, ``position_ids`` for a continuation chunk), token ids
    unique in the case (1 .. 2^20, never ``pad_token_id``, EOS, the
    separator). ``max_seq_len``: the collator's row length; cases then hold
    documents longer than a row. ``kinds``: a subset of ``one_token``,
    ``empty``, ``prompt``, ``continuation``, ``long``.

    Returns a dict (``cases``, ``rows``, ``slots``, ``fields``, and
    ``failures``: every :class:`BatchFailure`); raises the smallest (fewest
    tokens) failure unless ``raise_on_failure=False``.
    """
    all_cases = batch_cases(cases=cases, seed=seed, labels=labels, ignore_index=ignore_index,
                            eos_token_id=eos_token_id, separator_id=separator_id,
                            pad_token_id=pad_token_id, max_seq_len=max_seq_len, kinds=kinds,
                            require_boundaries=require_boundaries)
    report = {"cases": 0, "rows": 0, "slots": 0, "fields": set(), "failures": []}
    sized = []
    for case in all_cases:
        feats = case["features"]
        report["cases"] += 1
        call = json.loads(json.dumps(feats))
        try:
            out = fn(call)
        except Exception as e:  # noqa: BLE001  (the collator refused a valid set)
            f = BatchFailure({"field": "collate", "message": f"raised {type(e).__name__}: {e}"},
                             feats, case["describe"], case["source"])
        else:
            try:
                j = judge_batch(feats, out, labels=labels, ignore_index=ignore_index,
                                eos_token_id=eos_token_id, separator_id=separator_id,
                                pad_token_id=pad_token_id, mask=mask,
                                require_boundaries=require_boundaries, cu_dtype=cu_dtype)
                report["rows"] += j["rows"]
                report["slots"] += j["slots"]
                report["fields"].update(j["fields"])
                continue
            except BatchFailure as b:
                f = BatchFailure({"field": b.field, "row": b.row, "index": b.index,
                                  "message": b.message, "text": str(b)},
                                 feats, case["describe"], case["source"])
        sized.append((case["tokens"], f))
    report["failures"] = [f for _, f in sized]
    if sized and raise_on_failure:
        tokens, worst = min(sized, key=lambda x: x[0])
        name = getattr(fn, "__name__", repr(fn))
        top = BatchFailure(
            {"field": worst.field, "row": worst.row, "index": worst.index,
             "message": worst.message,
             "text": f"{name} fails {len(sized)} of {report['cases']} cases (seed {seed}, "
                     f"labels={labels!r}); the smallest ({tokens} tokens):\n{worst}"})
        top.features, top.describe, top.source = worst.features, worst.describe, worst.source
        raise top
    return report
