"""packshard.testing's loss cases: the default budget crosses vocabulary and
token chunks and passes a per-token grad_output to the kernel and to the
reference alike, so a kernel reading it as a scalar fails."""

import numpy as np
import pytest

import packshard
from packshard import testing


def registered(op, impl):
    fn = getattr(packshard, op)

    def kernel(**kw):
        return fn(**kw, impl=impl)
    return kernel


def first_only(kernel):
    """``kernel`` given ``grad_output[0]`` for every token (Liger-Kernel PR 1298)."""
    def wrapped(**kw):
        g = kw.get("grad_output")
        if g is not None and np.size(g) > 1:
            kw["grad_output"] = np.full_like(g, np.ravel(g)[0])
        return kernel(**kw)
    return wrapped


@pytest.mark.parametrize("op", ["cross_entropy", "linear_cross_entropy"])
def test_default_cases_cross_chunks_with_every_option(op):
    cs = testing.cases(op, 100, seed=0)
    assert max(c[0]["vocab_size"] for c in cs) >= 4097
    assert any("softcap" in c[0] for c in cs)
    per_token = [c for c in cs if c[0].get("reduction") == "none" and "grad_output" in c[0]
                 and len(c[0]["targets"]) > 1]
    assert per_token and all(np.size(c[0]["grad_output"]) == len(c[0]["targets"])
                             for c in per_token)
    assert all(c[0]["want_grad"] for c in cs if "grad_output" in c[0])
    # `large`: how many of the n cases are large (default 12 in 100).
    small = packshard._native.cases(op, 3, 0, 0)
    large = packshard._native.cases(op, 3, 0, 3)
    assert max(c[0]["vocab_size"] for c in small) <= 64
    assert sum(c[2] for c in large) > sum(c[2] for c in small)


@pytest.mark.parametrize("op,impl", [("cross_entropy", "cross_entropy_f32"),
                                     ("linear_cross_entropy", "linear_ce_fused")])
def test_per_token_grad_output_read_as_a_scalar_fails(op, impl):
    good = registered(op, impl)
    r = testing.fuzz(good, op, 100, 0)
    assert r.compared >= 80
    with pytest.raises(AssertionError, match="grad_"):
        testing.fuzz(first_only(good), op, 100, 0)
