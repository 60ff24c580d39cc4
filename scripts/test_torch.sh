#!/usr/bin/env bash
# The torch tests of the Python package (python/tests/test_torch.py): torch
# tensors through packshard's causal ops and collator checks (issue 36).
# Not part of scripts/test.sh: torch is 1-5 GB. Idempotent: the venv
# (.cache/venv-torch) and its packages are reused on a second run.
#   scripts/test_torch.sh                       # torch from PyPI
#   PIP_INDEX_URL=... scripts/test_torch.sh     # e.g. a CPU-only torch index
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.cache/venv-torch
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install --quiet --disable-pip-version-check -r python/requirements-dev.txt torch
(cd python && VIRTUAL_ENV="$PWD/../$VENV" "../$VENV/bin/maturin" develop --quiet --profile dev)
"$VENV/bin/python" -m pytest -q -m torch python/tests/test_torch.py
