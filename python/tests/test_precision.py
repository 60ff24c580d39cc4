"""packshard.testing under bf16 and f16: kernels storing their tensors in a
narrow float are judged against the reference math run in f32 and stored in
that precision; an unknown precision is an error at once."""

import ml_dtypes
import numpy as np
import pytest

import packshard
from packshard import PackshardError, testing

BF16 = ml_dtypes.bfloat16

# flash_attn_varlen_func's options, which the kernels here pass on to the
# registered tiled kernel (a kernel that dropped them would fail the check).
OPTIONS = ("window_size", "softcap", "alibi_slopes", "seqused_k")


def options(kw):
    return {name: kw[name] for name in OPTIONS if name in kw}


def bf16_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=None, causal=False,
                   grad_output=None, want_grad=False, **kw):
    """A correct bf16 kernel: inputs cast to bf16, math in f32 (the registered
    f32 tiled kernel on float32 arrays), results stored in bf16."""
    x = [np.asarray(t, dtype=BF16).astype(np.float32) for t in (q, k, v)]
    go = None if grad_output is None else np.asarray(grad_output, dtype=BF16).astype(np.float32)
    r = packshard.attention(*x, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                            causal=causal, scale=scale, grad_output=go if want_grad else None,
                            impl="attention_varlen_tiled", **options(kw))
    return {key: val.astype(BF16) for key, val in r.items()}


def bf16_cross_entropy(logits, targets, **kw):
    kw = {k: v for k, v in kw.items() if k in (
        "ignore_index", "label_smoothing", "smoothing", "z_loss", "reduction", "vocab_size",
        "want_grad", "softcap", "grad_output")}
    z = np.asarray(logits, dtype=BF16).astype(np.float32)
    r = packshard.cross_entropy(z, targets, impl="cross_entropy_f32", **kw)
    out = {k: r[k] for k in ("per_token_loss", "logsumexp", "grad_logits") if k in r}
    out = {k: v.astype(BF16) for k, v in out.items()}
    out["loss"] = BF16(r["loss"])
    return out


def test_a_correct_bf16_attention_kernel_passes():
    r = testing.check_attention(bf16_attention, precision="bf16")
    assert r.compared >= 90 and r.values > 10_000
    assert 0 < r.worst <= 1
    # Negative control: the same kernel under the f32 rule fails (its bf16
    # results are up to 2^-8 off, bf16's unit roundoff, far beyond 32 x an
    # f32 baseline).
    with pytest.raises(AssertionError):
        testing.check_attention(bf16_attention, cases=30, precision="f32")


def test_a_correct_bf16_cross_entropy_kernel_passes():
    r = testing.check_cross_entropy(bf16_cross_entropy, precision="bf16")
    assert r.compared >= 50


def test_a_buggy_bf16_kernel_fails_under_bf16():
    def leaky(q, k, v, **kw):  # one segment over the pack: attends across documents
        kw.update(cu_seqlens_q=np.array([0, q.shape[0]]), cu_seqlens_k=np.array([0, k.shape[0]]))
        return bf16_attention(q, k, v, **kw)
    with pytest.raises(AssertionError) as e:
        testing.check_attention(leaky, precision="bf16")
    assert "precision bf16" in str(e.value)

    def ignore_counted(logits, targets, **kw):  # ignore_index counted in the mean
        out = bf16_cross_entropy(logits, targets, **kw)
        keep = np.asarray(targets) != kw["ignore_index"]
        if kw["reduction"] == "mean" and keep.any():
            out["loss"] = BF16(float(out["loss"]) * keep.sum() / len(keep))
            out.pop("grad_logits", None)
        return out
    with pytest.raises(AssertionError):
        testing.check_cross_entropy(ignore_counted, precision="bf16")


def test_f16_kernels_pass_and_bugs_fail():
    def f16_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, **kw):
        x = [np.asarray(t, dtype=np.float16) for t in (q, k, v)]
        go = kw.get("grad_output")
        r = packshard.attention(*x, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                causal=kw["causal"], scale=kw.get("scale"),
                                grad_output=None if go is None else go.astype(np.float16),
                                impl="attention_varlen_tiled", **options(kw))
        return {key: val.astype(np.float16) for key, val in r.items()}
    r = testing.check_attention(f16_attention, precision="f16")
    assert r.compared >= 90

    def f16_lse_log2(q, k, v, cu_seqlens_q, cu_seqlens_k, **kw):
        out = f16_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, **kw)
        out["lse"] = (out["lse"].astype(np.float32) / np.log(2)).astype(np.float16)
        return out
    with pytest.raises(AssertionError) as e:
        testing.check_attention(f16_lse_log2, precision="f16")
    assert "lse" in str(e.value)


def test_inputs_are_given_in_the_kernels_storage():
    seen = []

    def spy(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, **_):
        seen.append(q.copy())
        return packshard.attention(q, k, v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                                   causal=causal, scale=scale)
    testing.check_attention(spy, cases=5, precision="bf16", grad=False)
    for q in seen:  # every value exact in bf16, whatever rounding the kernel uses
        assert np.array_equal(q, q.astype(BF16).astype(np.float64))


@pytest.mark.parametrize("bad", ["bf61", "fp32", "float32", "", "BF16"])
def test_an_unknown_precision_is_an_error_at_once(bad):
    calls = []

    def kernel(**kw):
        calls.append(1)
    with pytest.raises(PackshardError) as e:
        testing.check_attention(kernel, precision=bad)
    assert e.value.field == "precision" and e.value.kind == "invalid_argument"
    for name in testing.PRECISIONS:
        assert f'"{name}"' in str(e.value)
    assert calls == []  # before any case ran
    with pytest.raises(PackshardError):
        testing.judge("attention", {}, {}, precision=bad)


def test_bf16_arrays_are_accepted_as_op_inputs():
    q = np.linspace(-1, 1, 24).reshape(4, 2, 3).astype(BF16)
    r = packshard.attention(q, q, q, [0, 4])
    ref = packshard.attention(q.astype(np.float32), q.astype(np.float32),
                              q.astype(np.float32), [0, 4])
    assert np.array_equal(r["output"], ref["output"])
