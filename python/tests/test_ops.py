"""The Python package against the eval contract: same numbers, same errors."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import packshard
from packshard import PackshardError

RNG = np.random.default_rng(7)


def qkv(n=13, h=3, d=5):
    return [RNG.standard_normal((n, h, d)) for _ in range(4)]


def test_attention_matches_eval_for_every_impl():
    q, k, v, go = qkv()
    cu = [0, 4, 4, 13]
    for row in packshard.implementations("attention"):
        r = packshard.attention(q, k, v, cu, grad_output=go, impl=row["name"])
        e = packshard.eval({"op": "attention", "q": q, "k": k, "v": v, "cu_seqlens": cu,
                            "want_grad": True, "grad_output": go, "impl": row["name"]})
        want = np.float64 if row["precision"] == "f64" else np.float32
        for key in ("output", "lse", "grad_q", "grad_k", "grad_v"):
            assert r[key].dtype == want, (row["name"], key, r[key].dtype)
            # JSON text carries the inputs (serde_json parses decimal text to
            # within an ulp, not always exactly): agreement to 1e-12, not bits.
            np.testing.assert_allclose(r[key], np.asarray(e[key]), rtol=1e-10, atol=1e-12,
                                       err_msg=key)


def test_f32_kernel_reads_float32_in_place_and_answers_in_float32():
    """attention_varlen_tiled on float32 arrays (the in-place path) gives the
    bits the float64 path gives on the same values, as float32; dtype=float64
    widens them; every other layout and the errors are the float64 path's."""
    q, k, v, go = (x.astype(np.float32) for x in qkv(n=40, h=4, d=16))
    cu = [0, 7, 7, 40]
    tiled = "attention_varlen_tiled"
    for causal in (False, True):
        r32 = packshard.attention(q, k, v, cu, causal=causal, grad_output=go, impl=tiled)
        r64 = packshard.attention(*(x.astype(np.float64) for x in (q, k, v)), cu, causal=causal,
                                  grad_output=go.astype(np.float64), impl=tiled)
        wide = packshard.attention(q, k, v, cu, causal=causal, grad_output=go, impl=tiled,
                                   dtype=np.float64)
        fortran = packshard.attention(*(np.asfortranarray(x) for x in (q, k, v)), cu,
                                      causal=causal, grad_output=go, impl=tiled)
        for key in ("output", "lse", "grad_q", "grad_k", "grad_v"):
            assert r32[key].dtype == r64[key].dtype == np.float32, key
            assert wide[key].dtype == np.float64, key
            np.testing.assert_array_equal(r32[key], r64[key], err_msg=key)
            np.testing.assert_array_equal(wide[key], r32[key].astype(np.float64), err_msg=key)
            np.testing.assert_array_equal(fortran[key], r32[key], err_msg=key)
    # The reference answers in float64 whatever the input dtype.
    assert packshard.attention(q, k, v, cu)["output"].dtype == np.float64
    q[3, 1, 2] = np.inf
    with pytest.raises(PackshardError) as e:
        packshard.attention(q, k, v, cu, impl=tiled)
    assert (e.value.kind, e.value.field, e.value.index) == ("non_finite_input", "q", 3 * 64 + 16 + 2)
    with pytest.raises(PackshardError) as e:
        packshard.attention(k, k, v, [0, 5, 40], impl=tiled, dtype=np.int32)
    assert (e.value.kind, e.value.field) == ("invalid_argument", "dtype")


def test_attention_reads_strided_input_and_keeps_segments_apart():
    q, k, v, _ = qkv(n=10)
    r = packshard.attention(q, k, v, [0, 3, 10])
    # Fortran-ordered copies: same numbers (read through their strides).
    r2 = packshard.attention(np.asfortranarray(q), np.asfortranarray(k), np.asfortranarray(v),
                             np.array([0, 3, 10]))
    np.testing.assert_array_equal(r["output"], r2["output"])
    # Changing the second segment's keys leaves the first's outputs alone.
    k2 = k.copy()
    k2[5] += 1.0
    r3 = packshard.attention(q, k2, v, [0, 3, 10])
    np.testing.assert_array_equal(r["output"][:3], r3["output"][:3])
    assert not np.array_equal(r["output"][3:], r3["output"][3:])


def test_errors_carry_kind_field_and_index():
    q, k, v, _ = qkv(n=6)
    with pytest.raises(PackshardError) as e:
        packshard.attention(q, k, v, [0, 4, 3, 6])
    assert e.value.kind == "invalid_argument"
    assert e.value.field == "cu_seqlens"
    assert e.value.index is not None
    q[2, 0, 1] = np.nan
    with pytest.raises(PackshardError) as e:
        packshard.attention(q, k, v, [0, 6])
    assert (e.value.kind, e.value.field) == ("non_finite_input", "q")
    with pytest.raises(PackshardError) as e:
        packshard.attention(k, k, v, [0, 6], impl="no_such_kernel")
    assert (e.value.kind, e.value.field) == ("invalid_argument", "impl")
    with pytest.raises(PackshardError) as e:
        packshard.cross_entropy(np.zeros((2, 5)), [1, 9])
    assert (e.value.kind, e.value.field, e.value.index) == ("index_out_of_range", "targets", 1)
    assert isinstance(e.value, ValueError)


def test_cross_entropy_matches_eval_sharded_and_not():
    logits = RNG.standard_normal((6, 11))
    logits[1, 3] = -np.inf
    targets = [1, 0, -100, 10, 4, 2]
    for kw in ({}, {"num_shards": 3, "algorithm": "alg1"}, {"num_shards": 4, "layout": "padded", "vocab_size": 11},
               {"label_smoothing": 0.1, "z_loss": 1e-3, "reduction": "sum"},
               {"vocab_size": 9}):
        targets_kw = [t if t < kw.get("vocab_size", 11) else 0 for t in targets]
        width = logits.shape[1]
        if kw.get("layout") == "padded":
            width = 12  # 4 shards of 3: one padding column, NaN (never read)
        z = np.full((6, width), np.nan)
        z[:, :11] = logits
        if "layout" not in kw:
            z = logits
        r = packshard.cross_entropy(z, targets_kw, want_grad=True, **kw)
        case = {"op": "cross_entropy", "logits": z, "targets": targets_kw, "want_grad": True, **kw}
        e = packshard.eval(json.loads(json.dumps(case, default=_num)))
        # Non-finite numbers come back from JSON as "inf" / "-inf" / "nan".
        e = {k: np.asarray(x, dtype=float) if k in ("loss", "per_token_loss", "grad_logits")
             else x for k, x in e.items()}
        if np.isfinite(e["loss"]):
            assert abs(r["loss"] - e["loss"]) <= 1e-12 * max(1.0, abs(e["loss"]))
        else:
            assert r["loss"] == e["loss"]
        np.testing.assert_allclose(r["grad_logits"], np.asarray(e["grad_logits"], dtype=float),
                                   rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(r["per_token_loss"], np.asarray(e["per_token_loss"]),
                                   # As for grad_logits: the same f64 reference through
                                   # eval and through Python; 1e-10 relative / 1e-12
                                   # absolute, a margin chosen over a few ulps.
                                   rtol=1e-10, atol=1e-12)


def test_softcap_is_the_capped_logits_cross_entropy():
    """``softcap`` c: the loss of ``c * tanh(z / c)`` (numpy here), its gradient
    through the cap, sharded too; a bad c is refused naming ``softcap``."""
    z = 20.0 * RNG.standard_normal((5, 7))
    t = [0, 6, 3, -100, 2]
    c = 3.0
    capped = c * np.tanh(z / c)
    lse = np.log(np.exp(capped - capped.max(1, keepdims=True)).sum(1)) + capped.max(1)
    keep = [i for i in range(5) if t[i] != -100]
    want = np.mean([lse[i] - capped[i, t[i]] for i in keep])
    for kw in ({}, {"num_shards": 3, "algorithm": "alg2"}, {"num_shards": 2, "algorithm": "naive"}):
        r = packshard.cross_entropy(z, t, softcap=c, want_grad=True, **kw)
        # numpy's closed form against the reference in f64: sums in another order, a few
        # ulps; 1e-12 relative is a margin chosen, not derived.
        assert abs(r["loss"] - want) <= 1e-12 * abs(want)
        soft = np.exp(capped - lse[:, None])
        for i in keep:
            soft[i, t[i]] -= 1.0
        soft[3] = 0.0
        want_g = soft * (1.0 - np.tanh(z / c) ** 2) / len(keep)
        # As the loss above: f64 in another order; 1e-9 relative / 1e-14 absolute (for
        # the zero entries' rounding), a margin chosen, not derived.
        np.testing.assert_allclose(r["grad_logits"], want_g, rtol=1e-9, atol=1e-14)
    plain = packshard.cross_entropy(z, t)["loss"]
    assert abs(plain - want) > 1.0, "the cap changes the loss of logits this large"
    for bad in (0.0, -1.0, float("inf")):
        with pytest.raises(PackshardError) as e:
            packshard.cross_entropy(z, t, softcap=bad)
        assert e.value.field == "softcap", e.value.message


def _num(x):
    if isinstance(x, np.ndarray):
        return [_num(v) for v in x] if x.ndim else _num(float(x))
    if isinstance(x, float) and not np.isfinite(x):
        return "nan" if np.isnan(x) else ("inf" if x > 0 else "-inf")
    return float(x)


def test_linear_cross_entropy_and_embedding():
    hidden, weight = RNG.standard_normal((5, 4)), RNG.standard_normal((7, 4))
    t = [0, 6, 3, -100, 2]
    ref = packshard.linear_cross_entropy(hidden, weight, t, want_grad=True)
    fused = packshard.linear_cross_entropy(hidden, weight, t, want_grad=True,
                                           impl="linear_ce_fused", num_shards=2)
    # linear_ce_fused works in f32: 1e-5 relative is ~170 unit roundoffs of f32 (2^-24),
    # as in oracle/tests/vocab_kernels.rs.
    assert abs(ref["loss"] - fused["loss"]) < 1e-5 * abs(ref["loss"])
    assert ref["grad_weight"].shape == (7, 4)
    e = packshard.embedding([1, 1, 6], weight, grad_output=np.ones((3, 4)), num_shards=3)
    np.testing.assert_array_equal(e["output"], weight[[1, 1, 6]])
    np.testing.assert_array_equal(e["grad_weight"][1], 2 * np.ones(4))
    with pytest.raises(PackshardError) as err:
        packshard.embedding([7], weight)
    assert err.value.kind == "index_out_of_range"


def test_pack_and_batch():
    r = packshard.pack([5, 3, 8, 0, 2], 8, algorithm="ffd")
    assert r["num_packs"] == 3 and r["empty_sequence_indices"] == [3]
    h = packshard.pack(histogram={3: 4, 5: 2}, max_seq_len=8, algorithm="lpfhp")
    assert h["num_sequences"] == 6
    b = packshard.batch([[1, 2, 3], [4, 5], [6]], 4, algorithm="ffd")
    assert b["input_ids"].shape == (b["num_packs"], 4)
    for row, pos, seq in zip(b["input_ids"], b["position_ids"], b["sequence_ids"]):
        for s in set(seq) - {0}:
            assert list(pos[seq == s]) == list(range((seq == s).sum()))
    with pytest.raises(PackshardError) as e:
        packshard.pack([9], 8)
    assert e.value.kind == "sequence_too_long"


def test_registry_is_listed():
    names = {(r["op"], r["name"]) for r in packshard.implementations()}
    assert ("attention", "attention_varlen_tiled") in names
    assert ("cross_entropy", "reference") in names


def test_a_per_token_grad_output_scales_each_row():
    """docs/FAULTS.md O2: under ``reduction="none"`` token i's gradient is its
    own loss's times ``grad_output[i]`` (a 0 gives 0), in every form and
    impl; a scalar under sum and mean; bad ones refused naming it."""
    z = RNG.standard_normal((4, 9))
    t = [1, 8, -100, 4]
    g = np.array([1.0, 0.0, 3.0, -0.5])
    plain = packshard.cross_entropy(z, t, reduction="none", want_grad=True)["grad_logits"]
    for kw in ({}, {"num_shards": 3, "algorithm": "alg1"}, {"impl": "cross_entropy_f32"}):
        r = packshard.cross_entropy(z, t, reduction="none", want_grad=True, grad_output=g, **kw)
        # cross_entropy_f32 is among the kw: 1e-6 relative is ~17 unit roundoffs of f32
        # (one softmax entry each); the f64 ones are far inside.
        np.testing.assert_allclose(r["grad_logits"], plain * g[:, None], rtol=1e-6, atol=1e-12)
        assert not r["grad_logits"][1].any()
    s = packshard.cross_entropy(z, t, reduction="sum", want_grad=True, grad_output=[-2.0])
    # f64 reference scaled by -2 (exact in binary): 1e-12 relative / 1e-15 absolute
    # leaves room for a rounding in another order only.
    np.testing.assert_allclose(s["grad_logits"], -2.0 * plain, rtol=1e-12, atol=1e-15)
    w = RNG.standard_normal((9, 3))
    x = RNG.standard_normal((4, 3))
    for impl in ("reference", "linear_ce_fused"):
        r = packshard.linear_cross_entropy(x, w, t, reduction="none", want_grad=True,
                                           grad_output=g, impl=impl)
        assert not r["grad_hidden"][1].any(), impl
    for bad, kind in (([1.0, 0.0], "shape_mismatch"), ([1.0, 0.0, float("nan"), 1.0],
                                                       "non_finite_input")):
        with pytest.raises(PackshardError) as e:
            packshard.cross_entropy(z, t, reduction="none", want_grad=True, grad_output=bad)
        assert e.value.kind == kind and "grad_output" in e.value.message, e.value
    with pytest.raises(PackshardError) as e:
        packshard.cross_entropy(z, t, reduction="none", grad_output=g)
    assert e.value.field == "grad_output", e.value.message


def test_a_kept_bytes_value_that_is_not_a_byte_count_stops_the_import():
    """PACKSHARD_KEPT_BYTES (the extension's kept freed blocks) takes what
    PACKSHARD_MEMORY_BUDGET takes; anything else is refused at import, naming
    the variable, not silently ignored."""

    def run(value):
        env = dict(os.environ, PACKSHARD_KEPT_BYTES=value)
        return subprocess.run([sys.executable, "-c", "import packshard"], env=env,
                              capture_output=True, text=True, timeout=120)

    bad = run("1.5GiB")
    assert bad.returncode != 0
    assert "PACKSHARD_KEPT_BYTES" in bad.stderr
    assert run("256MiB").returncode == 0
