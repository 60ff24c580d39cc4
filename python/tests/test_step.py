"""packshard.step_plan: the training step's split and loss weights (issue 34,
docs/STEP.md), checked the way a framework author would check their own
partitioner and loss scaling."""
import numpy as np
import pytest

import packshard
from packshard import PackshardError

# Lengths not multiples of 2 C, a one-token document, one long one.
DOCS = [list(range(1, 6)), [7], list(range(10, 23)), list(range(30, 38)), [40, 41, 42]]


@pytest.mark.parametrize("reduction", ["per-token", "per-document", "per-row"])
@pytest.mark.parametrize("g,d,c", [(1, 1, 2), (1, 2, 2), (2, 1, 4), (1, 1, 1)])
def test_weights_sum_to_one_over_the_step_and_every_real_token_appears_once(reduction, g, d, c):
    r = packshard.step_plan(DOCS, grad_accum=g, dp=d, cp=c, reduction=reduction)
    assert len(r["microbatches"]) == g * d
    total = 0.0
    for m in r["microbatches"]:
        assert len(m["ranks"]) == c
        pad = m["cu_seqlens_padded"]
        real = m["cu_seqlens"]
        # Every padded slot of the pack on exactly one rank: the split is a partition.
        slots = np.sort(np.concatenate([rk["token_index"] for rk in m["ranks"]]))
        assert np.array_equal(slots, np.arange(pad[-1]))
        for rk in m["ranks"]:
            w, labels = rk["loss_weights"], rk["labels"]
            assert w.shape == labels.shape == rk["token_index"].shape
            # Nothing predicted (padding, a document's last token): no weight.
            assert np.all(w[labels == -100] == 0.0)
            # A slot is real when it is within its document's real length.
            doc = np.searchsorted(pad, rk["token_index"], side="right") - 1
            is_real = rk["token_index"] - pad[doc] < real[doc + 1] - real[doc]
            assert np.all(labels[~is_real] == -100)
            assert np.array_equal(rk["input_ids"][~is_real], np.zeros((~is_real).sum()))
            total += w.sum()
    # per-token and per-document weights are means: they sum to 1. per-row
    # is `loss.sum(-1).mean()` of the unpacked batch (a row a document): 1 / R
    # a token, summing to M / R.
    expect = r["num_predicted"] / len(DOCS) if reduction == "per-row" else 1.0
    assert total == pytest.approx(expect, abs=1e-12)
    if reduction == "per-token":
        # Every predicted token weighs 1 / M over the step: padding is never
        # in the denominator (D8) and no microbatch has its own mean (D1, D2).
        m_pred = r["num_predicted"]
        assert m_pred == sum(len(doc) - 1 for doc in DOCS)
        for m in r["microbatches"]:
            for rk in m["ranks"]:
                w = rk["loss_weights"]
                assert np.allclose(w[w != 0], 1.0 / m_pred, rtol=0, atol=1e-15)


def test_a_per_microbatch_mean_is_not_the_step_mean():
    """Negative control (D1): the weights a per-microbatch mean gives differ
    from the plan's wherever microbatches predict unequal token counts."""
    r = packshard.step_plan(DOCS, grad_accum=2, cp=2)
    ours, theirs = [], []
    for m in r["microbatches"]:
        w = np.concatenate([rk["loss_weights"] for rk in m["ranks"]])
        n_m = np.count_nonzero(w)
        ours.append(w[w != 0])
        theirs.append(np.full(n_m, 1.0 / (n_m * len(r["microbatches"]))))
    assert not np.allclose(np.concatenate(ours), np.concatenate(theirs))


def test_bad_input_names_the_field():
    with pytest.raises(PackshardError, match="cp"):
        packshard.step_plan(DOCS, cp=0)
    with pytest.raises(PackshardError, match="reduction"):
        packshard.step_plan(DOCS, reduction="per-batch")
    with pytest.raises(PackshardError, match=r"documents\[1\]\[0\]"):
        packshard.step_plan([[1, 2], [-3]])
