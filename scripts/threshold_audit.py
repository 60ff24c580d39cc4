#!/usr/bin/env python3
"""Counts the numeric thresholds in the test files and those that say where
their number comes from (docs/STYLE.md, habit 5: name every threshold).

A *threshold line* is a code line of a test file (``*/tests/**/*.rs``,
``tests/**/*.rs``, ``python/tests/*.py``, and the test modules of ``src``:
files named ``tests.rs``, ``*_tests.rs`` or under a ``tests/`` folder of
``src``) that holds a small float literal in exponent form (``1e-9``,
``2.5e-3``) or a number beside a tolerance word (``atol``, ``rtol``, ``tol``,
``abs=``, ``rel=``, ``eps``, ``ulp``), used as a bound: the line compares
(``<``, ``<=``, ``>``, ``>=``), asserts, or passes it as a tolerance
(``approx``, ``allclose``, ``epsilon``, ``Tolerance``, a ``const``). An input
value in exponent form (``z_loss: 1e-3``, a planted ``+= 1e-15``, a
finite-difference step) is data, not a threshold, and is not counted. It is
*explained* when the line has a
trailing comment, or the code line just above it (or the first line of the
statement group it belongs to, up to 8 code lines above) is preceded by a comment line (``//``, ``///``,
``#``) with no blank line between. Usage::

    python3 scripts/threshold_audit.py            # counts per file, then totals
    python3 scripts/threshold_audit.py --list     # also every unexplained line
"""

import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SKIP = {"target", ".git", "node_modules", ".cache", "fuzz/artifacts"}

EXP = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:e|E)-\d+")
WORD = re.compile(r"(?i)(atol|rtol|\btol\b|tolerance|\babs\s*=(?!=)|\brel\s*=(?!=)|\beps\b|(?<!_)\bulps?\b)")
BOUND = re.compile(
    r"(?<![-=])(<=?|>=?)(?![=>])\s*[-\w(.]|assert|approx|allclose|atol|rtol|\btol\b|TOL|epsilon"
    r"|Tolerance|\bconst\b|\bwithin\b|\bulps\b")
NUM = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def test_files():
    for p in sorted(ROOT.rglob("*")):
        rel = p.relative_to(ROOT)
        parts = rel.parts
        if any(s in parts for s in SKIP) or not p.is_file():
            continue
        if p.suffix == ".rs":
            in_tests = "tests" in parts[:-1]
            src_test = "src" in parts and (p.name == "tests.rs" or p.name.endswith("_tests.rs"))
            if in_tests or src_test:
                yield rel
        elif p.suffix == ".py" and parts[:2] == ("python", "tests"):
            yield rel


def comment_of(line, py):
    """The line's comment part, or None (a crude split that ignores strings)."""
    mark = "#" if py else "//"
    i = line.find(mark)
    return None if i < 0 else line[i:]


def is_comment_line(line, py):
    s = line.strip()
    return s.startswith("#") if py else s.startswith("//")


def audit(rel):
    py = rel.suffix == ".py"
    lines = (ROOT / rel).read_text(encoding="utf-8", errors="replace").splitlines()
    found, unexplained = 0, []
    for i, line in enumerate(lines):
        if is_comment_line(line, py) or not line.strip():
            continue
        code = line
        c = comment_of(line, py)
        if c is not None:
            code = line[: len(line) - len(c)]
        # Strings are not thresholds: drop quoted text from the code part.
        bare = re.sub(r'"(?:[^"\\]|\\.)*"', '""', code)
        bare = re.sub(r"'(?:[^'\\]|\\.)*'", "''", bare) if py else bare
        hit = EXP.search(bare) or (WORD.search(bare) and NUM.search(WORD.split(bare, 1)[-1]))
        if not hit or not BOUND.search(bare):
            continue
        found += 1
        if c is not None and c.strip() not in ("#", "//"):
            continue
        # A comment block right above this line, or above the lines of the
        # statement group it belongs to (walk up while the lines are code, at most 8).
        j, ok = i - 1, False
        for _ in range(8):
            if j < 0 or not lines[j].strip():
                break
            if is_comment_line(lines[j], py):
                ok = True
                break
            j -= 1
        if not ok:
            unexplained.append((i + 1, line.strip()))
    return found, unexplained


def main():
    listing = "--list" in sys.argv
    total_found = total_bad = 0
    rows = []
    for rel in test_files():
        found, bad = audit(rel)
        if not found:
            continue
        total_found += found
        total_bad += len(bad)
        rows.append((str(rel), found, bad))
    for name, found, bad in rows:
        print(f"{len(bad):4d} unexplained of {found:4d}  {name}")
        if listing:
            for n, text in bad:
                print(f"        {n}: {text[:110]}")
    print(f"total: {total_bad} unexplained of {total_found} threshold lines in {len(rows)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main())
