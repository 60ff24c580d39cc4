"""Packing collators over several rows: a correct one and planted faults,
judged by :func:`packshard.collator_batches.check_batches` (issue 36,
docs/FAULTS.md K1-K9).

Each collator takes Hugging Face features and returns a batch of ``[r, n]``
numpy arrays: ``pack_rows`` packs the documents first-fit into rows of
``max_seq_len`` slots, splits a document longer than a row (each piece keeps
its positions, C6), pads each row's tail, and returns shifted labels,
``position_ids``, flat ``cu_seqlens`` (int32, over the ``r * n`` slots,
each row's padding its own segment), ``max_seqlen``, ``num_items_in_batch``
and a 2D ``attention_mask``. The faults are mistakes collators have
shipped, each caught:

    python examples/row_collators.py                    # passes
    python examples/row_collators.py --fault cu_off_by_one   # caught (exit 1)
"""

import sys

import numpy as np

from packshard.collator_batches import BatchFailure, check_batches

IGNORE = -100
MAX_SEQ_LEN = 16


def _targets(f):
    """A feature's per-token targets before the shift (-100 on a prompt)."""
    return [int(x) for x in f.get("labels", f["input_ids"])]


def _positions(f):
    return [int(p) for p in f.get("position_ids", range(len(f["input_ids"])))]


def _pieces(features, max_seq_len):
    """Pieces ``(feature, start, stop)``: documents cut into pieces of at
    most ``max_seq_len`` tokens, in order."""
    out = []
    for f in features:
        m = len(f["input_ids"])
        for a in range(0, m, max_seq_len):
            out.append((f, a, min(a + max_seq_len, m)))
    return out


def pack_rows(features, max_seq_len=MAX_SEQ_LEN, *, pad_token_id=0, fault=None):
    """The correct packing collator (``fault=None``), first-fit: rows of
    ``max_seq_len`` slots."""
    rows = []  # per row: a list of pieces
    if fault == "last_document_dropped":
        nonempty = [i for i, f in enumerate(features) if len(f["input_ids"])]
        if len(nonempty) > 1:  # `features[:-1]` of the non-empty ones
            features = [f for i, f in enumerate(features) if i != nonempty[-1]]
    for piece in _pieces(features, max_seq_len):
        size = piece[2] - piece[1]
        for row in rows:
            if sum(b - a for _, a, b in row) + size <= max_seq_len:
                row.append(piece)
                break
        else:
            rows.append([piece])
    r = max(len(rows), 1)
    ids = np.full((r, max_seq_len), pad_token_id, dtype=np.int64)
    labels = np.full((r, max_seq_len), IGNORE, dtype=np.int64)
    pos = np.zeros((r, max_seq_len), dtype=np.int64)
    mask = np.zeros((r, max_seq_len), dtype=np.int64)
    cu = [0]
    for p, row in enumerate(rows):
        at = 0
        for f, a, b in row:
            x, t, q = f["input_ids"][a:b], _targets(f)[a:b + 1], _positions(f)[a:b]
            m = b - a
            ids[p, at:at + m] = x
            pos[p, at:at + m] = q if fault != "positions_not_reset" else range(at, at + m)
            nxt = [IGNORE if v == IGNORE else v for v in t[1:m]] + [IGNORE]
            if fault == "labels_across_boundary":
                nxt = None  # filled over the row below
            else:
                labels[p, at:at + m] = nxt
            mask[p, at:at + m] = 1
            at += m
            cu.append(p * max_seq_len + at)
        if fault == "labels_across_boundary":
            labels[p, :at - 1] = ids[p, 1:at]  # torchtune PR 2613, per row
        if at < max_seq_len:
            cu.append(p * max_seq_len + max_seq_len)  # the padding's own segment
    cu = np.array(cu, dtype=np.int32)
    if fault == "cu_off_by_one":
        cu[1:-1] += 1
    longest = max((b - a for row in rows for _, a, b in row), default=0)
    out = {"input_ids": ids, "labels": labels, "position_ids": pos, "cu_seqlens": cu,
           "max_seqlen": longest, "num_items_in_batch": int(np.sum(labels != IGNORE)),
           "attention_mask": mask}
    if fault == "first_token_not_ignored":
        # Hugging Face's unshifted form without -100 at each document's first
        # slot (DataCollatorForLanguageModeling's labels = input_ids copy):
        # judged with labels="unshifted".
        out["labels"] = np.where(mask == 1, ids, IGNORE)
    if fault == "cu_int64":
        out["cu_seqlens"] = cu.astype(np.int64)
    return out


# fault -> check_batches options; each is caught at the field named in the
# test (python/tests/test_collator_batches.py).
FAULTS = {
    "positions_not_reset": {},
    "labels_across_boundary": {},
    "cu_off_by_one": {},
    "last_document_dropped": {},
    "first_token_not_ignored": {"labels": "unshifted"},
    "cu_int64": {},
}


def collator(fault=None):
    """``pack_rows`` with ``fault``, as a one-argument collator."""
    def fn(features):
        return pack_rows(features, fault=fault)
    fn.__name__ = f"pack_rows[{fault or 'correct'}]"
    return fn


def main(argv):
    fault = argv[2] if len(argv) > 2 and argv[1] == "--fault" else None
    opts = FAULTS.get(fault, {})
    try:
        report = check_batches(collator(fault), max_seq_len=MAX_SEQ_LEN, **opts)
    except BatchFailure as e:
        print(e)
        return 1
    print({k: v for k, v in report.items() if k != "failures"})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
