"""packshard.collator: a correct collator passes, each planted fault is caught
with a message naming the field (issue 36, docs/FAULTS.md C1-C4)."""

import os
import sys

import numpy as np
import pytest

from conftest import hugging_face_transformers

import packshard
from packshard import collator
from packshard.collator import boundaries_from_position_ids, check_collator

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import collators as ex  # noqa: E402


def failure(fn, **opts):
    """The message check_collator raises for ``fn`` (the test fails if none)."""
    with pytest.raises(AssertionError) as e:
        check_collator(fn, **opts)
    return str(e.value)


def test_exported_from_the_package():
    assert packshard.check_collator is check_collator


@pytest.mark.parametrize("opts", [
    {"labels": "unshifted"},
    {"labels": "shifted", "shifted": True},
    {"labels": "unshifted", "mask": "bool"},
    {"labels": "shifted", "shifted": True, "mask": "additive"},
    {"labels": "unshifted", "pad_token_id": 0, "pad_to_multiple_of": 4},
    {"labels": "unshifted", "eos_token_id": 2},
])
def test_correct_flattening_collator_passes(opts):
    opts = dict(opts)
    kw = {k: opts.pop(k) for k in ("shifted", "pad_to_multiple_of") if k in opts}
    if "mask" in opts:
        kw["mask"] = opts["mask"]

    def fn(features):
        return ex.flatten(features, **kw)
    r = check_collator(fn, cases=120, seed=1, **opts)
    assert r.cases >= 110 and r.tokens > 2000, r
    want = {"input_ids", "labels", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k",
            "max_length_q", "max_length_k", "seq_idx"}
    assert want <= r.fields, r.fields
    if "mask" in kw:
        assert "attention_mask" in r.fields


def test_the_cases_hold_every_kind():
    cases = collator.generate_features(200, seed=0)
    lens = [[len(f["input_ids"]) for f in feats] for feats, _, _ in cases]
    assert any(1 in ls for ls in lens), "no one-token document"
    assert any(0 in ls for ls in lens), "no empty document"
    assert any(max(ls) >= 61 and len(ls) > 3 for ls in lens), "no long beside short"
    assert any(any("position_ids" in f for f in feats) for feats, _, _ in cases)
    assert any(any(-100 in f.get("labels", []) for f in feats) for feats, _, _ in cases)
    # the three position-id rows of issue 36 are fixed cases
    rows = [sum((f.get("position_ids", list(range(len(f["input_ids"])))) for f in feats), [])
            for feats, _, _ in cases[:10]]
    for row in ([5, 6, 7, 0, 1], [0, 1, 2, 5, 6], [2, 3, 4, 2, 3, 2, 0, 0], [0, 1, 2, 0, 0, 1]):
        assert row in rows, row


def test_boundaries_from_position_ids_reads_issue_36_right():
    # The right readings (issue 36: transformers' SDPA path and packshard agree).
    assert boundaries_from_position_ids([5, 6, 7, 0, 1]).tolist() == [0, 3, 5]
    assert boundaries_from_position_ids([0, 1, 2, 5, 6]).tolist() == [0, 3, 5]
    assert boundaries_from_position_ids([2, 3, 4, 2, 3, 2, 0, 0]).tolist() == [0, 3, 5, 6, 7, 8]
    assert boundaries_from_position_ids([0, 1, 2, 0, 0, 1]).tolist() == [0, 3, 4, 6]
    # and packshard's own causal_conversions agrees
    for p in ([5, 6, 7, 0, 1], [2, 3, 4, 2, 3, 2, 0, 0]):
        r = packshard.eval({"op": "causal_conversions", "position_ids": p})
        assert r["cu_seqlens"] == boundaries_from_position_ids(p).tolist()


def test_the_misreading_port_reads_as_issue_36_reports():
    assert ex.fa_position_ids_misread([5, 6, 7, 0, 1]).tolist() == [3, 5]
    assert ex.fa_position_ids_misread([0, 1, 2, 5, 6]).tolist() == [0, 5]
    assert ex.fa_position_ids_misread([2, 3, 4, 2, 3, 2, 0, 0]).tolist() == [6, 7, 8]


def test_c1_labels_across_documents_caught():
    msg = failure(ex.c1_labels_across_documents, labels="shifted")
    assert "labels[" in msg and "shifted" in msg, msg


def test_c2_boundaries_from_eos_after_shift_caught():
    fn, opts = ex.FAULTS["c2"]
    msg = failure(fn, **opts)
    # the boundary lands a slot early (or nowhere, for EOS-only documents):
    # the positions name it first
    assert "position_ids[" in msg, msg


def test_c3_boundaries_at_decrease_caught():
    msg = failure(ex.c3_boundaries_at_decrease, labels="unshifted")
    assert "cu_seq_lens_q[" in msg, msg
    # the smallest failing case is C3's own: one-token documents side by side
    assert "lengths [1, 1]" in msg or "lengths [3, 1, 2]" in msg, msg


def test_c4_padding_read_as_tail_caught():
    msg = failure(ex.c4_padding_read_as_tail, labels="unshifted", pad_token_id=0)
    assert "cu_seq_lens_q[" in msg, msg


def test_concatenation_with_eos_and_no_mask_caught():
    fn, opts = ex.FAULTS["concat_with_eos"]
    msg = failure(fn, **opts)
    assert "returned no position_ids" in msg, msg
    # with positions reset but still no boundaries, the boundary check names it
    def reset_only(features):
        out = ex.concat_with_eos(features)
        out["position_ids"] = ex.flatten(features)["position_ids"]
        return out
    msg = failure(reset_only, **opts)
    assert "no document boundaries" in msg, msg


@pytest.mark.parametrize("row,features", [
    ([5, 6, 7, 0, 1], [{"input_ids": [11, 12, 13], "position_ids": [5, 6, 7]},
                       {"input_ids": [14, 15]}]),
    ([0, 1, 2, 5, 6], [{"input_ids": [11, 12, 13]},
                       {"input_ids": [14, 15], "position_ids": [5, 6]}]),
    ([2, 3, 4, 2, 3, 2, 0, 0], [{"input_ids": [11, 12, 13], "position_ids": [2, 3, 4]},
                                {"input_ids": [14, 15], "position_ids": [2, 3]},
                                {"input_ids": [16], "position_ids": [2]},
                                {"input_ids": [17]}, {"input_ids": [18]}]),
])
def test_each_position_ids_misreading_caught(row, features):
    assert ex.flatten(features)["position_ids"][0].tolist() == row
    msg = failure(ex.fa_misread_collator, labels="unshifted", cases=[features])
    assert "cu_seq_lens_q[" in msg, msg
    # negative control: the same kwargs read right pass this case
    check_collator(ex.fa_position_ids_read_right, labels="unshifted", cases=[features])


def test_misreading_caught_in_the_default_run_and_right_reading_passes():
    msg = failure(ex.fa_misread_collator, labels="unshifted")
    assert "cu_seq_lens_q[" in msg, msg
    r = check_collator(ex.fa_position_ids_read_right, labels="unshifted")
    assert r.cases >= 190


def test_messages_name_field_index_and_both_values():
    msg = failure(ex.c3_boundaries_at_decrease, labels="unshifted",
                  cases=[[{"input_ids": [11, 12, 13]}, {"input_ids": [14]},
                          {"input_ids": [15, 16]}]])
    assert "cu_seq_lens_q[2] is 6, expected 4" in msg, msg


def test_wrong_label_convention_is_caught_both_ways():
    # an unshifted collator judged as shifted fails, and the reverse
    assert "labels[" in failure(ex.flatten, labels="shifted")
    assert "labels[" in failure(lambda f: ex.flatten(f, shifted=True), labels="unshifted")


def test_mask_faults_caught():
    def leaky(features):  # causal over the whole row: documents see each other
        out = ex.flatten(features, mask="bool")
        n = out["input_ids"].shape[1]
        out["attention_mask"] = np.tril(np.ones((n, n), bool))[None, None]
        return out
    msg = failure(leaky, labels="unshifted", mask="bool")
    assert "attention_mask[0, 0," in msg and "expected masked" in msg, msg

    def weak(features):  # an additive mask of -1: not a mask
        out = ex.flatten(features, mask="additive")
        m = out["attention_mask"]
        out["attention_mask"] = np.where(m < 0, -1.0, 0.0)
        return out
    msg = failure(weak, labels="unshifted", mask="additive")
    assert "attention_mask[0, 0," in msg and "-1.0" in msg, msg
    assert "no 4D attention_mask" in failure(ex.flatten, labels="unshifted", mask="bool")


def test_denominator_and_max_length_faults_caught():
    def count_rows(features):  # C7: real tokens minus one per row
        out = ex.flatten(features)
        out["num_items_in_batch"] = int(out["input_ids"].shape[1]) - 1
        return out
    assert "num_items_in_batch is" in failure(count_rows, labels="unshifted")

    def short_max(features):
        out = ex.flatten(features)
        out["max_length_q"] = int(out["max_length_q"]) - 1
        return out
    assert "max_length_q is" in failure(short_max, labels="unshifted")


def test_collator_that_raises_or_writes_its_input_fails():
    def boom(features):
        raise RuntimeError("no")
    assert "raised RuntimeError: no" in failure(boom)

    def writes(features):
        features[0]["input_ids"].append(1)
        return ex.flatten(features)
    assert "wrote into its input" in failure(writes, labels="unshifted")


def test_bad_options_refused():
    with pytest.raises(ValueError, match="labels"):
        check_collator(ex.flatten, labels="hf")
    with pytest.raises(ValueError, match="kinds"):
        check_collator(ex.flatten, kinds=("bogus",))


def test_hugging_face_data_collator_with_flattening():
    """transformers' own DataCollatorWithFlattening (numpy, no torch) judged
    end to end in Hugging Face's conventions."""
    transformers = hugging_face_transformers()
    hf = transformers.DataCollatorWithFlattening(
        return_tensors="np", return_flash_attn_kwargs=True, return_seq_idx=True)
    # HF numbers every document from 0: continuation chunks' positions are
    # not kept (C6), so that kind is left out here.
    kinds = tuple(k for k in collator.KINDS if k != "continuation")
    r = check_collator(hf, labels="unshifted", kinds=kinds)
    assert {"input_ids", "labels", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k",
            "max_length_q", "seq_idx"} <= r.fields, r.fields
    assert r.cases >= 190
    # separator_id: each document but the row's last learns to predict it
    sep = transformers.DataCollatorWithFlattening(return_tensors="np", separator_id=2,
                                                  return_flash_attn_kwargs=True)
    check_collator(sep, labels="unshifted", separator_id=2, kinds=kinds)
    # and the continuation chunks are caught: HF restarts them at 0
    msg = failure(hf, labels="unshifted", kinds=("continuation",))
    assert "position_ids[" in msg, msg


def test_undeclared_mask_form_read_from_its_dtype():
    # a float mask is additive even when nothing is masked ([[0.]] for one
    # token), an integer one boolean
    one = [[{"input_ids": [7]}]]
    check_collator(lambda f: ex.flatten(f, mask="additive"), labels="unshifted", cases=one)

    def int_mask(features):
        out = ex.flatten(features, mask="bool")
        out["attention_mask"] = out["attention_mask"].astype(np.int64)
        return out
    check_collator(int_mask, labels="unshifted", cases=60)

    def inverted(features):  # 1 = masked, as some kernels take it
        out = int_mask(features)
        out["attention_mask"] = 1 - out["attention_mask"]
        return out
    assert "attention_mask[0, 0," in failure(inverted, labels="unshifted", cases=60)


class FakeTensor:
    """What _np reads of a torch tensor (torch is not installed in CI):
    detach, cpu, is_floating_point, double, numpy."""

    def __init__(self, a):
        self.a = np.asarray(a)

    def detach(self):
        return self

    def cpu(self):
        return self

    def is_floating_point(self):
        return self.a.dtype.kind == "f"

    def double(self):
        return FakeTensor(self.a.astype(np.float64))

    def numpy(self):
        return self.a


def test_tensor_like_fields_accepted():
    def as_tensors(features):
        out = ex.flatten(features, mask="additive")
        return {k: FakeTensor(v) if isinstance(v, np.ndarray) else v for k, v in out.items()}
    r = check_collator(as_tensors, labels="unshifted", mask="additive", cases=60)
    assert "attention_mask" in r.fields


def test_leading_padding_is_its_own_segment():
    def left_padded(features):  # two padding slots before the row, their own segment
        out = ex.flatten(features)
        n = out["input_ids"].shape[1]
        out["input_ids"] = np.concatenate(([[0, 0]], out["input_ids"]), axis=1)
        out["labels"] = np.concatenate(([[-100, -100]], out["labels"]), axis=1)
        out["position_ids"] = np.concatenate(([[0, 0]], out["position_ids"]), axis=1)
        cu = np.concatenate(([0], out["cu_seq_lens_q"] + 2)).astype(np.int32)
        out["cu_seq_lens_q"] = out["cu_seq_lens_k"] = cu
        out["seq_idx"] = np.concatenate(([[-1, -1]], out["seq_idx"]), axis=1)
        assert cu[-1] == n + 2
        return out
    check_collator(left_padded, labels="unshifted", pad_token_id=0, cases=60)

    def merged(features):  # the padding inside the first document's segment
        out = left_padded(features)
        cu = out["cu_seq_lens_q"]
        out["cu_seq_lens_q"] = out["cu_seq_lens_k"] = np.concatenate(([0], cu[2:]))
        return out
    msg = failure(merged, labels="unshifted", pad_token_id=0, cases=60)
    assert "cu_seq_lens_q[1] is" in msg and "expected 2" in msg, msg


def test_eos_block_mask_form_passes_on_eos_terminated_documents():
    # the community write-up's form: boundaries from EOS, positions reset,
    # a 4D mask, no cu_seqlens; no continuation chunks (it renumbers them)
    r = check_collator(ex.eos_block_mask, labels="unshifted", eos_token_id=2, mask="additive",
                       kinds=ex.NO_CHUNKS)
    assert "attention_mask" in r.fields and "cu_seq_lens_q" not in r.fields
    # negative control: without EOS in the documents it finds one document
    msg = failure(ex.eos_block_mask, labels="unshifted", mask="additive", kinds=ex.NO_CHUNKS)
    assert "position_ids[" in msg, msg


def test_padding_inside_a_document_fails_the_case():
    def split(features):  # a padding slot after each row's first token
        out = ex.flatten(features)
        for k, v in (("input_ids", 0), ("labels", -100), ("position_ids", 0), ("seq_idx", 0)):
            a = out[k][0]
            out[k] = np.concatenate((a[:1], [v], a[1:]))[None]
        cu = np.concatenate(([0], out["cu_seq_lens_q"][1:] + 1))
        out["cu_seq_lens_q"] = out["cu_seq_lens_k"] = cu
        return out
    msg = failure(split, labels="unshifted", pad_token_id=0,
                  cases=[[{"input_ids": [5, 6, 7]}, {"input_ids": [8, 9]}]])
    assert "input_ids: the padding splits a document" in msg and "doc_ids[2]" in msg, msg


def test_unreadable_fields_fail_the_case():
    def ragged(features):
        out = ex.flatten(features)
        out["position_ids"] = [[0, 1], [2]]
        return out
    assert "numpy cannot read" in failure(ragged, labels="unshifted", cases=20)

    def floats(features):
        out = ex.flatten(features)
        out["labels"] = out["labels"].astype(np.float32)
        return out
    assert "labels: dtype float32, expected integers" in failure(floats, labels="unshifted")

    def two_rows(features):
        out = ex.flatten(features)
        out["input_ids"] = np.concatenate((out["input_ids"], out["input_ids"]))
        return out
    assert "input_ids: shape [2," in failure(two_rows, labels="unshifted")
