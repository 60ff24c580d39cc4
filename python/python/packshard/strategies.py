"""Hypothesis strategies for packed causal-LM batches (issue 36).

    from hypothesis import given
    from packshard.strategies import features, packed_rows

    @given(features())
    def test_my_collator(feats):
        packshard.collator_batches.judge_batch(feats, my_collator(feats))

:func:`features` draws Hugging Face features (the documents a collator
gets: one-token and empty documents, prompt masks, continuation chunks),
token ids unique in the draw so :func:`packshard.collator_batches.judge_batch`
can read any layout back. :func:`packed_rows` draws a correct flattened row
with every field (the reference construction, for testing code that
consumes packed batches). Needs ``hypothesis`` (not a dependency of
packshard: ``pip install hypothesis``).
"""

import numpy as np

try:
    from hypothesis import strategies as st
except ImportError as e:  # pragma: no cover - hypothesis is optional
    raise ImportError("packshard.strategies needs hypothesis: pip install hypothesis") from e

__all__ = ["features", "packed_rows", "row_from_features"]

#: Token ids are drawn from 1 .. MAX_TOKEN - 1, unique in a draw (the
#: collator judge reads the layout from them; 2^20 as the Rust generator's).
MAX_TOKEN = 1 << 20


@st.composite
def features(draw, *, min_documents=1, max_documents=8, max_length=40, empty=True,
             prompts=True, continuations=True, eos_token_id=None, reserved=(0,)):
    """A list of Hugging Face features: ``{"input_ids"}``, plus ``labels``
    (``-100`` on a prompt's first tokens) and ``position_ids`` (a
    continuation chunk from a first position > 0, C6) when drawn. Lengths
    0 (``empty``) .. ``max_length``; at least one token in all. With
    ``eos_token_id`` every non-empty document ends with it (and has 2 tokens
    at least). ``reserved`` ids (padding, separators) are never drawn."""
    n = draw(st.integers(min_documents, max_documents))
    low = 2 if eos_token_id is not None else 1
    lengths = draw(st.lists(st.integers(0 if empty else low, max_length), min_size=n,
                            max_size=n).filter(lambda ls: sum(ls) > 0))
    lengths = [max(m, low) if m else 0 for m in lengths]
    banned = {int(x) for x in reserved} | ({int(eos_token_id)} if eos_token_id is not None
                                           else set())
    ids = draw(st.lists(st.integers(1, MAX_TOKEN - 1).filter(lambda t: t not in banned),
                        min_size=sum(lengths), max_size=sum(lengths), unique=True))
    out, at, last = [], 0, None
    for m in lengths:
        x = ids[at:at + m]
        at += m
        if eos_token_id is not None and m:
            x[-1] = int(eos_token_id)
        f = {"input_ids": x}
        if prompts and m > 1 and draw(st.booleans()):
            k = draw(st.integers(1, m - 1))
            f["labels"] = [-100] * k + x[k:]
        if continuations and m and draw(st.booleans()):
            start = draw(st.integers(1, 64))
            if last is not None and start == last + 1:
                start += 1  # keep the boundary visible in position_ids (C3)
            f["position_ids"] = list(range(start, start + m))
        if m:
            first = f.get("position_ids", [0])[0]
            last = first + m - 1
        out.append(f)
    return out


def row_from_features(feats, *, ignore_index=-100):
    """The correct flattened row of ``feats`` (packshard's reference
    construction): ``input_ids``, ``position_ids``, ``seq_idx``, ``doc_ids``
    (1.., one per non-empty document), ``labels`` (shifted: the next token
    of the same document; ``ignore_index`` after its last and where the
    feature's ``labels`` say -100), ``cu_seqlens`` (int32, flash-attention's),
    ``max_seqlen``, ``num_items_in_batch``; every per-token field ``[n]``
    int64."""
    ids, pos, seq, doc, lab, cu = [], [], [], [], [], [0]
    docs = [f for f in feats if len(f["input_ids"])]
    for k, f in enumerate(docs):
        x = [int(t) for t in f["input_ids"]]
        target = [int(t) for t in f.get("labels", x)]
        ids += x
        pos += [int(p) for p in f.get("position_ids", range(len(x)))]
        seq += [k] * len(x)
        doc += [k + 1] * len(x)
        lab += [ignore_index if t == -100 else t for t in target[1:]] + [ignore_index]
        cu.append(len(ids))
    lab = np.asarray(lab, dtype=np.int64)
    return {
        "input_ids": np.asarray(ids, dtype=np.int64),
        "position_ids": np.asarray(pos, dtype=np.int64),
        "seq_idx": np.asarray(seq, dtype=np.int64),
        "doc_ids": np.asarray(doc, dtype=np.int64),
        "labels": lab,
        "cu_seqlens": np.asarray(cu, dtype=np.int32),
        "max_seqlen": int(np.max(np.diff(cu))) if len(cu) > 1 else 0,
        "num_items_in_batch": int(np.sum(lab != ignore_index)),
    }


@st.composite
def packed_rows(draw, **kwargs):
    """``(features, row)``: :func:`features` (same keyword arguments) and
    :func:`row_from_features` of them."""
    f = draw(features(**kwargs))
    return f, row_from_features(f)
