"""packshard.testing.judge: a case you built yourself, held to the fuzz's rule."""

import ml_dtypes
import numpy as np
import pytest

import packshard
from packshard import PackshardError, testing


def built_case():
    """Segments of 70 and 5 tokens and an empty one (70 crosses 16-, 32- and
    64-key tiles), 2 heads of dim 3, no common pattern in the values."""
    i = np.arange(75 * 2 * 3).reshape(75, 2, 3)
    q = ((i * 37) % 23) / 7.0 - 1.5
    return {"q": q, "k": q[::-1].copy(), "v": np.cos(q), "cu_seqlens": np.array([0, 70, 70, 75]),
            "causal": True, "grad_output": np.sin(q)}


def test_the_references_own_outputs_pass_and_a_perturbed_one_fails():
    case = built_case()
    ref = packshard.attention(case["q"], case["k"], case["v"], case["cu_seqlens"], causal=True,
                              grad_output=case["grad_output"], impl="attention_varlen_tiled")
    r = testing.judge("attention", case, ref)
    assert r.passed, r
    assert sorted(r.tensors) == ["grad_k", "grad_q", "grad_v", "lse", "output"]
    assert 0 < r.worst <= 1
    for t in r.tensors.values():
        assert t.passed and t.error <= t.allowed and t.share <= 1
    # One value of grad_q off by 0.05: the rule allows ~7e-3 here (32 x an
    # f32 baseline error of ~1e-7, and a floor of 256 ulp of f32 of the
    # magnitude of the terms of grad_q's sums: ~215 for a 70-key segment).
    bad = dict(ref)
    bad["grad_q"] = ref["grad_q"].copy()
    bad["grad_q"][40, 1, 2] += 0.05
    r = testing.judge("attention", case, bad)
    assert not r.passed
    t = r.tensors["grad_q"]
    assert not t.passed and t.share > 1 and t.index == (40, 1, 2)
    assert t.actual == pytest.approx(ref["grad_q"][40, 1, 2] + 0.05, abs=1e-12)
    # ref is the f32 kernel's value, t.expected the f64 reference's: their gap is the
    # kernel's f32 error; 1e-5 is a margin chosen, not derived.
    assert t.expected == pytest.approx(ref["grad_q"][40, 1, 2], abs=1e-5)
    # The error is the planted 0.05 plus the kernel's f32 error (< 1e-5, ~2e-4 of 0.05):
    # rel 1e-3 holds it; allowed < 0.01 as the comment above derives (~7e-3).
    assert t.allowed < 0.01 and t.error == pytest.approx(0.05, rel=1e-3)
    assert all(r.tensors[k].passed for k in ("output", "lse", "grad_k", "grad_v"))
    assert "grad_q" in r.failures[0].detail and "[40, 1, 2]" in r.failures[0].detail


def test_a_loss_case_with_a_vocabulary_over_a_chunk():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(6, 1030)) * 3
    case = {"logits": logits, "targets": np.array([1029, 0, -100, 1024, 5, 1023]),
            "label_smoothing": 0.1, "want_grad": True, "reduction": "mean"}
    ref = packshard.cross_entropy(logits, case["targets"], label_smoothing=0.1, want_grad=True,
                                  impl="cross_entropy_f32")
    r = testing.judge("cross_entropy", case, ref)
    assert r.passed, r
    assert {"loss", "per_token_loss", "logsumexp", "grad_logits"} <= set(r.tensors)
    # The last partial chunk (columns 1024..1029) left out of the logsumexp.
    bad = dict(ref)
    z = logits[:, :1024]
    m = z.max(axis=1)
    bad["logsumexp"] = m + np.log(np.exp(z - m[:, None]).sum(axis=1))
    r = testing.judge("cross_entropy", case, bad)
    assert not r.passed and not r.tensors["logsumexp"].passed
    assert r.tensors["loss"].passed  # only what was given wrong fails


def test_bf16_inputs_and_outputs_are_judged_in_bf16():
    bf16 = ml_dtypes.bfloat16
    case = built_case()
    case = {k: (v.astype(bf16) if isinstance(v, np.ndarray) and v.dtype.kind == "f" else v)
            for k, v in case.items()}
    x = {k: case[k].astype(np.float32) for k in ("q", "k", "v", "grad_output")}
    ref = packshard.attention(x["q"], x["k"], x["v"], case["cu_seqlens"], causal=True,
                              grad_output=x["grad_output"])
    stored = {k: v.astype(bf16) for k, v in ref.items()}
    assert testing.judge("attention", case, stored, precision="bf16").passed
    assert not testing.judge("attention", case, stored, precision="f32").passed
    bad = dict(stored)
    bad["output"] = (ref["output"] * 1.1).astype(bf16)  # 10% off: 25 bf16 unit roundoffs
    r = testing.judge("attention", case, bad, precision="bf16")
    assert not r.passed and not r.tensors["output"].passed


def test_judge_reports_missing_and_malformed_outputs_and_refuses_bad_cases():
    case = built_case()
    ref = packshard.attention(case["q"], case["k"], case["v"], case["cu_seqlens"], causal=True)
    r = testing.judge("attention", case, {"lse": ref["lse"]})
    assert not r.passed and "no 'output'" in r.failures[0].detail
    r = testing.judge("attention", case, (ref["output"], ref["lse"]))
    assert not r.passed and "tuple" in r.failures[0].detail
    r = testing.judge("attention", case, {"output": ref["output"][:10]})
    assert not r.passed and "shape" in r.failures[0].detail
    bad = dict(case, cu_seqlens=np.array([0, 80]))  # past the tokens
    with pytest.raises(PackshardError) as e:
        testing.judge("attention", bad, ref)
    assert e.value.field == "cu_seqlens"
    with pytest.raises(PackshardError):
        testing.judge("bert", case, ref)


from hypothesis import given, settings, strategies as st  # noqa: E402


@st.composite
def attention_cases(draw):
    """Sizes first (segments around a 16-key tile, 1..3 heads, dims 1..9),
    then values (multiples of 1/8 in [-4, 4]: exact in every precision)."""
    lens = draw(st.lists(st.integers(0, 20), min_size=1, max_size=4))
    h, d = draw(st.integers(1, 3)), draw(st.integers(1, 9))
    n = sum(lens)
    vals = st.integers(-32, 32).map(lambda x: x / 8)
    arr = lambda: np.array(draw(st.lists(vals, min_size=n * h * d, max_size=n * h * d)),  # noqa: E731
                           dtype=np.float64).reshape(n, h, d)
    return {"q": arr(), "k": arr(), "v": arr(), "grad_output": arr(),
            "cu_seqlens": np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
            "causal": draw(st.booleans())}


@settings(max_examples=40, deadline=None)
@given(attention_cases(), st.sampled_from(["f32", "bf16", "f16"]))
def test_a_correct_kernel_passes_any_built_case_and_a_shifted_one_fails(case, precision):
    x = {k: testing._native.round_to(case[k], precision) for k in ("q", "k", "v", "grad_output")}
    ref = packshard.attention(x["q"], x["k"], x["v"], case["cu_seqlens"], causal=case["causal"],
                              grad_output=x["grad_output"])
    stored = {k: testing._native.round_to(v, precision) for k, v in ref.items()}
    r = testing.judge("attention", case, stored, precision=precision)
    assert r.passed, r
    if case["q"].size == 0:
        return
    # The output shifted by 0.5 (values at most 4: the rule allows at most
    # 8 x 2^-8 x 4 + 2 x 2^-8 x 4 = 0.16 under bf16, far less in f16 and f32).
    bad = dict(stored, output=stored["output"] + 0.5)
    assert not testing.judge("attention", case, bad, precision=precision).passed
