"""packshard.collator_batches: collators of one row or many judged by the
Rust judge (issue 36; docs/FAULTS.md C1-C4, C6, C7, K1-K9). A correct
packing collator passes; each planted fault is caught at its field."""

import os
import sys

import numpy as np
import pytest

from conftest import hugging_face_transformers

from packshard.collator_batches import BatchFailure, batch_cases, check_batches, judge_batch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import collators as flat  # noqa: E402
import row_collators as rows  # noqa: E402


def caught(fn, **opts):
    with pytest.raises(BatchFailure) as e:
        check_batches(fn, **opts)
    return e.value


def test_correct_packing_collator_passes_over_many_rows():
    r = check_batches(rows.collator(), max_seq_len=rows.MAX_SEQ_LEN, cases=80)
    assert r["rows"] > 2 * r["cases"], r  # documents longer than a row split
    assert {"input_ids", "labels", "position_ids", "cu_seqlens", "max_seqlen",
            "num_items_in_batch", "attention_mask"} <= set(r["fields"]), r["fields"]
    assert not r["failures"]


@pytest.mark.parametrize("fault,field", [
    ("positions_not_reset", "position_ids"),
    ("labels_across_boundary", "labels"),
    ("cu_off_by_one", "cu_seqlens"),
    ("last_document_dropped", "input_ids"),
    ("first_token_not_ignored", "labels"),
    ("cu_int64", "cu_seqlens"),
])
def test_each_packing_fault_caught_at_its_field(fault, field):
    e = caught(rows.collator(fault), max_seq_len=rows.MAX_SEQ_LEN, **rows.FAULTS[fault])
    assert e.field == field, str(e)
    assert e.features, "the smallest case's features, to replay"
    # The smallest case replays: the same failure from judge_batch.
    with pytest.raises(BatchFailure) as again:
        judge_batch(e.features, rows.pack_rows(e.features, fault=fault),
                    **rows.FAULTS[fault])
    assert again.value.field == field


def test_cu_dtype_is_flash_attentions_int32_unless_waived():
    e = caught(rows.collator("cu_int64"), max_seq_len=rows.MAX_SEQ_LEN)
    assert "int32" in str(e), str(e)
    check_batches(rows.collator("cu_int64"), max_seq_len=rows.MAX_SEQ_LEN, cases=10,
                  cu_dtype=None)


def test_the_flattening_collator_and_its_faults_through_the_rust_judge():
    check_batches(flat.flatten, labels="unshifted", cases=60)
    check_batches(lambda f: flat.flatten(f, shifted=True, mask="additive"), cases=30)
    for name, (fn, opts) in flat.FAULTS.items():
        opts = dict(opts)
        opts.pop("pad_token_id", None)
        e = caught(fn, **opts)
        assert e.field in ("labels", "position_ids", "cu_seq_lens_q", "input_ids"), (name, str(e))


def test_the_three_position_id_readings_fail_and_the_right_one_passes():
    e = caught(flat.fa_misread_collator, labels="unshifted", kinds=("continuation", "one_token"))
    assert e.field == "cu_seq_lens_q", str(e)
    check_batches(flat.fa_position_ids_read_right, labels="unshifted",
                  kinds=("continuation", "one_token"))


def test_judge_batch_names_field_row_and_index():
    feats = [{"input_ids": [11, 12, 13]}, {"input_ids": [14]}, {"input_ids": [15, 16]}]
    ig = -100
    good = {"input_ids": [[11, 12, 13, 14, 15, 16]], "labels": [[12, 13, ig, ig, 16, ig]],
            "position_ids": [[0, 1, 2, 0, 0, 1]],
            "cu_seqlens": np.array([0, 3, 4, 6], dtype=np.int32)}
    assert judge_batch(feats, good)["rows"] == 1
    bad = dict(good, cu_seqlens=np.array([0, 3, 6], dtype=np.int32))  # C3
    with pytest.raises(BatchFailure) as e:
        judge_batch(feats, bad)
    assert (e.value.field, e.value.row, e.value.index) == ("cu_seqlens", 0, 2), str(e.value)
    # Two rows, per-row offsets (packshard's batch form), a 4D bool mask.
    two = {"input_ids": [[11, 12, 13, 0], [14, 15, 16, 0]],
           "labels": [[12, 13, ig, ig], [ig, 16, ig, ig]],
           "position_ids": [[0, 1, 2, 0], [0, 0, 1, 0]],
           "cu_seqlens": [np.array([0, 3]), np.array([0, 1, 3])]}
    doc = np.array([[1, 1, 1, 0], [1, 2, 2, 0]])
    causal = np.tril(np.ones((4, 4), bool))
    m = (doc[:, :, None] == doc[:, None, :]) & (doc[:, None, :] > 0) & causal
    assert judge_batch(feats, dict(two, attention_mask=m[:, None]))["rows"] == 2
    m[1, 2, 0] = True  # row 1: document 2's query sees document 1
    with pytest.raises(BatchFailure) as e:
        judge_batch(feats, dict(two, attention_mask=m[:, None]))
    assert (e.value.field, e.value.row, e.value.index) == ("attention_mask", 1, 2), str(e.value)


def test_bad_input_is_a_packshard_error_or_a_failure_never_a_crash():
    from packshard import PackshardError

    with pytest.raises(PackshardError) as e:
        batch_cases(labels="hf")
    assert e.value.field == "labels"
    with pytest.raises(PackshardError):
        judge_batch([{"input_ids": [1, 1]}], {"input_ids": [[1, 1]], "labels": [[1, 1]]})
    with pytest.raises(BatchFailure) as f:
        judge_batch([{"input_ids": [1]}], {"input_ids": [[1], [2, 3]], "labels": [[1]]})
    assert f.value.field == "batch"
    with pytest.raises(BatchFailure) as f:
        judge_batch([{"input_ids": [1]}], {"labels": [[1]]})
    assert f.value.field == "input_ids"


def test_pytest_fixtures(packshard_collator_cases, packshard_judge_batch,
                         packshard_check_batches):
    assert len(packshard_collator_cases) >= 50
    first = packshard_collator_cases[0]["features"]
    assert [len(f["input_ids"]) for f in first] == [3, 1, 2]  # C3's row first
    out = rows.pack_rows(first)
    assert packshard_judge_batch(first, out)["rows"] == 1
    r = packshard_check_batches(rows.collator(), max_seq_len=rows.MAX_SEQ_LEN)
    assert r["cases"] >= 50


def _tiny_tokenizer(transformers):
    """A word-level tokenizer with a pad token (the collators read only its
    padding side and pad id; the features are ids already)."""
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel({"[PAD]": 0, "[UNK]": 1}, unk_token="[UNK]"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]")


def test_hugging_face_collators_through_the_rust_judge():
    """transformers' DataCollatorWithFlattening (one row) and
    DataCollatorForLanguageModeling(mlm=False) (one right-padded document
    per row), numpy output, no torch."""
    transformers = hugging_face_transformers()
    hf = transformers.DataCollatorWithFlattening(
        return_tensors="np", return_flash_attn_kwargs=True, return_seq_idx=True)
    no_chunks = ("one_token", "empty", "prompt", "long")
    r = check_batches(hf, labels="unshifted", kinds=no_chunks)
    assert {"cu_seqlens", "seq_idx", "max_seqlen"} <= set(r["fields"]), r["fields"]
    # HF restarts a continuation chunk at 0 (C6): caught.
    e = caught(hf, labels="unshifted", kinds=("continuation",))
    assert e.field == "position_ids", str(e)
    lm = transformers.DataCollatorForLanguageModeling(_tiny_tokenizer(transformers), mlm=False,
                                                      return_tensors="np")
    r = check_batches(lm, labels="unshifted", kinds=("one_token", "empty", "long"))
    assert r["rows"] > r["cases"], r
    assert "attention_mask" in r["fields"]
