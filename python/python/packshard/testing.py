"""packshard.testing: hold your kernel to the rule the Rust suites hold ours to.

``fuzz(fn, op, cases=N, seed=S)`` draws the cases the Rust fuzz targets draw
(``packshard_equivalence::fuzz``, generated natively: sizes that are not powers
of two, empty segments, planted outliers, ignored and out-of-range targets,
``-inf`` logits, uneven and padded vocabularies with NaN padding), calls
``fn(**args)`` with numpy arrays named as in docs/INTERFACE.md, and compares
what it returns with the f64 reference run on the same inputs (rounded to the
kernel's precision). An f32 kernel may be off by at most 32 x the error of the
reference math run in f32 (the baseline) plus 256 ulp of f32 of the tensor's
scale (``RelativeRule::F32_FUZZ``); an f64 kernel is held to 64 ulp
(``Tolerance::F64_REWRITE``). On failure it raises ``AssertionError`` naming
the smallest failing case, the tensor, the index, both values and the
tolerance, and can write that case out as a ``packshard eval`` JSON case.

``fn`` returns a dict of numpy arrays keyed as the op's result (``output``,
``lse``, ``grad_q``, ... / ``loss``, ``per_token_loss``, ``grad_logits``, ...):
every key it returns that the reference has is compared; the op's primary
result (``output`` or ``loss``) is required. A single array or number is taken
as the primary result.
"""

import json
import os

import numpy as np

from . import PackshardError, _native

__all__ = [
    "Report",
    "Failure",
    "cases",
    "judged",
    "fuzz",
    "check_attention",
    "check_cross_entropy",
    "check_linear_cross_entropy",
    "check_embedding",
    "check_batch",
]

PRIMARY = {
    "attention": "output",
    "cross_entropy": "loss",
    "linear_cross_entropy": "loss",
    "embedding": "output",
}

# Keys of a generated case that are not the op's arguments for the judge.
_GRAD_KEYS = {"attention": "grad_output", "embedding": "grad_output"}


def cases(op, n, seed=0, large=None):
    """``n`` generated cases of ``op``: a list of ``(args, describe, size, input)``.
    Attention cases follow the default checks' schedule, the last ``large``
    large (default: 12 in 100)."""
    return _native.cases(op, int(n), int(seed), None if large is None else int(large))


def judged(op, args, precision="f32"):
    """``(expected, baseline)`` for one case: the f64 reference's result (a dict)
    on the inputs rounded to ``precision``, and the same math run in f32 (None
    for ``precision="f64"``, and for ``embedding``, which is exact)."""
    a = dict(args)
    if op == "attention":
        go = a.get("grad_output") if a.get("want_grad", a.get("grad_output") is not None) else None
        cu_q = a["cu_seqlens_q"] if "cu_seqlens_q" in a else a["cu_seqlens"]
        cu_k = a.get("cu_seqlens_k")
        return _native.attention_judged(
            _f(a["q"]), _f(a["k"]), _f(a["v"]), np.asarray(cu_q, dtype=np.int64),
            bool(a.get("causal", False)), a.get("scale"),
            None if go is None else _f(go), precision,
            None if cu_k is None else np.asarray(cu_k, dtype=np.int64))
    if op in ("cross_entropy", "linear_cross_entropy"):
        lin = op == "linear_cross_entropy"
        return _native.loss_judged(
            None if lin else _f(a["logits"]), _f(a["hidden"]) if lin else None,
            _f(a["weight"]) if lin else None, np.asarray(a["targets"], dtype=np.int64),
            {k: a.get(k) for k in ("ignore_index", "label_smoothing", "smoothing", "z_loss",
                                   "reduction", "vocab_size", "softcap")},
            bool(a.get("want_grad", False)), precision)
    if op == "embedding":
        from . import embedding
        want = a.get("want_grad", a.get("grad_output") is not None)
        r = embedding(a["ids"], a["weight"], vocab_size=a.get("vocab_size"),
                      grad_output=a.get("grad_output") if want else None)
        return r, None
    raise PackshardError(f"op: no judge for {op!r}")


def _f(x):
    return np.asarray(x, dtype=np.float64)


def _json_value(x):
    if isinstance(x, np.ndarray):
        if x.dtype.kind == "f":
            return _json_value(x.tolist())
        return x.tolist()
    if isinstance(x, list):
        return [_json_value(v) for v in x]
    if isinstance(x, (float, np.floating)):
        x = float(x)
        if np.isnan(x):
            return "nan"
        if np.isinf(x):
            return "inf" if x > 0 else "-inf"
        return x
    if isinstance(x, np.integer):
        return int(x)
    return x


class Failure:
    """One failing case: the op, its arguments, its description and what failed."""

    def __init__(self, op, args, describe, size, source, detail):
        self.op, self.args, self.describe, self.size = op, args, describe, size
        self.source, self.detail = source, detail

    def to_eval_case(self):
        """The case in the ``packshard eval`` format (a dict), for a regression file."""
        case = {"op": self.op}
        for k, v in self.args.items():
            if k == "grad_output" and not self.args.get("want_grad", True):
                continue
            # eval takes one form of the offsets, and no max_seqlen_*.
            if self.op == "attention" and (k.startswith("max_seqlen") or (
                    k == "cu_seqlens" and "cu_seqlens_q" in self.args)):
                continue
            case[k] = _json_value(v)
        return case

    def write(self, path):
        """Writes :meth:`to_eval_case` as JSON to ``path`` (``packshard eval PATH`` replays it)."""
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.to_eval_case(), f)
            f.write("\n")

    def __str__(self):
        return f"case: {self.describe} ({self.source})\n  {self.detail}"


class Report:
    """What a run saw: ``cases`` run, ``compared`` (cases with results compared),
    ``skipped`` (the reference refused the input: bad input on purpose),
    ``values`` compared, ``worst`` (largest share of the tolerance used, as the
    ratio error / baseline error), and ``failures``."""

    def __init__(self, op, name):
        self.op, self.name = op, name
        self.cases = self.compared = self.skipped = self.values = 0
        self.worst = 0.0
        self.failures = []
        # Cases left out because the kernel cannot take them, by reason.
        self.restricted = {}

    def smallest(self):
        """The smallest failing case (fewest tensor elements), or None."""
        return min(self.failures, key=lambda f: f.size) if self.failures else None

    def __repr__(self):
        left_out = "".join(f", {n} left out ({why})" for why, n in self.restricted.items())
        return (f"Report({self.op}: {self.cases} cases, {self.compared} compared, "
                f"{self.skipped} skipped as bad input{left_out}, {len(self.failures)} failed)")


def _as_result(out, op):
    if isinstance(out, dict):
        return out
    return {PRIMARY[op]: out}


def _run_one(fn, op, args, describe, size, source, precision, report):
    try:
        expected, baseline = judged(op, args, precision)
    except PackshardError:
        report.skipped += 1
        return None
    report.cases += 1
    # The kernel gets copies: `args` stays as generated (the regression case
    # is written from it), and the copies show whether the kernel wrote into
    # its inputs.
    call = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in args.items()}
    try:
        got = _as_result(fn(**call), op)
    except Exception as e:  # the kernel under test raised on valid input
        return Failure(op, args, describe, size, source,
                       f"raised {type(e).__name__}: {e} on input the reference accepts")
    # O5: a backward that writes gradients into its inputs (the logits, the
    # hidden states) corrupts tensors its caller saved for later.
    for key, original in args.items():
        if isinstance(original, np.ndarray) and not np.array_equal(
                call[key], original, equal_nan=original.dtype.kind == "f"):
            changed = int(np.sum(call[key] != original))
            return Failure(op, args, describe, size, source,
                           f"wrote into its input {key!r} ({changed} of {original.size} values "
                           f"changed; O5: inputs must be left intact)")
    primary = PRIMARY[op]
    if primary not in got:
        return Failure(op, args, describe, size, source,
                       f"returned no {primary!r} (keys: {sorted(got)})")
    report.compared += 1
    terms = expected.get("terms") or {}
    for key, exp in expected.items():
        if key not in got or not isinstance(exp, (np.ndarray, float)):
            continue
        exp = np.asarray(exp, dtype=np.float64)
        act = np.asarray(got[key], dtype=np.float64)
        base = None
        if baseline is not None and key in baseline:
            base = np.asarray(baseline[key], dtype=np.float64)
        prec = precision if (base is not None or precision == "f64") else "f64"
        if op == "embedding":
            prec = "f64"  # a lookup is exact in any precision
        failure, error, berr = _native.judge_tensor(key, exp, base, act, prec, terms.get(key))
        report.values += exp.size
        if failure is not None:
            return Failure(op, args, describe, size, source, failure)
        if error > 0:
            report.worst = max(report.worst, error / berr if berr > 0 else float("inf"))
    return None


def fuzz(fn, op, cases=100, seed=0, *, precision="f32", grad=True, fix=None,
         regression_out=None, raise_on_failure=True, only=None):
    """Runs ``fn`` on ``cases`` generated cases of ``op`` from ``seed``.

    ``op``: ``attention``, ``cross_entropy``, ``linear_cross_entropy``,
    ``embedding``. ``precision``: ``"f32"`` (default) or ``"f64"``, what the
    kernel computes in. ``grad``: pass ``grad_output`` / ``want_grad=True``
    (False: forward only). ``fix``: options to force on every case (e.g.
    ``{"causal": True}`` or ``{"z_loss": 0.0}`` for a kernel without z-loss).
    ``regression_out``: where to write the smallest failing case as a
    ``packshard eval`` JSON case. ``only(args)``: None to run a case, or the
    reason it is left out (counted in ``Report.restricted``, never silently).
    Returns a :class:`Report`; raises
    ``AssertionError`` (with the smallest failing case) when any case fails.
    """
    name = getattr(fn, "__name__", repr(fn))
    report = Report(op, name)
    for args, describe, size, i in _native.cases(op, int(cases), int(seed)):
        if not grad:
            args.pop("grad_output", None)
            args["want_grad"] = False
        if fix:
            args.update(fix)
        why = only(args) if only is not None else None
        if why is not None:
            report.restricted[why] = report.restricted.get(why, 0) + 1
            continue
        source = (f"budgeted input {i} of seed {seed}" if op == "attention"
                  else f"random input {i} of seed {seed}")
        f = _run_one(fn, op, args, describe, size, source, precision, report)
        if f is not None:
            report.failures.append(f)
    if report.cases == 0:
        raise AssertionError(f"packshard.testing: no case of {op} ran (all {report.skipped} skipped, "
                             f"left out: {report.restricted})")
    worst = report.smallest()
    if worst is not None:
        if regression_out:
            worst.write(regression_out)
        if raise_on_failure:
            text = (f"packshard.testing: {name} fails {op} on {len(report.failures)} of "
                    f"{report.cases} cases (seed {seed}, precision {precision}); the smallest:\n"
                    f"  {worst}")
            if regression_out:
                text += f"\n  regression case written to {regression_out}"
            raise AssertionError(text)
    return report


# The keyword arguments of a generated attention case (flash_attn_varlen_func's
# names; ``cu_seqlens`` is ``cu_seqlens_q``, the self-attention form).
_ATTENTION_ARGS = ("q", "k", "v", "cu_seqlens", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                   "max_seqlen_k", "causal", "scale", "grad_output", "want_grad")


def _accepted(fn, names):
    """The names of ``names`` that ``fn`` takes as keywords (all of them if it
    takes ``**kwargs`` or its signature cannot be read)."""
    import inspect
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return set(names)
    if any(p.kind == p.VAR_KEYWORD for p in params):
        return set(names)
    return {p.name for p in params
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} & set(names)


def check_attention(fn, cases=100, seed=0, *, causal=None, gqa=True, **kw):
    """:func:`fuzz` for varlen attention in flash_attn_varlen_func's form.

    ``fn`` gets, of ``q`` ``[n_q, h, d]``, ``k, v`` ``[n_k, h_kv, d]`` (query
    head ``a`` reads key head ``a // (h // h_kv)``), ``cu_seqlens_q``,
    ``cu_seqlens_k`` (``[b + 1]`` int64), ``cu_seqlens`` (= ``cu_seqlens_q``),
    ``max_seqlen_q``, ``max_seqlen_k``, ``causal`` (bottom-right aligned when
    ``l_q != l_k``), ``scale``, ``grad_output`` ``[n_q, h, d]`` and
    ``want_grad``, only those it accepts (all with ``**kwargs``), and returns
    ``output`` ``[n_q, h, d]`` and optionally ``lse`` ``[h, n_q]``,
    ``grad_q``, ``grad_k``, ``grad_v`` (``[n_k, h_kv, d]``).

    The cases follow the default schedule (small cases, then 12 in 100 large:
    a segment of 1,023 to 1,100 tokens, head dims to 256, every ratio
    ``h / h_kv``, cross segments, causal). A ``fn`` that takes neither
    ``cu_seqlens_k`` nor ``**kwargs`` gets self-attention cases only; one
    without ``causal`` only bidirectional ones; ``gqa=False`` leaves out the
    cases with ``h_kv < h``. ``causal=True`` or ``False`` forces the mask on
    every case. What is left out is counted in ``Report.restricted``.
    """
    fix = dict(kw.pop("fix", None) or {})
    if causal is not None:
        fix.setdefault("causal", bool(causal))
    takes = _accepted(fn, _ATTENTION_ARGS)

    def only(args):
        if "cu_seqlens_k" not in takes and not np.array_equal(
                np.asarray(args["cu_seqlens_q"]), np.asarray(args["cu_seqlens_k"])):
            return "cross attention: fn takes no cu_seqlens_k"
        if "causal" not in takes and args.get("causal"):
            return "causal: fn takes no causal"
        if not gqa and args["k"].shape[1] != args["q"].shape[1]:
            return "grouped-query: gqa=False"
        return None

    def call(**args):
        return fn(**{k: v for k, v in args.items() if k in takes})

    call.__name__ = getattr(fn, "__name__", repr(fn))
    return fuzz(call, "attention", cases, seed, fix=fix, only=only, **kw)


def check_cross_entropy(fn, cases=100, seed=0, **kw):
    """:func:`fuzz` for cross-entropy: ``fn(logits, targets, ignore_index,
    label_smoothing, smoothing, z_loss, reduction, vocab_size, num_shards, layout,
    want_grad)`` (``logits``: ``[n, w]``, columns ``vocab_size..`` padding)
    returns ``loss`` and optionally ``per_token_loss`` ``[n]``, ``logsumexp``
    ``[n]``, ``grad_logits`` ``[n, w]`` (padding columns 0)."""
    return fuzz(fn, "cross_entropy", cases, seed, **kw)


def check_linear_cross_entropy(fn, cases=100, seed=0, **kw):
    """:func:`fuzz` for the output layer: ``fn(hidden, weight, targets, ...)``
    returns ``loss`` and optionally ``grad_hidden`` ``[n, h]``, ``grad_weight``
    ``[w, h]``, ``per_token_loss``, ``logsumexp``."""
    return fuzz(fn, "linear_cross_entropy", cases, seed, **kw)


def check_embedding(fn, cases=100, seed=0, **kw):
    """:func:`fuzz` for the embedding: ``fn(ids, weight, vocab_size, num_shards,
    layout, grad_output, want_grad)`` returns ``output`` ``[n, h]`` and
    optionally ``grad_weight`` ``[w, h]``; compared exactly."""
    kw.setdefault("precision", "f64")
    return fuzz(fn, "embedding", cases, seed, **kw)


def check_batch(fn, cases=50, seed=0, *, max_seq_len=None):
    """Checks a packing/batching function exactly against :func:`packshard.batch`.

    ``fn(sequences, packs, max_seq_len)`` gets token sequences (lists of
    ints; empty ones and ones filling a whole row included) and the oracle's
    plan (``packs``: per pack a list of ``{"sequence", "offset", "length"}``)
    and returns ``input_ids``, ``position_ids``, ``sequence_ids`` (each
    ``[num_packs, max_seq_len]``) and optionally ``cu_seqlens`` (per pack).
    Cases come from numpy's PCG64 seeded with ``seed`` (lengths 0..max_seq_len,
    not powers of two). Raises ``AssertionError`` naming the case, the tensor,
    the first differing index and both values.
    """
    from . import batch
    rng = np.random.default_rng(seed)
    name = getattr(fn, "__name__", repr(fn))
    for c in range(cases):
        L = int(max_seq_len or rng.choice([7, 13, 31, 61]))
        n = int(rng.integers(1, 12))
        lengths = [int(x) for x in rng.integers(0, L + 1, size=n)]
        lengths[int(rng.integers(0, n))] = int(rng.choice([0, L]))
        seqs = [[int(t) for t in rng.integers(1, 1000, size=m)] for m in lengths]
        want = batch(seqs, L, algorithm="ffd", max_sequences_per_pack=int(rng.integers(1, 5)))
        got = fn(sequences=seqs, packs=want["packs"], max_seq_len=L)
        for key in ("input_ids", "position_ids", "sequence_ids", "cu_seqlens"):
            if key not in got:
                if key == "cu_seqlens":
                    continue
                raise AssertionError(f"packshard.testing: {name} returned no {key!r}")
            if key == "cu_seqlens":
                for p, (e, a) in enumerate(zip(want[key], got[key])):
                    if list(np.asarray(e)) != list(np.asarray(a)):
                        raise AssertionError(
                            f"packshard.testing: {name} fails batch case {c} (seed {seed}, "
                            f"lengths {lengths}, max_seq_len {L}): cu_seqlens[{p}] is "
                            f"{list(np.asarray(a))}, expected {list(np.asarray(e))}")
                continue
            e, a = want[key], np.asarray(got[key])
            if a.shape != e.shape:
                raise AssertionError(
                    f"packshard.testing: {name} fails batch case {c}: {key} has shape "
                    f"{list(a.shape)}, expected {list(e.shape)}")
            bad = np.argwhere(a != e)
            if len(bad):
                i = tuple(int(x) for x in bad[0])
                raise AssertionError(
                    f"packshard.testing: {name} fails batch case {c} (seed {seed}, lengths "
                    f"{lengths}, max_seq_len {L}): {key}{list(i)} is {a[i]}, expected {e[i]} "
                    f"({len(bad)} of {e.size} values differ)")
    return cases
