"""Markers of packshard's Python tests."""


def pytest_configure(config):
    # python/tests/test_torch.py: skipped where torch is not installed (CI
    # does not install it, ~1-5 GB); scripts/test_torch.sh runs it.
    config.addinivalue_line("markers", "torch: needs torch (scripts/test_torch.sh runs these)")
