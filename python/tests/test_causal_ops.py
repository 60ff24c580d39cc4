"""packshard.causal_labels / causal_conversions as numpy functions, the
batch position_offset round trip, and packshard.strategies (issue 36)."""

import numpy as np
import pytest
from hypothesis import given, settings

import packshard
from packshard.collator_batches import judge_batch
from packshard.strategies import features, packed_rows, row_from_features


def test_causal_labels_returns_arrays_in_the_inputs_form():
    r = packshard.causal_labels([10, 11, 12, 13], [1, 1, 2, 2])
    assert isinstance(r["labels"], np.ndarray) and r["labels"].dtype == np.int64
    assert r["labels"].tolist() == [11, -100, 13, -100]  # C1: [a b | c d]
    assert r["num_predicted"] == 2
    row = packshard.causal_labels(np.array([[10, 11, 12, 13]]), cu_seqlens=[0, 2, 4],
                                  eos_token_id=2)
    assert row["labels"].tolist() == [[11, 2, 13, 2]]  # [1, n] in, [1, n] out
    assert row["loss_weights_per_token"].dtype == np.float64
    np.testing.assert_allclose(row["loss_weights_per_token"], [[0.25] * 4])


@pytest.mark.parametrize("positions,cu,canonical", [
    # transformers' FA2 path reads [3, 5]
    ([5, 6, 7, 0, 1], [0, 3, 5], [5, 6, 7, 0, 1]),
    # transformers' FA2 path reads [0, 5]
    ([0, 1, 2, 5, 6], [0, 3, 5], [0, 1, 2, 0, 1]),
    # transformers' FA2 path reads [6, 7, 8]
    ([2, 3, 4, 2, 3, 2, 0, 0], [0, 3, 5, 6, 7, 8], [2, 3, 4, 0, 1, 0, 0, 0]),
    ([0, 1, 2, 0, 0, 1], [0, 3, 4, 6], [0, 1, 2, 0, 0, 1]),  # C3
])
def test_causal_conversions_reads_issue_36s_rows(positions, cu, canonical):
    c = packshard.causal_conversions(position_ids=np.array([positions], dtype=np.int32))
    assert c["cu_seqlens"].dtype == np.int64 and c["cu_seqlens"].tolist() == cu
    # [1, n] in, [1, n] out; each segment from 0, the first from its own
    # first position (C6).
    assert c["position_ids"].tolist() == [canonical]


def test_causal_conversions_errors_name_the_field():
    with pytest.raises(packshard.PackshardError) as e:
        packshard.causal_conversions(position_ids=[0, 1], cu_seqlens=[0, 2])
    assert e.value.field == "cu_seqlens"
    with pytest.raises(packshard.PackshardError) as e:
        packshard.causal_conversions(doc_ids=[[1, 1], [2, 2]])
    assert e.value.field == "doc_ids"
    with pytest.raises(packshard.PackshardError) as e:
        packshard.causal_labels([1.5, 2.0], [1, 1])
    assert e.value.field == "input_ids"


def test_batch_position_offset_round_trips_through_causal_conversions():
    seqs = [[5, 6, 7], [8, 9], [10], [11, 12, 13, 14]]
    b = packshard.batch(seqs, 8, position_offset=2)
    checked = 0
    for p in range(b["num_packs"]):
        sid = b["sequence_ids"][p]
        real = sid > 0
        c = packshard.causal_conversions(doc_ids=sid, position_offset=2)
        assert c["cu_seqlens"].tolist() == b["cu_seqlens"][p].tolist()
        assert c["position_ids"].tolist() == b["position_ids"][p][real].tolist()
        back = packshard.causal_conversions(position_ids=b["position_ids"][p][real],
                                            position_offset=2)
        assert back["position_ids"].tolist() == b["position_ids"][p][real].tolist()
        assert back["cu_seqlens"].tolist() == b["cu_seqlens"][p].tolist()
        # Negative control: without the offset only the first segment keeps it.
        if len(b["cu_seqlens"][p]) > 2:
            plain = packshard.causal_conversions(doc_ids=sid)
            assert plain["position_ids"].tolist() != b["position_ids"][p][real].tolist()
            checked += 1
    assert checked > 0


@settings(max_examples=40, deadline=None)
@given(packed_rows(prompts=False))
def test_strategy_rows_agree_with_the_reference_and_pass_the_judge(drawn):
    feats, row = drawn
    ref = packshard.causal_labels(row["input_ids"], row["doc_ids"])
    assert ref["labels"].tolist() == row["labels"].tolist()
    conv = packshard.causal_conversions(position_ids=row["position_ids"])
    assert conv["cu_seqlens"].tolist() == row["cu_seqlens"].tolist()
    batch = {k: row[k][None] for k in ("input_ids", "labels", "position_ids", "seq_idx")}
    batch.update(cu_seqlens=row["cu_seqlens"], max_seqlen=row["max_seqlen"],
                 num_items_in_batch=row["num_items_in_batch"])
    judge_batch(feats, batch)


@settings(max_examples=30, deadline=None)
@given(features(eos_token_id=2, continuations=False))
def test_strategy_features_with_eos_and_prompts_pass_the_judge(feats):
    assert all(f["input_ids"][-1] == 2 for f in feats if f["input_ids"])
    row = row_from_features(feats)
    batch = {k: row[k][None] for k in ("input_ids", "labels", "position_ids")}
    batch["cu_seqlens"] = row["cu_seqlens"]
    judge_batch(feats, batch, eos_token_id=2)
