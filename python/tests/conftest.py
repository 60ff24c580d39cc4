"""Markers and shared helpers of packshard's Python tests."""
import importlib
import os

import pytest


def hugging_face_transformers():
    """The `transformers` module for the tests that run Hugging Face's own
    collators (numpy output, no torch). scripts/test.sh installs it
    (requirements-dev.txt) and sets PACKSHARD_REQUIRE_TRANSFORMERS=1, so in
    CI a missing transformers fails these tests; elsewhere they skip."""
    if os.environ.get("PACKSHARD_REQUIRE_TRANSFORMERS") == "1":
        return importlib.import_module("transformers")
    return pytest.importorskip("transformers", reason="transformers is not installed")


def pytest_configure(config):
    # python/tests/test_torch.py: skipped where torch is not installed (CI
    # does not install it, ~1-5 GB); scripts/test_torch.sh runs it.
    config.addinivalue_line("markers", "torch: needs torch (scripts/test_torch.sh runs these)")
