"""packshard.testing: hold your kernel to the rule the Rust suites hold ours to.

``fuzz(fn, op, cases=N, seed=S)`` draws the cases the Rust fuzz targets draw
(``packshard_equivalence::fuzz``, generated natively: sizes that are not powers
of two, empty segments, planted outliers, ignored and out-of-range targets,
``-inf`` logits, uneven and padded vocabularies with NaN padding), calls
``fn(**args)`` with numpy arrays named as in docs/INTERFACE.md, and compares
what it returns with the f64 reference run on the same inputs (rounded to the
kernel's precision). An f32 kernel may be off by at most 32 x the error of the
reference math run in f32 (the baseline) plus 256 ulp of f32 of the tensor's
scale (``RelativeRule::F32_FUZZ``); a bf16 or f16 kernel (``precision="bf16"``,
``"f16"``: inputs and results stored in bf16 / f16, arithmetic in f32) by at
most 8 x the error of the baseline with its results stored in bf16 / f16 plus
one ulp of that type of the scale (``RelativeRule::BF16_STORED_FUZZ``); an f64
kernel is held to 64 ulp (``Tolerance::F64_REWRITE``). bf16 and f16 arrays
(``ml_dtypes.bfloat16``, ``numpy.float16``) are accepted as outputs and, in
:func:`judge`, as inputs. On failure it raises ``AssertionError`` naming
the smallest failing case, the tensor, the index, both values and the
tolerance, and can write that case out as a ``packshard eval`` JSON case.

``fn`` returns a dict of numpy arrays keyed as the op's result (``output``,
``lse``, ``grad_q``, ... / ``loss``, ``per_token_loss``, ``grad_logits``, ...):
every key it returns that the reference has is compared; the op's primary
result (``output`` or ``loss``) is required. A single array or number is taken
as the primary result.

``judge(op, args, outputs)`` holds the outputs of a case you built yourself to
the same rule and returns the verdict per tensor.
"""

import json
import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import numpy as np

from . import PackshardError, _native
from . import _error
from . import attention_options as _attention_options

__all__ = [
    "Report",
    "Failure",
    "cases",
    "judged",
    "judge",
    "TensorVerdict",
    "PRECISIONS",
    "WITHOUT_ATTENTION_OPTIONS",
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

# What a kernel may store its tensors in (core.rs `KernelPrecision`).
PRECISIONS = ("f32", "bf16", "f16", "f64")


def _check_precision(precision: str) -> str:
    """``precision`` if it is one of :data:`PRECISIONS`; a ``PackshardError``
    naming ``precision`` and the allowed values otherwise (at once, before
    any case runs)."""
    return _native.check_precision(str(precision))


def cases(op: str, n: int, seed: int = 0, large: Optional[int] = None
          ) -> List[Tuple[Dict[str, Any], str, int, int]]:
    """``n`` generated cases of ``op``: a list of ``(args, describe, size, input)``.
    Attention cases follow the default checks' schedule, the last ``large``
    large (default: 12 in 100)."""
    return _native.cases(op, int(n), int(seed), None if large is None else int(large))


def judged(op: str, args: Mapping[str, Any], precision: str = "f32"
           ) -> Tuple[Dict[str, Any], Optional[Dict[str, Any]]]:
    """``(expected, baseline)`` for one case: the f64 reference's result (a dict)
    on the inputs rounded to ``precision``, and the same math run in f32 (None
    for ``precision="f64"``, and for ``embedding``, which is exact)."""
    a = dict(args)
    if op == "attention":
        go = a.get("grad_output") if a.get("want_grad", a.get("grad_output") is not None) else None
        cu_q = a["cu_seqlens_q"] if "cu_seqlens_q" in a else a["cu_seqlens"]
        cu_k = a.get("cu_seqlens_k")
        opts = _attention_options.native(**{n: a.get(n) for n in _attention_options.NAMES},
                                         error=_error)
        return _native.attention_judged(
            _f(a["q"]), _f(a["k"]), _f(a["v"]), np.asarray(cu_q, dtype=np.int64),
            bool(a.get("causal", False)), a.get("scale"),
            None if go is None else _f(go), precision,
            None if cu_k is None else np.asarray(cu_k, dtype=np.int64), **opts)
    if op in ("cross_entropy", "linear_cross_entropy"):
        lin = op == "linear_cross_entropy"
        want = bool(a.get("want_grad", False))
        opts = {k: a.get(k) for k in ("ignore_index", "label_smoothing", "smoothing", "z_loss",
                                      "reduction", "vocab_size", "softcap")}
        # O2: the reference is given the case's upstream gradient ([n] under
        # reduction "none", [1] otherwise), as the kernel is.
        if want and a.get("grad_output") is not None:
            opts["grad_output"] = _f(a["grad_output"]).ravel().tolist()
        return _native.loss_judged(
            None if lin else _f(a["logits"]), _f(a["hidden"]) if lin else None,
            _f(a["weight"]) if lin else None, np.asarray(a["targets"], dtype=np.int64),
            opts, want, precision)
    if op == "embedding":
        from . import embedding
        want = a.get("want_grad", a.get("grad_output") is not None)
        r = embedding(a["ids"], a["weight"], vocab_size=a.get("vocab_size"),
                      grad_output=a.get("grad_output") if want else None)
        return r, None
    raise PackshardError(f"op: no judge for {op!r}")


def _f(x):
    """``x`` as float64; bf16, f16 and other narrow floats (``ml_dtypes``)
    through float32, which holds each of their values exactly."""
    a = np.asarray(x)
    if a.dtype.kind == "V" and a.dtype.itemsize <= 2:  # ml_dtypes' bfloat16, float8s
        a = a.astype(np.float32)
    return np.asarray(a, dtype=np.float64)


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

    def __init__(self, op: str, args: Dict[str, Any], describe: str, size: int, source: str,
                 detail: str) -> None:
        self.op, self.args, self.describe, self.size = op, args, describe, size
        self.source, self.detail = source, detail

    def to_eval_case(self) -> Dict[str, Any]:
        """The case in the ``packshard eval`` format (a dict), for a regression file."""
        case = {"op": self.op}
        for k, v in self.args.items():
            if k == "grad_output" and not self.args.get("want_grad", True):
                continue
            # An option forced off (``fix``, WITHOUT_ATTENTION_OPTIONS) is absent.
            if v is None and k in _attention_options.NAMES:
                continue
            # eval takes one form of the offsets, and no max_seqlen_*.
            if self.op == "attention" and (k.startswith("max_seqlen") or (
                    k == "cu_seqlens" and "cu_seqlens_q" in self.args)):
                continue
            case[k] = _json_value(v)
        return case

    def write(self, path: str) -> None:
        """Writes :meth:`to_eval_case` as JSON to ``path`` (``packshard eval PATH`` replays it)."""
        d = os.path.dirname(os.path.abspath(path))
        os.makedirs(d, exist_ok=True)
        with open(path, "w") as f:
            json.dump(self.to_eval_case(), f)
            f.write("\n")

    def __str__(self) -> str:
        return f"case: {self.describe} ({self.source})\n  {self.detail}"


class TensorVerdict:
    """How one output tensor compared: ``name``, ``passed``, ``error`` (max
    ``|actual - expected|``), ``baseline_error`` (the baseline's, stored in
    the kernel's precision), ``allowed`` (the error the rule allows at
    ``index``), ``share`` (the largest ``error / allowed`` over the elements:
    at most 1 on a pass), ``index`` (a tuple), ``expected`` and ``actual``
    (both values there), and ``failure`` (the rule's text, or None)."""

    def __init__(self, name: str, v: Mapping[str, Any]) -> None:
        self.name = name
        self.failure: Optional[str] = v["failure"]
        self.passed = self.failure is None
        self.error: float = v["error"]
        self.baseline_error: float = v["baseline_error"]
        self.allowed: float = v["allowed"]
        self.share: float = v["share"]
        self.index: Tuple[int, ...] = tuple(v["index"])
        self.expected: float = v["expected"]
        self.actual: float = v["actual"]

    def __repr__(self) -> str:
        return (f"{self.name}: {'pass' if self.passed else 'FAIL'}, max error {self.error:.3e}, "
                f"allowed {self.allowed:.3e} at {list(self.index)} ({100 * self.share:.1f}% of "
                f"it used; expected {self.expected!r}, got {self.actual!r})")


class Report:
    """What a run saw: ``cases`` run, ``compared`` (cases with results compared),
    ``skipped`` (the reference refused the input: bad input on purpose),
    ``values`` compared, ``worst`` (the largest share of the allowed error
    any tensor used: ``error / allowed``, at most 1 on a passing run), and
    ``failures``. From :func:`judge` (one case): ``passed`` and ``tensors``
    (name -> :class:`TensorVerdict`)."""

    def __init__(self, op: str, name: str) -> None:
        self.op, self.name = op, name
        self.cases = self.compared = self.skipped = self.values = 0
        self.worst = 0.0
        self.failures: List[Failure] = []
        self.tensors: Dict[str, TensorVerdict] = {}
        # Cases left out because the kernel cannot take them, by reason.
        self.restricted: Dict[str, int] = {}

    @property
    def passed(self) -> bool:
        """No case failed (and at least one was compared)."""
        return not self.failures and self.compared > 0

    def smallest(self) -> Optional[Failure]:
        """The smallest failing case (fewest tensor elements), or None."""
        return min(self.failures, key=lambda f: f.size) if self.failures else None

    def __repr__(self) -> str:
        left_out = "".join(f", {n} left out ({why})" for why, n in self.restricted.items())
        text = (f"Report({self.op}: {self.cases} cases, {self.compared} compared, "
                f"{self.skipped} skipped as bad input{left_out}, {len(self.failures)} failed, "
                f"worst {100 * self.worst:.1f}% of the allowed error)")
        for t in self.tensors.values():
            text += f"\n  {t!r}"
        for f in self.failures[:1]:
            text += f"\n  {f.detail}"
        return text


# The order a kernel's tuple would be read in, named in the error it gets.
_ORDER = {
    "attention": ("output", "lse", "grad_q", "grad_k", "grad_v"),
    "cross_entropy": ("loss", "per_token_loss", "logsumexp", "grad_logits"),
    "linear_cross_entropy": ("loss", "per_token_loss", "logsumexp", "grad_hidden",
                             "grad_weight"),
    "embedding": ("output", "grad_weight"),
}


class _BadOutput(Exception):
    """The kernel returned something that is not a result of ``op``."""


def _as_result(out: Any, op: str) -> Dict[str, Any]:
    """The kernel's return value as a dict of results: a dict as it is, a
    single array or number as the primary result. A tuple or list is
    refused with the keys to return (``(out, lse)`` and ``(out, lse, S)``
    orders differ between libraries, so none is guessed)."""
    if isinstance(out, dict):
        return out
    if isinstance(out, (tuple, list)):
        raise _BadOutput(
            f"returned a {type(out).__name__} of {len(out)}; return a dict keyed by "
            f"{', '.join(repr(k) for k in _ORDER[op])} (any subset with {PRIMARY[op]!r}), "
            f"or the {PRIMARY[op]!r} alone as one array")
    if out is None:
        raise _BadOutput(f"returned None; return a dict with {PRIMARY[op]!r}")
    return {PRIMARY[op]: out}


def _compare(op: str, expected: Mapping[str, Any], baseline: Optional[Mapping[str, Any]],
             got: Mapping[str, Any], precision: str) -> List[TensorVerdict]:
    """Every result of ``got`` that the reference has, held to the rule
    (``core::judge_tensor``): one :class:`TensorVerdict` each, in the
    reference's order."""
    terms = expected.get("terms") or {}
    # Attention results are judged segment by segment, each under its own
    # terms (``terms["segments"]``), as the Rust fuzz judges them.
    terms_json = json.dumps(terms) if terms.get("segments") else None
    out = []
    for key, exp in expected.items():
        if key not in got or not isinstance(exp, (np.ndarray, float)):
            continue
        exp = np.asarray(exp, dtype=np.float64)
        try:
            act = _f(got[key])
        except (TypeError, ValueError) as e:
            raise _BadOutput(f"returned {key!r} that is not numeric ({e})") from None
        base = None
        if baseline is not None and key in baseline:
            base = np.asarray(baseline[key], dtype=np.float64)
        prec = precision if (base is not None or precision == "f64") else "f64"
        if op == "embedding":
            prec = "f64"  # a lookup is exact in any precision
        v = _native.judge_tensor(key, exp, base, act, prec, terms.get(key), terms_json)
        out.append(TensorVerdict(key, v))
    return out


# The largest finite value of each storage precision (IEEE binary16, bfloat16,
# binary32).
_MAX_FINITE = {"f16": 65504.0, "bf16": 3.3895313892515355e38, "f32": 3.4028234663852886e38}


def _beyond(expected, limit):
    """Whether any finite value of the reference's results exceeds ``limit``."""
    for v in expected.values():
        if isinstance(v, (np.ndarray, float, np.floating)):
            a = np.abs(np.asarray(v, dtype=np.float64))
            if np.any(np.isfinite(a) & (a > limit)):
                return True
    return False


def _run_one(fn, op, args, describe, size, source, precision, report):
    try:
        expected, baseline = judged(op, args, precision)
    except PackshardError as e:
        if getattr(e, "kind", None) == "internal":
            raise  # packshard's own bug, never a skipped case
        report.skipped += 1
        return None
    # A result beyond the kernel's storage range cannot be held by any kernel
    # of that precision (f16's largest finite is 65504: a gradient of 1.8e5
    # is inf in every f16 kernel and in the baseline): the case is left out
    # and counted, never judged.
    limit = _MAX_FINITE.get(precision)
    if limit is not None and _beyond(expected, limit):
        why = f"a result beyond {precision}'s range (|x| > {limit:g})"
        report.restricted[why] = report.restricted.get(why, 0) + 1
        return None
    report.cases += 1
    # The kernel gets copies: `args` stays as generated (the regression case
    # is written from it), and the copies show whether the kernel wrote into
    # its inputs.
    call = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in args.items()}
    try:
        got = _as_result(fn(**call), op)
    except _BadOutput as e:
        return Failure(op, args, describe, size, source, str(e))
    except Exception as e:  # the kernel under test raised on valid input
        refused = _refused_option(e, args) if op == "attention" else None
        if refused is not None:
            # A typed refusal of an option the kernel does not implement
            # (never a silent fallback): left out and counted.
            report.cases -= 1
            why = f"{refused}: refused by the kernel"
            report.restricted[why] = report.restricted.get(why, 0) + 1
            return None
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
    try:
        verdicts = _compare(op, expected, baseline, got, precision)
    except _BadOutput as e:
        return Failure(op, args, describe, size, source, str(e))
    for v in verdicts:
        report.values += int(np.asarray(expected[v.name]).size)
        if not v.passed:
            return Failure(op, args, describe, size, source, v.failure)
        report.worst = max(report.worst, v.share)
    return None


def _refused_option(e, args):
    """The option a kernel's exception refuses, or None: a ``PackshardError``
    whose ``field`` names an option the case sets (the registered kernels'
    typed refusal, ``invalid_argument`` "this implementation has no ..."), or a
    ``NotImplementedError`` whose message names one."""
    for name in _attention_options.given(args):
        field = getattr(e, "field", None) or ""
        if isinstance(e, PackshardError) and (field == name or field.startswith(name + "[")):
            return name
        if isinstance(e, NotImplementedError) and name in str(e):
            return name
    return None


def _stored_inputs(args: Dict[str, Any], precision: str) -> None:
    """Rounds the float tensors of a generated case to the kernel's storage
    (bf16, f16) in place, with the judge's own rounding: the kernel receives
    values its dtype holds exactly, so however it casts them (ml_dtypes
    rounds from float64 directly, PyTorch through float32) it sees what the
    reference sees."""
    if precision not in ("bf16", "f16"):
        return
    for k, v in args.items():
        if isinstance(v, np.ndarray) and v.dtype.kind == "f":
            args[k] = _native.round_to(np.ascontiguousarray(v, dtype=np.float64), precision)


def fuzz(fn: Callable[..., Any], op: str, cases: int = 100, seed: int = 0, *,
         precision: str = "f32", grad: bool = True, fix: Optional[Mapping[str, Any]] = None,
         regression_out: Optional[str] = None, raise_on_failure: bool = True,
         only: Optional[Callable[[Dict[str, Any]], Optional[str]]] = None,
         fail_fast: bool = False) -> Report:
    """Runs ``fn`` on ``cases`` generated cases of ``op`` from ``seed``.

    ``op``: ``attention``, ``cross_entropy``, ``linear_cross_entropy``,
    ``embedding``. ``precision``: what the kernel stores its tensors in:
    ``"f32"`` (default), ``"bf16"``, ``"f16"`` (inputs rounded to it before
    the kernel sees them; arithmetic in f32) or ``"f64"``; anything else
    raises ``PackshardError`` (``field == "precision"``) before any case runs.
    ``grad``: pass ``grad_output`` / ``want_grad=True``
    (False: forward only). ``fix``: options to force on every case (e.g.
    ``{"causal": True}`` or ``{"z_loss": 0.0}`` for a kernel without z-loss).
    ``regression_out``: where to write the smallest failing case as a
    ``packshard eval`` JSON case. ``only(args)``: None to run a case, or the
    reason it is left out (counted in ``Report.restricted``, never silently).
    ``fail_fast``: stop at the first failing case (the cases run in the same
    order, so a kernel fails with it exactly when it fails without it; the
    report then holds that one failure, not the smallest of all).
    Returns a :class:`Report`; raises
    ``AssertionError`` (with the smallest failing case) when any case fails.
    """
    precision = _check_precision(precision)
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
        _stored_inputs(args, precision)
        source = (f"budgeted input {i} of seed {seed}" if op == "attention"
                  else f"random input {i} of seed {seed}")
        f = _run_one(fn, op, args, describe, size, source, precision, report)
        if f is not None:
            report.failures.append(f)
            if fail_fast:
                break
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


def judge(op: str, args: Mapping[str, Any], outputs: Any, precision: str = "f32") -> Report:
    """Your own case, judged: ``args`` a case you built (the op's arguments
    as :func:`fuzz` passes them, any shapes the reference accepts; float
    tensors as float64, float32, float16 or ``ml_dtypes.bfloat16`` arrays),
    ``outputs`` what your kernel returned for it (a dict keyed as the op's
    result, or the primary result alone), held to the rule :func:`fuzz`
    uses for ``precision``. Returns a :class:`Report` of one case:
    ``passed``, ``tensors`` (per result a :class:`TensorVerdict`: error,
    allowed error, share, worst index, both values), ``failures`` (the
    failure, as :func:`fuzz` would report it). Never raises on a failing
    kernel; raises ``PackshardError`` for a case the reference refuses or an
    unknown ``precision``.

    ``judge("attention", {"q": q, "k": k, "v": v, "cu_seqlens": cu}, {"output": o})``
    """
    precision = _check_precision(precision)
    if op not in PRIMARY:
        raise PackshardError(f"op: no judge for {op!r}; known: {', '.join(PRIMARY)}")
    a = {k: (_f(v) if isinstance(v, np.ndarray) and v.dtype.kind not in "iub" else v)
         for k, v in dict(args).items()}
    report = Report(op, "judge")
    expected, baseline = judged(op, a, precision)
    report.cases = 1
    describe = "your case: " + ", ".join(
        f"{k} {list(np.shape(v))}" if isinstance(v, np.ndarray) else f"{k} {v!r}"
        for k, v in a.items())
    fail = lambda text: report.failures.append(  # noqa: E731
        Failure(op, a, describe, 0, "judge", text))
    try:
        got = _as_result(outputs, op)
        if PRIMARY[op] not in got:
            raise _BadOutput(f"returned no {PRIMARY[op]!r} (keys: {sorted(got)})")
        verdicts = _compare(op, expected, baseline, got, precision)
    except _BadOutput as e:
        fail(str(e))
        return report
    report.compared = 1
    for v in verdicts:
        report.tensors[v.name] = v
        report.values += int(np.asarray(expected[v.name]).size)
        report.worst = max(report.worst, v.share)
        if not v.passed:
            fail(v.failure)
    return report


# The keyword arguments of a generated attention case (flash_attn_varlen_func's
# names; ``cu_seqlens`` is ``cu_seqlens_q``, the self-attention form).
_ATTENTION_ARGS = ("q", "k", "v", "cu_seqlens", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q",
                   "max_seqlen_k", "causal", "scale", "grad_output", "want_grad"
                   ) + _attention_options.NAMES


# ``fix=`` for a kernel without flash-attention's options (each forced to
# None: absent for the reference and the kernel), as ``{"softcap": None}`` is
# for a loss kernel without the softcap. A kernel run this way is not checked
# on any of them.
WITHOUT_ATTENTION_OPTIONS: Dict[str, Any] = {n: None for n in _attention_options.NAMES}


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
    a segment of 1,023 to 1,100 tokens, head dims 32 to 256 with 160, 192
    and 256 in every check, every ratio ``h / h_kv``, cross segments,
    causal). One case in four has no ``scale`` (``fn`` must default to
    ``1/sqrt(d)``; a ``fn`` whose ``scale`` has no default is given that
    value); one small case in eight and 3 of the 12 large ones are
    forward-only (``want_grad=False``, no ``grad_output``). A ``fn`` that takes neither
    ``cu_seqlens_k`` nor ``**kwargs`` gets self-attention cases only; one
    without ``causal`` only bidirectional ones; ``gqa=False`` leaves out the
    cases with ``h_kv < h``. ``causal=True`` or ``False`` forces the mask on
    every case. flash-attention's options (``window_size``, ``softcap``,
    ``alibi_slopes``, ``seqused_k``; :mod:`packshard.attention_options`) are
    passed when a case draws them (about one case in two) to a ``fn`` that
    takes them by name or with ``**kwargs`` (one that takes ``**kwargs`` and
    ignores one fails); a ``fn`` that takes one neither by name nor with
    ``**kwargs`` does not get the cases with it, and a ``fn`` that refuses one (a ``PackshardError`` naming
    it, or a ``NotImplementedError`` naming it) has that case left out.
    What is left out is counted in ``Report.restricted``.
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
        for name in _attention_options.given(args):
            if name not in takes:
                return f"{name}: fn takes no {name}"
        return None

    # A fn whose ``scale`` has no default cannot be asked for its default:
    # it gets 1/sqrt(d), the value the reference uses when none is given.
    needs_scale = _required(fn, "scale")

    def call(**args):
        if needs_scale and "scale" not in args:
            args["scale"] = 1.0 / float(np.sqrt(np.shape(args["q"])[-1]))
        return fn(**{k: v for k, v in args.items() if k in takes})

    call.__name__ = getattr(fn, "__name__", repr(fn))
    return fuzz(call, "attention", cases, seed, fix=fix, only=only, **kw)


def _required(fn, name):
    """Whether ``fn`` takes ``name`` by keyword without a default."""
    import inspect
    try:
        p = inspect.signature(fn).parameters.get(name)
    except (TypeError, ValueError):
        return False
    return (p is not None and p.default is p.empty
            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))


def check_cross_entropy(fn: Callable[..., Any], cases: int = 100, seed: int = 0,
                        **kw: Any) -> Report:
    """:func:`fuzz` for cross-entropy: ``fn(logits, targets, ignore_index,
    label_smoothing, smoothing, z_loss, reduction, vocab_size, num_shards, layout,
    want_grad)`` (``logits``: ``[n, w]``, columns ``vocab_size..`` padding)
    returns ``loss`` and optionally ``per_token_loss`` ``[n]``, ``logsumexp``
    ``[n]``, ``grad_logits`` ``[n, w]`` (padding columns 0)."""
    return fuzz(fn, "cross_entropy", cases, seed, **kw)


def check_linear_cross_entropy(fn: Callable[..., Any], cases: int = 100, seed: int = 0,
                               **kw: Any) -> Report:
    """:func:`fuzz` for the output layer: ``fn(hidden, weight, targets, ...)``
    returns ``loss`` and optionally ``grad_hidden`` ``[n, h]``, ``grad_weight``
    ``[w, h]``, ``per_token_loss``, ``logsumexp``."""
    return fuzz(fn, "linear_cross_entropy", cases, seed, **kw)


def check_embedding(fn: Callable[..., Any], cases: int = 100, seed: int = 0,
                    **kw: Any) -> Report:
    """:func:`fuzz` for the embedding: ``fn(ids, weight, vocab_size, num_shards,
    layout, grad_output, want_grad)`` returns ``output`` ``[n, h]`` and
    optionally ``grad_weight`` ``[w, h]``; compared exactly."""
    kw.setdefault("precision", "f64")
    return fuzz(fn, "embedding", cases, seed, **kw)


def check_batch(fn: Callable[..., Any], cases: int = 50, seed: int = 0, *,
                max_seq_len: Optional[int] = None) -> int:
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
