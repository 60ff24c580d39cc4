"""Data collators of packed causal-LM batches: a correct one and planted faults.

Each collator takes Hugging Face features (a list of ``{"input_ids": [...],
"labels": [...]?, "position_ids": [...]?}``) and returns one packed row as
numpy arrays ``[1, n]`` (Hugging Face's form). ``flatten`` is correct (what
transformers' ``DataCollatorWithFlattening`` does, plus continuation chunks'
positions, shifted labels, padding and a 4D mask as options); the others are
the faults of docs/FAULTS.md C1-C4, the mask-less concatenation and the
misreading of ``position_ids`` by transformers' flash-attention path, each
caught by :func:`packshard.collator.check_collator`.

    python examples/collators.py            # the correct one passes
    python examples/collators.py --fault c1 # caught (exit 1)
"""

import sys

import numpy as np

from packshard.collator import KINDS, boundaries_from_position_ids, check_collator

IGNORE = -100


def _positions(f):
    """A feature's positions: its own ``position_ids`` (a continuation
    chunk, C6) or ``0..m``."""
    if "position_ids" in f:
        return [int(p) for p in f["position_ids"]]
    return list(range(len(f["input_ids"])))


def _targets(f):
    """A feature's per-token target ids before any shift: ``labels`` (-100 on
    a prompt) or ``input_ids``."""
    return [int(x) for x in f.get("labels", f["input_ids"])]


def _out(ids, labels, positions, cu, seq_idx=None):
    out = {
        "input_ids": np.array([ids], dtype=np.int64),
        "labels": np.array([labels], dtype=np.int64),
        "position_ids": np.array([positions], dtype=np.int64),
        "cu_seq_lens_q": np.array(cu, dtype=np.int32),
        "cu_seq_lens_k": np.array(cu, dtype=np.int32),
        "max_length_q": int(np.max(np.diff(cu))) if len(cu) > 1 else 0,
    }
    out["max_length_k"] = out["max_length_q"]
    if seq_idx is not None:
        out["seq_idx"] = np.array([seq_idx], dtype=np.int32)
    return out


def flatten(features, *, shifted=False, mask=None, pad_to_multiple_of=None, pad_token_id=0):
    """The correct flattening collator: documents concatenated in order,
    positions from 0 per document (a continuation chunk keeps its own),
    labels per document (unshifted: each document's first slot -100, as
    Hugging Face's; ``shifted``: slot i holds the next token of its document),
    ``seq_idx``, flash-attention kwargs (``cu_seq_lens_q/k`` int32,
    ``max_length_q/k``). ``mask`` ``"bool"`` / ``"additive"``: also the 4D
    block-causal ``attention_mask`` ``[1, 1, n, n]``. ``pad_to_multiple_of``:
    each document padded to a multiple (``pad_token_id``, labels -100), the
    padding inside the document's segment, after its tokens."""
    ids, labels, pos, seq, cu, doc = [], [], [], [], [0], []
    for k, f in enumerate(features):
        x, t, p = [int(v) for v in f["input_ids"]], _targets(f), _positions(f)
        if not x:
            continue
        lab = t[1:] + [IGNORE] if shifted else [IGNORE] + t[1:]
        pad = (-len(x)) % pad_to_multiple_of if pad_to_multiple_of else 0
        ids += x + [pad_token_id] * pad
        labels += lab + [IGNORE] * pad
        pos += p + list(range(p[-1] + 1, p[-1] + 1 + pad))
        seq += [k] * (len(x) + pad)
        doc += [len(cu)] * len(x) + [0] * pad
        cu.append(cu[-1] + len(x) + pad)
    out = _out(ids, labels, pos, cu, seq)
    if mask is not None:
        d = np.array(doc)
        causal = np.tril(np.ones((len(d), len(d)), dtype=bool))
        allowed = (d[:, None] == d[None, :]) & (d[None, :] > 0) & causal
        allowed |= np.eye(len(d), dtype=bool)  # a padding query sees itself (no NaN row)
        m = allowed if mask == "bool" else np.where(allowed, 0.0, np.finfo(np.float32).min)
        out["attention_mask"] = m[None, None]
    return out


def eos_block_mask(features, eos_token_id=2):
    """The form of the Hugging Face community write-up on packing with EOS
    separators (correct on EOS-terminated documents): documents
    concatenated, boundaries found after each EOS token, positions reset
    there, unshifted labels with each document's first slot -100, and an
    additive 4D block-causal mask; no cu_seqlens."""
    ids = np.array([int(v) for f in features for v in f["input_ids"]], dtype=np.int64)
    n = ids.size
    starts = [0] + [i + 1 for i in range(n - 1) if ids[i] == eos_token_id]
    doc = np.zeros(n, dtype=np.int64)
    doc[starts] = 1
    doc = np.cumsum(doc)
    pos = np.arange(n) - np.asarray(starts)[doc - 1]
    t = [v for f in features for v in _targets(f)]
    labels = [IGNORE if i in set(starts) else t[i] for i in range(n)]
    allowed = (doc[:, None] == doc[None, :]) & np.tril(np.ones((n, n), dtype=bool))
    mask = np.where(allowed, 0.0, -np.inf)[None, None]
    return {"input_ids": ids[None], "labels": np.array([labels]), "position_ids": pos[None],
            "attention_mask": mask}


def c1_labels_across_documents(features):
    """C1 (torchtune PR 2613): shifted labels taken over the whole pack, so a
    document's last token predicts the next document's first."""
    out = flatten(features, shifted=True)
    t = [v for f in features for v in _targets(f)]
    out["labels"] = np.array([t[1:] + [IGNORE]], dtype=np.int64)
    return out


def c2_boundaries_from_eos_after_shift(features, eos_token_id=2):
    """C2 (torchtitan issue 3130), ported to EOS-terminated features: labels
    shifted per document (right), but the boundaries read from EOS after the
    shift, in the labels, where EOS sits one slot before the EOS token: each
    document ends a token early and its EOS opens the next one."""
    out = flatten(features, shifted=True)
    lab = out["labels"][0]
    n = lab.size
    cu = [0] + [i + 1 for i in range(n - 1) if lab[i] == eos_token_id] + [n]
    cu = sorted(set(cu))
    pos = np.concatenate([np.arange(b - a) for a, b in zip(cu[:-1], cu[1:])])
    seq = np.concatenate([np.full(b - a, k) for k, (a, b) in enumerate(zip(cu[:-1], cu[1:]))])
    return _out(out["input_ids"][0].tolist(), lab.tolist(), pos.tolist(), cu, seq.tolist())


def c3_boundaries_at_decrease(features):
    """C3 (ms-swift PR 9904): boundaries where the position strictly
    decreases, so ``[0, 1, 2, 0, 0, 1]`` reads as ``[0, 3, 6]`` and the
    one-token document merges into the next."""
    out = flatten(features)
    p = out["position_ids"][0]
    cu = [0] + (np.flatnonzero(p[1:] < p[:-1]) + 1).tolist() + [p.size]
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        out[key] = np.array(cu, dtype=np.int32)
    del out["seq_idx"]
    return out


def c4_padding_read_as_tail(features):
    """C4 (NeMo Automodel PR 3640): each document padded to a multiple of 4,
    but ``cu_seqlens`` built from the unpadded lengths and applied to the
    padded slots, as if all padding were at the row's tail."""
    out = flatten(features, pad_to_multiple_of=4)
    lens = [len(f["input_ids"]) for f in features if len(f["input_ids"])]
    cu = np.concatenate(([0], np.cumsum(lens))).tolist()
    cu[-1] = out["input_ids"].shape[1]
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        out[key] = np.array(cu, dtype=np.int32)
    del out["seq_idx"]
    return out


def concat_with_eos(features):
    """TRL's early ``packing=True`` (``ConstantLengthDataset``): EOS-terminated
    documents concatenated, labels = input_ids, no reset positions, no
    boundaries, no mask: every token attends to the documents before it."""
    ids = [int(v) for f in features for v in f["input_ids"]]
    return {"input_ids": np.array([ids]), "labels": np.array([ids])}


def fa_position_ids_misread(position_ids):
    """transformers' ``prepare_fa_kwargs_from_position_ids`` read as issue 36
    reports it: a document starts only where the position is 0 (the row's
    smallest), so a leading continuation chunk loses its start
    (``[5, 6, 7, 0, 1]`` -> ``[3, 5]``), a chunk after a document merges
    into it (``[0, 1, 2, 5, 6]`` -> ``[0, 5]``), and
    ``[2, 3, 4, 2, 3, 2, 0, 0]`` -> ``[6, 7, 8]``. The right reading is
    :func:`packshard.collator.boundaries_from_position_ids`."""
    p = np.asarray(position_ids).reshape(-1)
    return np.concatenate((np.flatnonzero(p == 0), [p.size])).astype(np.int64)


def fa_misread_collator(features):
    """``flatten`` with its flash-attention kwargs derived from
    ``position_ids`` by :func:`fa_position_ids_misread` (as a model's FA2 path
    does when handed position_ids only)."""
    out = flatten(features)
    cu = fa_position_ids_misread(out["position_ids"])
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        out[key] = cu.astype(np.int32)
    out["max_length_q"] = out["max_length_k"] = int(np.max(np.diff(cu))) if cu.size > 1 else 0
    del out["seq_idx"]
    return out


def fa_position_ids_read_right(features):
    """``flatten`` with its kwargs from ``position_ids`` read right
    (:func:`packshard.collator.boundaries_from_position_ids`): passes."""
    out = flatten(features)
    cu = boundaries_from_position_ids(out["position_ids"])
    for key in ("cu_seq_lens_q", "cu_seq_lens_k"):
        out[key] = cu.astype(np.int32)
    return out


# The collators that rebuild positions from their own boundaries renumber a
# continuation chunk from 0, a second fault (C6); without that kind the
# smallest failing case shows the fault named.
NO_CHUNKS = tuple(k for k in KINDS if k != "continuation")

# fault name -> (collator, check_collator options)
FAULTS = {
    "c1": (c1_labels_across_documents, {"labels": "shifted"}),
    "c2": (c2_boundaries_from_eos_after_shift, {"labels": "shifted", "eos_token_id": 2,
                                                 "kinds": NO_CHUNKS}),
    "c3": (c3_boundaries_at_decrease, {"labels": "unshifted"}),
    "c4": (c4_padding_read_as_tail, {"labels": "unshifted", "pad_token_id": 0}),
    "concat_with_eos": (concat_with_eos, {"labels": "unshifted", "eos_token_id": 2,
                                          "kinds": NO_CHUNKS}),
    "fa_misread": (fa_misread_collator, {"labels": "unshifted"}),
}


def main(argv):
    if len(argv) > 2 and argv[1] == "--fault":
        fn, opts = FAULTS[argv[2]]
    else:
        fn, opts = flatten, {"labels": "unshifted"}
    try:
        report = check_collator(fn, **opts)
    except AssertionError as e:
        print(e)
        return 1
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
