"""torch tensors through packshard's causal ops and collator checks (issue
36). Skipped without torch (CI does not install it); run with
``scripts/test_torch.sh`` (a venv with CPU torch) or ``pytest -m torch``
where torch is installed. On a machine with CUDA the tensors also start on
the GPU."""

import os
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (scripts/test_torch.sh)")
pytestmark = pytest.mark.torch

import packshard  # noqa: E402
from packshard.collator import check_collator  # noqa: E402
from packshard.collator_batches import BatchFailure, check_batches  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import collators as flat  # noqa: E402
import row_collators as rows  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
def test_causal_ops_take_and_return_tensors_on_the_inputs_device(device):
    ids = torch.tensor([[10, 11, 12, 13]], device=device)
    doc = torch.tensor([[1, 1, 2, 2]], device=device)
    r = packshard.causal_labels(ids, doc)
    assert isinstance(r["labels"], torch.Tensor) and r["labels"].device.type == device
    assert r["labels"].tolist() == [[11, -100, 13, -100]]  # C1, in the [1, n] form
    c = packshard.causal_conversions(position_ids=torch.tensor([5, 6, 7, 0, 1], device=device))
    assert c["cu_seqlens"].dtype == torch.int32  # flash_attn_varlen_func's
    assert c["cu_seqlens"].tolist() == [0, 3, 5]
    assert c["position_ids"].device.type == device


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_allow_move_false_keeps_a_gpu_tensor_where_it_is():
    with pytest.raises(packshard.PackshardError) as e:
        packshard.causal_labels(torch.tensor([1, 2], device="cuda"), [1, 1], allow_move=False)
    assert e.value.field == "input_ids"


def _to_torch(out, device):
    conv = {}
    for k, v in out.items():
        a = np.asarray(v)
        conv[k] = torch.from_numpy(np.ascontiguousarray(a)).to(device) if a.ndim else v
    return conv


@pytest.mark.parametrize("device", DEVICES)
def test_collators_returning_tensors_are_judged(device):
    check_batches(lambda f: _to_torch(rows.pack_rows(f), device), max_seq_len=rows.MAX_SEQ_LEN,
                  cases=20)
    with pytest.raises(BatchFailure) as e:
        check_batches(lambda f: _to_torch(rows.pack_rows(f, fault="cu_off_by_one"), device),
                      max_seq_len=rows.MAX_SEQ_LEN, cases=20)
    assert e.value.field == "cu_seqlens"
    # bf16 additive masks (no numpy dtype) through the one-row check.
    def bf16(f):
        out = _to_torch(flat.flatten(f, shifted=True, mask="additive"), device)
        out["attention_mask"] = out["attention_mask"].to(torch.bfloat16)
        return out
    check_collator(bf16, labels="shifted", cases=20)
