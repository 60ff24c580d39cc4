"""flash-attention's options through the package (``window_size``, ``softcap``,
``alibi_slopes``, ``seqused_k``): ``packshard.attention`` against a dense
float64 numpy computation written here from flash-attention's documented
conventions (not calling packshard), forward and backward, on a grouped-query
cross case with bottom-right alignment; and the default check catching a
kernel that takes the options with ``**kwargs`` and ignores the window."""

import numpy as np
import pytest

import packshard
from packshard import testing

# Relative error allowed between two f64 computations of the same sums in
# different orders: 1e-12 (the decoder golden rule of docs/INTERFACE.md; the
# sums here have at most 9 terms, each error ~1e-16).
RTOL = 1e-12


def numpy_attention(q, k, v, cu_q, cu_k, go, scale, causal=False, window=(-1, -1),
                    softcap=0.0, slopes=None, used=None):
    """Dense per segment, float64: flash_attn_varlen_func's docstring rules.
    Query ``r`` of a segment of ``lq`` queries over ``lk`` keys (``lk`` =
    ``seqused_k[s]``) sees key ``c`` iff ``r + lk - lq - left <= c <= r + lk -
    lq + right`` (and ``c <= r + lk - lq`` when causal); the score is
    ``softcap * tanh(scale q.k / softcap) - slope |r + lk - lq - c|``."""
    n_q, h, d = q.shape
    group = h // k.shape[1]
    out, lse = np.zeros_like(q), np.full((h, n_q), -np.inf)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    for s in range(len(cu_q) - 1):
        q0, q1, k0 = cu_q[s], cu_q[s + 1], cu_k[s]
        lq = q1 - q0
        lk = cu_k[s + 1] - k0 if used is None else used[s]
        r = np.arange(lq)[:, None]
        c = np.arange(lk)[None, :]
        diag = r + lk - lq
        ok = np.ones((lq, lk), dtype=bool)
        if causal:
            ok &= c <= diag
        if window[0] >= 0:
            ok &= c >= diag - window[0]
        if window[1] >= 0:
            ok &= c <= diag + window[1]
        for a in range(h):
            kv = a // group
            qa, ka, va = q[q0:q1, a], k[k0:k0 + lk, kv], v[k0:k0 + lk, kv]
            raw = scale * qa @ ka.T
            t = np.tanh(raw / softcap) if softcap else None
            sc = softcap * t if softcap else raw
            chain = 1 - t * t if softcap else np.ones_like(raw)
            if slopes is not None:
                sc = sc - slopes[a] * np.abs(diag - c)
            sc = np.where(ok, sc, -np.inf)
            m = sc.max(axis=1, keepdims=True) if lk else np.full((lq, 1), -np.inf)
            m = np.where(np.isfinite(m), m, 0)
            e = np.exp(sc - m)
            tot = e.sum(axis=1, keepdims=True)
            p = np.where(tot > 0, e / np.where(tot > 0, tot, 1), 0)
            out[q0:q1, a] = p @ va
            lse[a, q0:q1] = np.where(tot[:, 0] > 0, m[:, 0] + np.log(np.where(tot[:, 0] > 0,
                                                                              tot[:, 0], 1)),
                                     -np.inf)
            g = go[q0:q1, a]
            dp = g @ va.T
            ds = p * (dp - (g * out[q0:q1, a]).sum(axis=1, keepdims=True)) * chain * scale
            dq[q0:q1, a] += ds @ ka
            dk[k0:k0 + lk, kv] += ds.T @ qa
            dv[k0:k0 + lk, kv] += p.T @ g
    return {"output": out, "lse": lse, "grad_q": dq, "grad_k": dk, "grad_v": dv}


def _case():
    """GQA (4 query heads over 2 key heads), cross segments of (l_q, l_k) =
    (3, 8), (5, 5), (4, 2), (0, 3): bottom-right alignment differs from
    top-left in three of them."""
    rng = np.random.default_rng(33)
    cu_q, cu_k = np.array([0, 3, 8, 12, 12]), np.array([0, 8, 13, 15, 18])
    q = rng.normal(size=(12, 4, 8))
    k = rng.normal(size=(18, 2, 8))
    v = rng.normal(size=(18, 2, 8))
    go = rng.normal(size=(12, 4, 8))
    return q, k, v, cu_q, cu_k, go


OPTIONS = {
    "window_size": ({"window_size": (2, 1)}, {"window": (2, 1)}),
    "window_size_causal": ({"window_size": (3, -1), "causal": True},
                           {"window": (3, -1), "causal": True}),
    "softcap": ({"softcap": 0.8}, {"softcap": 0.8}),
    "alibi_slopes": ({"alibi_slopes": np.array([0.5, 0.25, 0.125, -0.3])},
                     {"slopes": np.array([0.5, 0.25, 0.125, -0.3])}),
    "seqused_k": ({"seqused_k": np.array([5, 5, 0, 2])}, {"used": [5, 5, 0, 2]}),
    "all_four": ({"window_size": (1, 2), "causal": True, "softcap": 2.0,
                  "alibi_slopes": np.array([0.5, 0.25, 0.125, 0.0625]),
                  "seqused_k": np.array([6, 4, 2, 3])},
                 {"window": (1, 2), "causal": True, "softcap": 2.0,
                  "slopes": np.array([0.5, 0.25, 0.125, 0.0625]), "used": [6, 4, 2, 3]}),
}


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_each_option_matches_numpy(name):
    ours, theirs = OPTIONS[name]
    q, k, v, cu_q, cu_k, go = _case()
    scale = 1 / np.sqrt(q.shape[2])
    r = packshard.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, grad_output=go,
                            **ours)
    want = numpy_attention(q, k, v, cu_q, cu_k, go, scale, **theirs)
    # The option changes the result (the comparison would catch it ignored).
    plain = numpy_attention(q, k, v, cu_q, cu_k, go, scale,
                            causal=theirs.get("causal", False))
    assert not np.allclose(want["output"], plain["output"])
    for key, w in want.items():
        got = r[key]
        assert got.shape == w.shape, key
        fin = np.isfinite(w)
        assert np.array_equal(fin, np.isfinite(got)), key
        # RTOL (named above) relative to the largest finite value, at least 1: an
        # absolute floor for outputs below 1.
        tol = RTOL * max(1.0, np.abs(w[fin]).max(initial=0))
        assert np.abs(got[fin] - w[fin]).max(initial=0) <= tol, (key, np.abs(got - w).max())


def test_bad_options_are_typed_errors_naming_the_field():
    q, k, v, cu_q, cu_k, go = _case()
    cases = [({"window_size": (-2, 0)}, ("window_size", 0)),
             ({"window_size": (0, -3)}, ("window_size", 1)),
             ({"window_size": (1, 2, 3)}, ("window_size", None)),
             ({"softcap": -1.0}, ("softcap", None)),
             ({"alibi_slopes": [0.5, 0.25]}, ("alibi_slopes", None)),
             ({"alibi_slopes": [0.5, np.nan, 0.1, 0.2]}, ("alibi_slopes", 1)),
             ({"seqused_k": [9, 5, 2, 3]}, ("seqused_k", 0)),
             ({"seqused_k": [1, 2]}, ("seqused_k", None))]
    for opts, (field, index) in cases:
        with pytest.raises(packshard.PackshardError) as e:
            packshard.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **opts)
        got = (e.value.field, e.value.index)
        assert got == (field, index), (opts, got, e.value.message)


def test_a_kernel_without_an_option_refuses_it():
    q, k, v, cu_q, cu_k, go = _case()
    with pytest.raises(packshard.PackshardError) as e:
        packshard.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k,
                            window_size=(2, 0), impl="attention_dense_masked")
    assert e.value.field in ("window_size", "cu_seqlens_k"), e.value.message


def test_generated_cases_draw_every_option():
    cs = testing.cases("attention", 100, seed=0)
    for name in ("window_size", "softcap", "alibi_slopes", "seqused_k"):
        assert sum(name in c[0] for c in cs) >= 5, name


def _reference(**kw):
    return packshard.attention(**{k: v for k, v in kw.items()
                                  if k not in ("cu_seqlens", "max_seqlen_q", "max_seqlen_k")})


def test_the_reference_passes_and_a_kernel_ignoring_the_window_is_caught():
    # Negative control: the same call with the window passed passes (on the
    # first 30 cases, 4 of them with a window: 3.5 s, where the default 100
    # take 7 s on the 2-core machine).
    r = testing.check_attention(_reference, cases=30, precision="f64")
    assert r.compared >= 25 and not r.restricted, r.restricted

    def ignores_window(**kw):
        kw.pop("window_size", None)  # takes it (**kw) and drops it
        return _reference(**kw)

    with pytest.raises(AssertionError) as e:
        testing.check_attention(ignores_window, precision="f64")
    assert "window_size" in str(e.value)


def test_a_kernel_that_takes_no_option_gets_the_cases_without_it():
    def no_options(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale=None, grad_output=None,
                   want_grad=False):
        return packshard.attention(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                   causal=causal, scale=scale, grad_output=grad_output,
                                   want_grad=want_grad)

    r = testing.check_attention(no_options, cases=40, precision="f64")
    assert any(why.startswith("window_size") for why in r.restricted), r.restricted


def test_a_kernel_refusing_an_option_has_those_cases_left_out_and_counted():
    def refuses_window(**kw):
        if kw.get("window_size") is not None:
            # Every registered CPU kernel now takes the window, so the refusal
            # is the other documented form: NotImplementedError naming it.
            raise NotImplementedError("window_size: this kernel has no sliding window")
        return _reference(**kw)

    r = testing.check_attention(refuses_window, cases=30, precision="f64")
    assert r.restricted == {"window_size: refused by the kernel": 4}, r.restricted
    assert r.compared + r.skipped + 4 == 30 and not r.failures, (r.compared, r.skipped)

    # A refusal of something that is not an option is a failure.
    def refuses_causal(**kw):
        if kw.get("causal"):
            raise packshard.PackshardError("causal: not here")
        return _reference(**kw)

    with pytest.raises(AssertionError):
        testing.check_attention(refuses_causal, cases=30, precision="f64")


def test_a_failing_case_with_options_replays_through_eval(tmp_path):
    def ignores_softcap(**kw):
        kw.pop("softcap", None)
        return _reference(**kw)

    out = tmp_path / "case.json"
    r = testing.check_attention(ignores_softcap, cases=30, precision="f64",
                                raise_on_failure=False, regression_out=str(out))
    case = r.smallest().to_eval_case()
    assert "softcap" in case
    replay = packshard.eval(case)
    assert np.allclose(np.asarray(replay["output"], dtype=np.float64),
                       # The eval replay is the same f64 reference math (JSON round-
                       # trips f64 exactly): 1e-12 absolute on outputs of order 1 is a
                       # few thousand ulps of margin, chosen.
                       _reference(**r.smallest().args)["output"], rtol=0, atol=1e-12)
    # Options forced off are left out of the case, not written as null.
    off = testing.Failure("attention", dict(r.smallest().args, window_size=None, softcap=None),
                          "", 0, "", "").to_eval_case()
    assert "window_size" not in off and "softcap" not in off
