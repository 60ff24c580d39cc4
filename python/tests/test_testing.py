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
        return packshard.attention(q, k, v, [0, q.shape[0]], cu_seqlens_k=[0, k.shape[0]],
                                   scale=kw.get("scale"), causal=kw["causal"],
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
                               [0, len(case["q"])], cu_seqlens_k=[0, len(case["k"])],
                               scale=case.get("scale"), causal=case["causal"])
    assert not np.allclose(np.asarray(ref["output"]), leak["output"])


def test_fail_fast_stops_at_the_first_failing_case_of_the_same_run():
    def leaky(q, k, v, cu_seqlens, **kw):
        return packshard.attention(q, k, v, [0, q.shape[0]], cu_seqlens_k=[0, k.shape[0]],
                                   scale=kw.get("scale"), causal=kw["causal"],
                                   grad_output=kw.get("grad_output"))

    full = testing.check_attention(leaky, cases=40, seed=3, raise_on_failure=False)
    fast = testing.check_attention(leaky, cases=40, seed=3, raise_on_failure=False,
                                   fail_fast=True)
    # A leak fails every multi-segment case: several failures, of which the
    # fast run holds only the first, having run no case after it.
    assert len(full.failures) > 1 and len(fast.failures) == 1
    assert fast.failures[0].source == full.failures[0].source
    assert fast.cases < full.cases


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


def _numpy_attention(q, k, v, cu_q, cu_k, causal, scale):
    """Bottom-right causal grouped-query varlen attention in numpy, written
    from flash_attn_varlen_func's documentation (outside the project)."""
    n_q, h, d = q.shape
    group = h // k.shape[1]
    out = np.zeros_like(q)
    lse = np.full((h, n_q), -np.inf)
    for s in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        lq, lk = cu_q[s + 1] - cu_q[s], cu_k[s + 1] - cu_k[s]
        for a in range(h):
            kk, vv = k[ks, a // group], v[ks, a // group]
            scores = scale * q[qs, a] @ kk.T
            if causal:
                r = np.arange(lq)[:, None]
                c = np.arange(lk)[None, :]
                scores = np.where(c <= r + lk - lq, scores, -np.inf)
            for r in range(lq):
                row = scores[r]
                if not np.isfinite(row).any():
                    continue
                m = row.max()
                p = np.exp(row - m)
                out[cu_q[s] + r, a] = p @ vv / p.sum()
                lse[a, cu_q[s] + r] = m + np.log(p.sum())
    return out, lse


def test_eval_computes_bottom_right_gqa_cross_attention_as_numpy_does():
    rng = np.random.default_rng(0)
    cu_q, cu_k = [0, 3, 10, 10, 12], [0, 7, 9, 12, 12]
    q = rng.normal(size=(12, 4, 5))
    k = rng.normal(size=(12, 2, 5))
    v = rng.normal(size=(12, 2, 5))
    for causal in (False, True):
        want, want_lse = _numpy_attention(q, k, v, cu_q, cu_k, causal, 0.4)
        got = packshard.eval({"op": "attention", "q": q, "k": k, "v": v, "cu_seqlens_q": cu_q,
                              "cu_seqlens_k": cu_k, "causal": causal, "scale": 0.4})
        # f64 against f64 in another summation order: 1e-12 is ~5000 ulp.
        np.testing.assert_allclose(np.asarray(got["output"], dtype=float), want, atol=1e-12)
        got_lse = np.asarray(got["lse"], dtype=float)
        assert np.array_equal(np.isinf(got_lse), np.isinf(want_lse))
        np.testing.assert_allclose(got_lse[np.isfinite(got_lse)], want_lse[np.isfinite(want_lse)],
                                   atol=1e-12)
    # The a % h_kv mapping is not what eval computes.
    wrong = np.stack([k[:, a % 2] for a in range(4)], axis=1)
    wv = np.stack([v[:, a % 2] for a in range(4)], axis=1)
    bad, _ = _numpy_attention(q, wrong, wv, cu_q, cu_k, True, 0.4)
    assert not np.allclose(bad, np.asarray(got["output"], dtype=float))


def test_judged_answers_a_gqa_cross_case_instead_of_panicking():
    # Issue 30: a GQA case panicked inside AttentionTerms::of.
    rng = np.random.default_rng(1)
    args = {"q": rng.normal(size=(5, 4, 3)), "k": rng.normal(size=(6, 1, 3)),
            "v": rng.normal(size=(6, 1, 3)), "cu_seqlens_q": np.array([0, 2, 5]),
            "cu_seqlens_k": np.array([0, 4, 6]), "causal": True, "scale": 0.5,
            "grad_output": rng.normal(size=(5, 4, 3)), "want_grad": True}
    expected, baseline = testing.judged("attention", args)
    assert np.asarray(expected["grad_k"]).shape == (6, 1, 3)
    assert np.asarray(baseline["output"]).shape == (5, 4, 3)
    assert expected["terms"]["grad_k"] > 0


def test_check_attention_reaches_long_segments_and_gqa():
    seen = testing.cases("attention", 100, seed=0)
    longest = max(int(np.diff(c[0]["cu_seqlens_k"]).max(initial=0)) for c in seen)
    longest = max(longest, max(int(np.diff(c[0]["cu_seqlens_q"]).max(initial=0)) for c in seen))
    ratios = {c[0]["q"].shape[1] // c[0]["k"].shape[1] for c in seen}
    assert longest >= 1024 and {1, 2, 4, 8} <= ratios, (longest, ratios)
    assert any(c[0]["causal"] for c in seen)
    assert len(testing.cases("attention", 10, seed=0, large=10)) == 10


def test_a_self_attention_kernel_gets_self_attention_cases_and_says_so():
    ref = registered("attention", "attention_varlen_tiled")

    def self_only(q, k, v, cu_seqlens, causal, scale=None, grad_output=None, want_grad=True):
        return ref(q=q, k=k, v=v, cu_seqlens=cu_seqlens, causal=causal, scale=scale,
                   grad_output=grad_output, want_grad=want_grad)

    r = testing.check_attention(self_only, cases=30, seed=0)
    assert r.restricted.get("cross attention: fn takes no cu_seqlens_k", 0) > 0
    assert "left out (cross attention" in repr(r)


def test_a_modulo_kv_head_kernel_fails_the_default_check():
    ref = registered("attention", "reference")

    def modulo(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale=None, grad_output=None,
               want_grad=True):
        h, h_kv = q.shape[1], k.shape[1]
        kk = np.stack([k[:, a % h_kv] for a in range(h)], axis=1)
        vv = np.stack([v[:, a % h_kv] for a in range(h)], axis=1)
        r = ref(q=q, k=kk, v=vv, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                causal=causal, scale=scale)
        return {"output": r["output"]}

    with pytest.raises(AssertionError):
        testing.check_attention(modulo, precision="f64")


def test_the_default_check_asks_for_the_default_scale_and_the_forward_only_path():
    # Seed 0's 100 default cases: no scale in about one in four (25 +- 17,
    # four binomial standard deviations), forward-only (no grad_output) in
    # about one small case in eight plus 3 of the 12 large ones, and head
    # dims 160, 192 and 256 among the large ones.
    cs = testing.cases("attention", 100, 0)
    no_scale = sum("scale" not in a for a, *_ in cs)
    forward = [(a, i) for a, _, _, i in cs if not a["want_grad"]]
    assert 8 <= no_scale <= 42, no_scale
    assert all("grad_output" not in a for a, _ in forward)
    assert sum(i >= 88 for _, i in forward) == 3, [i for _, i in forward]
    assert {160, 192, 256} <= {a["q"].shape[2] for a, *_ in cs[88:]}
    # A kernel whose scale has no default is given 1/sqrt(d) instead.
    given = []

    def required(q, k, v, cu_seqlens, scale, **kw):
        given.append((scale, q.shape[2]))
        return packshard.attention(q, k, v, cu_seqlens, scale=scale, causal=kw["causal"],
                                   cu_seqlens_k=kw["cu_seqlens_k"])
    testing.check_attention(required, cases=30, seed=0, grad=False, gqa=False,
                            fix=testing.WITHOUT_ATTENTION_OPTIONS)
    assert any(s == 1 / np.sqrt(d) for s, d in given)
