"""packshard.testing: registered kernels pass, planted faults are caught."""

import json

import numpy as np
import pytest

import packshard
from packshard import testing


def registered(op, impl):
    fn = getattr(packshard, op)

    def kernel(**kw):
        return fn(**kw, impl=impl)
    return kernel


def test_cases_are_the_rust_fuzz_cases():
    a = testing.cases("attention", 30, seed=5)
    b = testing.cases("attention", 30, seed=5)
    assert [c[1] for c in a] == [c[1] for c in b]
    assert any(0 in np.diff(c[0]["cu_seqlens"]) for c in a), "no empty segment"
    ce = testing.cases("cross_entropy", 200, seed=5)
    assert any(c[0]["vocab_size"] < c[0]["logits"].shape[1] for c in ce), "no padded vocabulary"
    assert any((c[0]["targets"] == c[0]["ignore_index"]).any() for c in ce), "no ignored target"
    assert any("planted" in c[1] for c in ce)


@pytest.mark.parametrize("impl", ["attention_varlen_tiled", "attention_varlen_scalar"])
def test_registered_attention_passes(impl):
    r = testing.check_attention(registered("attention", impl), cases=40, seed=3)
    assert r.compared >= 35 and r.values > 1000


def test_registered_cross_entropy_passes():
    r = testing.check_cross_entropy(registered("cross_entropy", "cross_entropy_f32"),
                                    cases=80, seed=4)
    assert r.compared > 40


def test_registered_linear_and_embedding_pass():
    testing.check_linear_cross_entropy(registered("linear_cross_entropy", "linear_ce_fused"),
                                       cases=40, seed=4)
    testing.check_embedding(registered("embedding", "reference"), cases=40, seed=4)


def test_a_leak_is_caught_and_written_out(tmp_path):
    def leaky(q, k, v, cu_seqlens, **kw):
        return packshard.attention(q, k, v, [0, q.shape[0]], scale=kw["scale"],
                                   grad_output=kw.get("grad_output"))

    out = tmp_path / "regression.json"
    with pytest.raises(AssertionError) as e:
        testing.check_attention(leaky, cases=40, seed=3, regression_out=str(out))
    text = str(e.value)
    assert "smallest" in text and "expected" in text and "allowed" in text
    case = json.loads(out.read_text())
    assert case["op"] == "attention"
    # The written case replays through eval, and the leak differs there.
    ref = packshard.eval(case)
    leak = packshard.attention(np.array(case["q"]), np.array(case["k"]), np.array(case["v"]),
                               [0, len(case["q"])], scale=case["scale"])
    assert not np.allclose(np.asarray(ref["output"]), leak["output"])


def test_f32_kernel_claimed_as_f64_fails():
    with pytest.raises(AssertionError):
        testing.check_attention(registered("attention", "attention_varlen_tiled"), cases=20,
                                seed=3, precision="f64")


def test_a_kernel_that_writes_into_its_inputs_is_caught():
    # O5: the cross-entropy is right, but its backward leaves the softmax in
    # the caller's logits (as an in-place backward does).
    ce = registered("cross_entropy", "cross_entropy_f32")

    def in_place(**kw):
        out = ce(**kw)
        kw["logits"][...] = 0.0
        return out
    with pytest.raises(AssertionError) as e:
        testing.check_cross_entropy(in_place, cases=20, seed=4)
    assert "wrote into its input 'logits'" in str(e.value)
    assert "O5" in str(e.value)
    # Negative control of the check itself: the same kernel writing into a
    # copy it made passes.
    def copying(**kw):
        out = ce(**kw)
        scratch = kw["logits"].copy()
        scratch[...] = 0.0
        return out
    r = testing.check_cross_entropy(copying, cases=20, seed=4)
    assert r.compared > 5
