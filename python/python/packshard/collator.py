"""Checks a data collator of packed causal-LM batches (issue 36, docs/HF.md).

A collator turns a list of tokenized documents (Hugging Face's feature format:
``[{"input_ids": [...], "labels": [...]?, "position_ids": [...]?}, ...]``)
into one packed row. :func:`check_collator` generates document sets the way
collators break (docs/FAULTS.md C1-C4, C6, C7: one-token and empty documents,
prompt masks, continuation chunks whose positions do not start at 0, many
short documents beside one long one, EOS-terminated documents), calls the
collator, and judges every field it returns against packshard's own
``causal_labels`` / ``causal_conversions`` (through :func:`packshard.eval`)
or, where those have no form for it, a first-principles construction named
in the code.

Shape legend: ``n`` slots of the packed row, ``b`` documents (segments).
Every per-token field may come back ``[n]`` or ``[1, n]`` (Hugging Face's
form); one row only (a flattening collator: every feature goes into the row,
in order).
"""

import copy

import numpy as np

__all__ = [
    "KINDS",
    "CollatorFailure",
    "CollatorReport",
    "check_collator",
    "generate_features",
    "boundaries_from_position_ids",
]

#: The ways a case's documents are drawn; ``check_collator(kinds=...)`` picks
#: a subset. ``one_token``: documents of one token (C3); ``empty``: documents
#: with no token; ``prompt``: ``labels`` with the first tokens -100 (a prompt
#: mask, as instruction tuning does); ``continuation``: documents carrying
#: ``position_ids`` that start above 0 (a chunk of a longer document, C6);
#: ``long``: one document far longer than the rest (many short beside one
#: long, so a fixed-size tile or a per-row guess breaks).
KINDS = ("one_token", "empty", "prompt", "continuation", "long")

# Token ids are drawn from 1..VOCAB-1; ids the caller reserves (EOS,
# separator, padding) are never drawn, so a reserved id in `input_ids` is
# always one the check put there (EOS) or the collator's padding.
VOCAB = 1000

# An additive mask entry counts as "masked" when it is at most -1e4: the
# scores of these cases are never evaluated, but a softmax weight
# exp(s - 1e4) underflows to 0 in f32 (smallest subnormal exp(-103.3)) and
# in bf16 / f16 for any score |s| < 9e3, so any such entry removes the key.
# Hugging Face writes torch.finfo(dtype).min (<= -65504) or -inf.
ADDITIVE_MASKED = -1e4

# Fields that carry the document boundaries, under their names in
# packshard (cu_seqlens, max_seqlen), flash-attention's varlen API
# (cu_seqlens_q/k, max_seqlen_q/k) and Hugging Face's FlashAttentionKwargs
# (cu_seq_lens_q/k, max_length_q/k).
CU_FIELDS = ("cu_seqlens", "cu_seqlens_q", "cu_seqlens_k", "cu_seq_lens_q", "cu_seq_lens_k")
MAX_FIELDS = ("max_seqlen", "max_seqlen_q", "max_seqlen_k", "max_length_q", "max_length_k")
COUNT_FIELDS = ("num_items_in_batch", "num_tokens", "num_predicted")


def boundaries_from_position_ids(position_ids):
    """``cu_seqlens`` (``[b + 1]``, leading 0) of a packed row's
    ``position_ids`` (``[n]``): a document starts wherever a position is not
    its predecessor's plus one (docs/FAULTS.md C3; packshard's
    ``causal_conversions``), so ``[5, 6, 7, 0, 1]`` is ``[0, 3, 5]`` and
    ``[0, 1, 2, 0, 0, 1]`` is ``[0, 3, 4, 6]``. Empty ``position_ids``: ``[0]``."""
    p = np.asarray(position_ids, dtype=np.int64).reshape(-1)
    n = p.size
    if n == 0:
        return np.zeros(1, dtype=np.int64)
    starts = np.flatnonzero(p[1:] != p[:-1] + 1) + 1
    return np.concatenate(([0], starts, [n])).astype(np.int64)


class CollatorFailure:
    """One failing case: its ``features`` (the collator's input), a
    description, ``size`` (its tokens), ``source`` and ``detail`` (the field,
    index and both values)."""

    def __init__(self, features, describe, size, source, detail):
        self.features, self.describe, self.size = features, describe, size
        self.source, self.detail = source, detail

    def __str__(self):
        return f"case: {self.describe} ({self.source})\n  {self.detail}"


class CollatorReport:
    """What a run saw: ``cases`` run, ``tokens`` judged, the ``fields`` the
    collator returned and were judged (a set), and ``failures``."""

    def __init__(self, name):
        self.name = name
        self.cases = self.tokens = 0
        self.fields = set()
        self.failures = []

    def smallest(self):
        """The smallest failing case (fewest tokens), or None."""
        return min(self.failures, key=lambda f: f.size) if self.failures else None

    def __repr__(self):
        return (f"CollatorReport({self.name}: {self.cases} cases, {self.tokens} tokens, "
                f"fields {sorted(self.fields)}, {len(self.failures)} failed)")


class _Fail(Exception):
    """A judged field is wrong: ``str`` is the message."""


# ---------------------------------------------------------------- generation


def _tokens(rng, m, reserved):
    out = []
    while len(out) < m:
        t = int(rng.integers(1, VOCAB))
        if t not in reserved:
            out.append(t)
    return out


def _fixed_cases(kinds, reserved):
    """The documents of issue 36 and docs/FAULTS.md as fixed cases: each a
    list of ``(length, first_position, prompt_len)``."""
    out = []
    if "one_token" in kinds:
        out.append([(3, 0, 0), (1, 0, 0), (2, 0, 0)])          # C3: [0,1,2,0,0,1]
        out.append([(1, 0, 0), (1, 0, 0)])
    if "continuation" in kinds:
        out.append([(3, 5, 0), (2, 0, 0)])                     # [5,6,7,0,1]
        out.append([(3, 0, 0), (2, 5, 0)])                     # [0,1,2,5,6]
        if "one_token" in kinds:
            out.append([(3, 2, 0), (2, 2, 0), (1, 2, 0), (1, 0, 0), (1, 0, 0)])  # [2,3,4,2,3,2,0,0]
    if "empty" in kinds:
        out.append([(2, 0, 0), (0, 0, 0), (3, 0, 0)])
    if "prompt" in kinds:
        out.append([(4, 0, 2), (3, 0, 1)])
    out.append([(3, 0, 0), (5, 0, 0)])                         # C7: 2 + 4 predicted
    return out


def _random_case(rng, kinds):
    use = [k for k in kinds if rng.random() < 0.5]
    b = int(rng.integers(1, 9))
    docs = []
    for _ in range(b):
        m = int(rng.choice([2, 3, 5, 7, 11, 17, 29]))
        if "one_token" in use and rng.random() < 0.4:
            m = 1
        if "empty" in use and rng.random() < 0.2:
            m = 0
        start = int(rng.integers(1, 40)) if ("continuation" in use and rng.random() < 0.4) else 0
        prompt = 0
        if "prompt" in use and m > 1 and rng.random() < 0.6:
            prompt = int(rng.integers(0, m))
        docs.append([m, start, prompt])
    if "long" in use:
        docs[int(rng.integers(0, b))][0] = int(rng.choice([61, 97, 131]))
    return [tuple(d) for d in docs]


def _features(rng, docs, eos_token_id, reserved, with_labels):
    """Hugging Face features of ``docs`` (``(length, first_position,
    prompt_len)``); with ``eos_token_id`` each non-empty document's last
    token is EOS (the length counts it). A continuation chunk's first
    position is moved off its predecessor's last + 1, so ``position_ids``
    alone names the boundaries (docs/FAULTS.md C3's reading)."""
    feats, last = [], None
    for m, start, prompt in docs:
        ids = _tokens(rng, m, reserved)
        if eos_token_id is not None and m > 0:
            ids[-1] = int(eos_token_id)
        f = {"input_ids": ids}
        if start > 0 and m > 0:
            if last is not None and start == last + 1:
                start += 1
            f["position_ids"] = list(range(start, start + m))
        if with_labels:
            f["labels"] = [-100] * prompt + ids[prompt:]
        if m > 0:
            last = start + m - 1
        feats.append(f)
    return feats


def generate_features(cases=200, seed=0, *, kinds=KINDS, eos_token_id=None, separator_id=None,
                      pad_token_id=None):
    """The cases :func:`check_collator` runs: a list of ``(features,
    describe, source)``. The fixed cases of issue 36 and docs/FAULTS.md
    first (the three position-id readings, C3's one-token documents, C7's
    denominator), then random ones from numpy's PCG64 seeded with ``seed``
    (1..8 documents of 1..29 tokens, not powers of two, one of 61..131 with
    ``long``). ``cases`` counts both; an explicit list of feature lists runs
    those instead."""
    reserved = {int(x) for x in (eos_token_id, separator_id, pad_token_id) if x is not None}
    rng = np.random.default_rng(seed)
    if not isinstance(cases, (int, np.integer)):
        return [(list(f), _describe(f), f"given case {i}") for i, f in enumerate(cases)]
    out = []
    fixed = _fixed_cases(kinds, reserved)
    for i in range(int(cases)):
        docs = fixed[i] if i < len(fixed) else _random_case(rng, kinds)
        with_labels = any(p > 0 for _, _, p in docs) or ("prompt" in kinds and rng.random() < 0.5)
        f = _features(rng, docs, eos_token_id, reserved, with_labels)
        src = f"fixed case {i}" if i < len(fixed) else f"random case {i} of seed {seed}"
        out.append((f, _describe(f), src))
    return out


def _describe(features):
    parts = []
    for f in features:
        ids = list(f["input_ids"])
        s = f"{len(ids)}"
        if "position_ids" in f and len(ids):
            s += f"@{int(f['position_ids'][0])}"
        lab = f.get("labels")
        if lab is not None:
            k = sum(1 for x in lab if x == -100)
            if k:
                s += f"(prompt {k})"
        parts.append(s)
    word = "document" if len(features) == 1 else "documents"
    return f"{len(features)} {word}, lengths [{', '.join(parts)}] (@p: first position p)"


# ---------------------------------------------------------------- judging


def _np(x):
    if hasattr(x, "detach"):  # a torch tensor on any device
        x = x.detach().cpu()
        if x.is_floating_point():  # bf16 has no numpy dtype; a mask's values fit f64
            x = x.double()
        x = x.numpy()
    return np.asarray(x)


def _row(out, key, n=None):
    """A per-token field as a 1-D array: ``[n]`` or ``[1, n]``."""
    a = _np(out[key])
    if a.ndim == 2 and a.shape[0] == 1:
        a = a[0]
    if a.ndim != 1:
        raise _Fail(f"{key}: shape {list(_np(out[key]).shape)}, expected [n] or [1, n] "
                    f"(one packed row)")
    if n is not None and a.size != n:
        raise _Fail(f"{key}: {a.size} values, expected {n} (one per slot of input_ids)")
    if a.dtype.kind not in "iub":
        raise _Fail(f"{key}: dtype {a.dtype}, expected integers")
    return a.astype(np.int64)


def _scalar(out, key):
    a = _np(out[key]).reshape(-1)
    if a.size != 1:
        raise _Fail(f"{key}: {a.size} values, expected one")
    return int(a[0])


def _first_diff(key, got, want, idx, why=""):
    bad = np.flatnonzero(got != want)
    if bad.size:
        i = int(bad[0])
        raise _Fail(f"{key}[{int(idx[i])}] is {int(got[i])}, expected {int(want[i])}{why} "
                    f"({bad.size} of {got.size} differ)")


def _boundary_set(key, given, starts, is_pad, n, what):
    """``given``: the collator's segment starts; ``starts``: each document's
    first slot. A boundary is required at each document's start; an extra one
    only at a padding slot (a padding-only segment)."""
    gs = set(int(x) for x in given)
    for d, s in enumerate(starts):
        if s not in gs and s != 0:
            raise _Fail(what(s, d, "missing"))
    for s in sorted(gs):
        if s < n and s not in starts and not is_pad[s]:
            raise _Fail(what(s, None, "extra"))


def _judge(out, feats, *, labels, ignore_index, eos_token_id, separator_id, pad_token_id, mask,
           report):
    from . import eval as _eval

    if not hasattr(out, "keys"):
        raise _Fail(f"returned {type(out).__name__}, expected a dict of fields")
    docs = [[int(t) for t in f["input_ids"]] for f in feats]
    concat = [t for d in docs for t in d]
    nz = [d for d, ids in enumerate(docs) if ids]                # non-empty documents
    if "input_ids" not in out:
        raise _Fail(f"returned no 'input_ids' (keys: {sorted(out.keys())})")
    ids = _row(out, "input_ids")
    n = ids.size
    report.fields.add("input_ids")
    is_pad = (ids == pad_token_id) if pad_token_id is not None else np.zeros(n, dtype=bool)
    real = np.flatnonzero(~is_pad)
    if real.size != len(concat):
        raise _Fail(f"input_ids: {real.size} real tokens (not pad_token_id {pad_token_id}), "
                    f"expected {len(concat)} (every document, concatenated in order)")
    _first_diff("input_ids", ids[real], np.asarray(concat, dtype=np.int64), real,
                " (the documents concatenated in order)")

    # Each real slot's document: doc_ids over the slots (0 = padding), as
    # causal_labels and causal_conversions take them (docs/FAULTS.md C4).
    doc_of_real = np.concatenate([np.full(len(docs[d]), k + 1) for k, d in enumerate(nz)]) \
        if nz else np.zeros(0, dtype=np.int64)
    doc_ids = np.zeros(n, dtype=np.int64)
    doc_ids[real] = doc_of_real
    starts = [int(real[np.searchsorted(doc_of_real, k + 1)]) for k in range(len(nz))]
    if len(concat) == 0:
        raise _Fail("the case has no token")  # the generator never makes one
    conv = _reference(_eval, {"op": "causal_conversions", "doc_ids": doc_ids})
    slots = np.asarray(conv["slots"], dtype=np.int64)
    if not np.array_equal(slots, real):
        raise _Fail(f"input_ids: a document's tokens are split by padding (slots "
                    f"{slots.tolist()} are the documents' tokens, as causal_conversions reads "
                    f"doc_ids; the real tokens are at {real.tolist()})")

    # position_ids: each document from its first position (0, or a
    # continuation chunk's own, C6); causal_conversions' first_offset covers
    # the first segment only, so the offsets are added here.
    pos_want = np.asarray(conv["position_ids"], dtype=np.int64)
    for k, d in enumerate(nz):
        first = int(feats[d]["position_ids"][0]) if "position_ids" in feats[d] else 0
        pos_want[doc_of_real == k + 1] += first
    # The check's own consistency: these positions name the same documents
    # (the generator keeps a chunk off its predecessor's last + 1).
    assert list(boundaries_from_position_ids(pos_want)) == list(conv["cu_seqlens"]), pos_want
    if "position_ids" in out:
        report.fields.add("position_ids")
        pos = _row(out, "position_ids", n)
        _first_diff("position_ids", pos[real], pos_want, real,
                    " (each document from 0, or from a continuation chunk's first position)")
    elif len(nz) > 1 or pos_want[0] != 0:
        s = starts[1] if len(nz) > 1 else 0
        raise _Fail(f"returned no position_ids: the model numbers the row 0..{n - 1}, so slot {s} "
                    f"(document {nz[1] if len(nz) > 1 else nz[0]}) gets position {s}, expected "
                    f"{int(pos_want[np.searchsorted(real, s)])}")

    # Boundaries: cu_seqlens (any name), seq_idx, a 4D mask; at least one
    # when the row holds two documents.
    has_cu = [k for k in CU_FIELDS if k in out]
    mask4 = None
    if "attention_mask" in out and _np(out["attention_mask"]).ndim == 4:
        mask4 = _np(out["attention_mask"])
    if len(nz) > 1 and not has_cu and "seq_idx" not in out and mask4 is None:
        raise _Fail(f"returned no document boundaries (none of {', '.join(CU_FIELDS)}, seq_idx, "
                    f"a 4D attention_mask): document {nz[1]} (slot {starts[1]}) attends to "
                    f"document {nz[0]}")
    for key in has_cu:
        report.fields.add(key)
        cu = _np(out[key]).reshape(-1) if _np(out[key]).ndim == 2 and _np(out[key]).shape[0] == 1 \
            else _np(out[key])
        if cu.ndim != 1 or cu.dtype.kind not in "iub":
            raise _Fail(f"{key}: shape {list(cu.shape)} dtype {cu.dtype}, expected [b + 1] ints")
        cu = cu.astype(np.int64)
        if cu.size == 0 or cu[0] != 0:
            raise _Fail(f"{key}[0] is {int(cu[0]) if cu.size else 'missing'}, expected 0")
        if cu[-1] != n:
            raise _Fail(f"{key}[{cu.size - 1}] is {int(cu[-1])}, expected {n} (every slot of "
                        f"input_ids; its last offset)")
        dec = np.flatnonzero(np.diff(cu) < 0)
        if dec.size:
            i = int(dec[0]) + 1
            raise _Fail(f"{key}[{i}] is {int(cu[i])}, below {key}[{i - 1}] = {int(cu[i - 1])}")
        want = [0] + starts[1:] + [n] if starts and starts[0] == 0 else [0] + starts + [n]

        def what(s, d, kind, key=key, cu=cu, want=want):
            i = int(np.searchsorted(cu, s))
            if kind == "missing":
                return (f"{key}[{i}] is {int(cu[i])}, expected {s}: document {nz[d]} starts at "
                        f"slot {s} ({key} {cu.tolist()}, expected {want})")
            return (f"{key}[{i}] is {s}, which splits document "
                    f"{nz[int(doc_ids[s]) - 1]} ({key} {cu.tolist()}, expected {want})")
        _boundary_set(key, cu, starts, is_pad, n, what)
    if "seq_idx" in out:
        report.fields.add("seq_idx")
        si = _row(out, "seq_idx", n)
        dec = np.flatnonzero(np.diff(si) < 0)
        if dec.size:
            i = int(dec[0]) + 1
            raise _Fail(f"seq_idx[{i}] is {int(si[i])}, below seq_idx[{i - 1}] = {int(si[i - 1])}")
        given = [0] + (np.flatnonzero(np.diff(si) != 0) + 1).tolist()

        def what(s, d, kind, si=si):
            if kind == "missing":
                return (f"seq_idx[{s}] is {int(si[s])}, the same as seq_idx[{s - 1}]: document "
                        f"{nz[d]} starts at slot {s} (expected a new index)")
            return (f"seq_idx[{s}] is {int(si[s])}, not seq_idx[{s - 1}] = {int(si[s - 1])}: "
                    f"a new index inside document {nz[int(doc_ids[s]) - 1]}")
        _boundary_set("seq_idx", given, starts, is_pad, n, what)
    longest = max(len(docs[d]) for d in nz)
    for key in MAX_FIELDS:
        if key in out:
            report.fields.add(key)
            v = _scalar(out, key)
            # flash-attention reads max_seqlen as a bound (grid and scratch
            # size): at least the longest document, at most the row.
            if v < longest or v > n:
                raise _Fail(f"{key} is {v}, expected {longest} (the longest document; any value "
                            f"up to the row's {n} slots is a valid bound)")

    # Labels, judged in the shifted form: causal_labels' next-token labels
    # (inside each document; the last token predicts nothing), then the
    # prompt mask (a feature's labels[i + 1] == -100: token i predicts
    # nothing) and HF's separator (every document but the row's last
    # predicts separator_id after its last token).
    cl = _reference(_eval, {"op": "causal_labels", "input_ids": np.where(is_pad, 0, ids), "doc_ids": doc_ids,
                "ignore_index": ignore_index})
    want = np.asarray(cl["labels"], dtype=np.int64)
    for k, d in enumerate(nz):
        sl = real[doc_of_real == k + 1]
        lab = feats[d].get("labels")
        if lab is not None:
            lab = [int(x) for x in lab]
            for j in range(len(sl) - 1):
                # -100 is Hugging Face's mark in a feature's labels, whatever
                # ignore_index the loss uses.
                want[sl[j]] = ignore_index if lab[j + 1] in (-100, ignore_index) else lab[j + 1]
        if separator_id is not None and k + 1 < len(nz):
            want[sl[-1]] = int(separator_id)
    num_predicted = int(np.sum(want != ignore_index))
    if "labels" not in out:
        raise _Fail(f"returned no 'labels' (keys: {sorted(out.keys())})")
    report.fields.add("labels")
    got = _row(out, "labels", n)
    if labels == "shifted":
        _first_diff("labels", got, want, np.arange(n),
                    " (shifted: the next token of the same document; labels='shifted')")
    else:
        # Unshifted (Hugging Face): the model predicts labels[i + 1] at slot
        # i, so labels[i + 1] holds slot i's target. labels[0] is dropped by
        # the shift and not judged: transformers' Trainer counts the
        # denominator over labels[..., 1:] (trainer.py _get_num_items_in_batch,
        # transformers 5.x), and DataCollatorWithFlattening writes its
        # separator_id there.
        if want[-1] != ignore_index:  # never: the row's last document predicts nothing
            raise AssertionError("the row's last token has a target")
        _first_diff("labels", got[1:], want[:-1], np.arange(1, n),
                    " (unshifted: labels[i + 1] is slot i's next token in its document, "
                    "labels='unshifted')")
    if "shift_labels" in out:
        # Hugging Face's padding-free collators may hand the shifted labels
        # too (the model then uses them as given).
        report.fields.add("shift_labels")
        _first_diff("shift_labels", _row(out, "shift_labels", n), want, np.arange(n),
                    " (shifted: the next token of the same document)")
    # The loss denominator (C7): labels != ignore_index, or the count the
    # collator returns.
    for key in COUNT_FIELDS:
        if key in out:
            report.fields.add(key)
            v = _scalar(out, key)
            if v != num_predicted:
                raise _Fail(f"{key} is {v}, expected {num_predicted} (the tokens with a target: "
                            f"the per-token loss divides by it, C7)")

    # The 4D block-causal mask: [b = 1, 1, n, n], True / 0 where query i may
    # see key j: same document and j <= i. Padding query rows are not judged.
    if mask4 is None and mask is not None:
        raise _Fail(f"returned no 4D attention_mask [1, 1, {n}, {n}] (mask={mask!r})")
    if mask4 is not None:
        report.fields.add("attention_mask")
        if mask4.shape != (1, 1, n, n):
            raise _Fail(f"attention_mask: shape {list(mask4.shape)}, expected [1, 1, {n}, {n}]")
        m = mask4[0, 0]
        # Undeclared: a float mask is additive (Hugging Face's), a bool or
        # integer one boolean.
        form = mask or ("additive" if m.dtype.kind == "f" else "bool")
        if form == "bool":
            if m.dtype != bool and not np.isin(m, (0, 1)).all():
                raise _Fail("attention_mask: values other than 0 and 1 in a boolean mask")
            allowed = m.astype(bool)
        else:
            m = m.astype(np.float64)
            ok = (m == 0) | (m <= ADDITIVE_MASKED)
            if not ok.all():
                i, j = (int(x) for x in np.argwhere(~ok)[0])
                raise _Fail(f"attention_mask[0, 0, {i}, {j}] is {m[i, j]}, expected 0 (attend) or "
                            f"at most {ADDITIVE_MASKED} (masked) in an additive mask")
            allowed = m == 0
        same = (doc_ids[:, None] == doc_ids[None, :]) & (doc_ids[None, :] > 0)
        exp = same & np.tril(np.ones((n, n), dtype=bool))
        bad = np.argwhere((allowed != exp) & ~is_pad[:, None])
        if bad.size:
            i, j = (int(x) for x in bad[0])
            say = {True: "attends", False: "masked"}
            raise _Fail(f"attention_mask[0, 0, {i}, {j}] is {mask4[0, 0, i, j]} "
                        f"({say[bool(allowed[i, j])]}), expected {say[bool(exp[i, j])]}: query slot {i} (document "
                        f"{_doc_name(doc_ids, nz, i)}), key slot {j} (document "
                        f"{_doc_name(doc_ids, nz, j)}) ({bad.shape[0]} entries differ)")
    if "attention_mask" in out and mask4 is None:
        report.fields.add("attention_mask")
        am = _row(out, "attention_mask", n)
        _first_diff("attention_mask", am, (~is_pad).astype(np.int64), np.arange(n),
                    " (2D: 1 on tokens, 0 on padding)")
    report.tokens += n


def _reference(run, case):
    """packshard's op on the document layout the collator produced; the
    layout refused (a document's tokens split by padding) fails the case."""
    from ._native import PackshardError
    try:
        return run(case)
    except PackshardError as e:
        raise _Fail(f"input_ids: the padding splits a document, as {case['op']} reads the "
                    f"layout (doc_ids {np.asarray(case['doc_ids']).tolist()}, 0 = padding): "
                    f"{e}") from None


def _doc_name(doc_ids, nz, i):
    return "padding" if doc_ids[i] == 0 else str(nz[int(doc_ids[i]) - 1])


def check_collator(fn, *, cases=200, seed=0, labels="shifted", ignore_index=-100,
                   eos_token_id=None, separator_id=None, pad_token_id=None, mask=None,
                   kinds=KINDS, raise_on_failure=True):
    """Runs the collator ``fn(features)`` on generated document sets and
    judges every field it returns.

    ``features``: a list of dicts, one per document, Hugging Face's format:
    ``input_ids`` (a list of ints, 1..999, possibly empty), ``labels`` (the
    same ids with a prompt's tokens -100) when the case has a prompt mask,
    ``position_ids`` for a continuation chunk (its positions, first > 0).
    ``fn`` returns a mapping (numpy arrays, lists, or torch tensors on any
    device; per-token fields ``[n]`` or ``[1, n]``, one row) with:

    - ``input_ids`` (required): every document's tokens, concatenated in
      order; with ``pad_token_id``, padding slots anywhere outside a document.
    - ``labels`` (required): ``labels="shifted"`` (packshard's: slot i holds
      the next token of its document, ``ignore_index`` after a document's
      last token, on padding and on a prompt's tokens) or ``"unshifted"``
      (Hugging Face's: the model shifts, so slot i + 1 holds slot i's target;
      each document's first slot is ``ignore_index``, ``labels[0]`` is not
      judged: the shift drops it and transformers' Trainer counts the
      denominator over ``labels[..., 1:]``); ``shift_labels``, when returned,
      is judged in the shifted form.
      ``separator_id``: each document but the row's last predicts it after its
      last token (``DataCollatorWithFlattening(separator_id=...)``).
    - ``position_ids``: each document from 0, a continuation chunk from its
      own first position (C6); required when the row holds two documents.
    - ``cu_seqlens`` / ``cu_seqlens_q/k`` / ``cu_seq_lens_q/k`` (``[b + 1]``
      over the slots, leading 0, last ``n``): a boundary at every document's
      first slot (C3, C4), extra ones only at padding; ``seq_idx`` (``[n]``,
      non-decreasing, changing at every document's start and nowhere inside
      one); ``max_seqlen`` / ``max_length_q/k``: at least the longest
      document, at most ``n``; at least one of these or a 4D mask when a row
      holds two documents.
    - ``attention_mask``: 4D ``[1, 1, n, n]``, boolean (True: attend) or
      additive (0, or at most -1e4 / -inf), query i sees key j iff both are in
      one document and ``j <= i`` (``mask="bool"`` / ``"additive"``: required,
      in that form; undeclared, a float mask is read as additive, a bool or
      integer one as boolean); 2D ``[1, n]``: 1 on tokens, 0 on padding.
    - ``num_items_in_batch`` / ``num_tokens`` / ``num_predicted``: the tokens
      with a target (C7).

    ``eos_token_id``: every non-empty generated document ends with this token
    (a tokenizer's EOS; a collator may find boundaries from it); the EOS token
    predicts nothing (``causal_labels`` without ``eos_token_id`` on these
    tokens). ``kinds``: a subset of :data:`KINDS`. ``cases``: how many (the
    fixed cases of issue 36 first), or an explicit list of feature lists.
    Raises ``AssertionError`` naming the smallest failing case (fewest
    tokens), the field, the index and both values; returns a
    :class:`CollatorReport`.
    """
    if labels not in ("shifted", "unshifted"):
        raise ValueError(f"labels: {labels!r}, expected 'shifted' or 'unshifted'")
    if mask not in (None, "bool", "additive"):
        raise ValueError(f"mask: {mask!r}, expected None, 'bool' or 'additive'")
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"kinds: unknown {unknown}, expected a subset of {list(KINDS)}")
    if eos_token_id is not None and eos_token_id == ignore_index:
        raise ValueError(f"eos_token_id: is the ignore_index {ignore_index}")
    name = getattr(fn, "__name__", repr(fn))
    report = CollatorReport(name)
    gen = generate_features(cases, seed, kinds=kinds, eos_token_id=eos_token_id,
                            separator_id=separator_id, pad_token_id=pad_token_id)
    for feats, describe, source in gen:
        if not any(len(f["input_ids"]) for f in feats):
            continue
        size = sum(len(f["input_ids"]) for f in feats)
        report.cases += 1
        call = copy.deepcopy(feats)
        try:
            out = fn(call)
        except Exception as e:  # the collator raised on a valid document set
            report.failures.append(CollatorFailure(
                feats, describe, size, source, f"raised {type(e).__name__}: {e}"))
            continue
        if call != feats:
            report.failures.append(CollatorFailure(
                feats, describe, size, source, "wrote into its input features"))
            continue
        try:
            _judge(out, feats, labels=labels, ignore_index=ignore_index,
                   eos_token_id=eos_token_id, separator_id=separator_id,
                   pad_token_id=pad_token_id, mask=mask, report=report)
        except _Fail as e:
            report.failures.append(CollatorFailure(feats, describe, size, source, str(e)))
        except (ValueError, TypeError) as e:  # a field numpy cannot read (ragged, None)
            report.failures.append(CollatorFailure(
                feats, describe, size, source,
                f"returned a field numpy cannot read: {type(e).__name__}: {e}"))
    if report.cases == 0:
        raise AssertionError("packshard.collator: no case ran (every case was empty)")
    worst = report.smallest()
    if worst is not None and raise_on_failure:
        raise AssertionError(
            f"packshard.collator: {name} fails {len(report.failures)} of {report.cases} cases "
            f"(seed {seed}, labels={labels!r}); the smallest:\n  {worst}\n  features: "
            f"{worst.features}")
    return report
