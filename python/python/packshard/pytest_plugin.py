"""pytest fixtures for checking a data collator (issue 36), loaded by the
``pytest11`` entry point when packshard is installed (or with ``-p
packshard.pytest_plugin``).

Fixtures:

- ``packshard_collator_cases``: the cases of
  :func:`packshard.collator_batches.check_batches` (a list of dicts with
  ``features``, ``describe``, ``source``), the fixed rows of issue 36 and
  docs/FAULTS.md and ``--packshard-cases`` random ones (default 50),
  ``--packshard-seed`` (default 0).
- ``packshard_judge_batch``: :func:`packshard.collator_batches.judge_batch`.
- ``packshard_check_batches``: :func:`packshard.collator_batches.check_batches`
  with the command line's case count and seed as defaults.

Nothing runs unless a test asks for a fixture.
"""

import functools

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("packshard")
    group.addoption("--packshard-cases", type=int, default=50,
                    help="random collator cases after the fixed ones (default 50)")
    group.addoption("--packshard-seed", type=int, default=0,
                    help="seed of the random collator cases (default 0)")


@pytest.fixture
def packshard_collator_cases(request):
    from packshard.collator_batches import batch_cases

    return batch_cases(cases=request.config.getoption("packshard_cases"),
                       seed=request.config.getoption("packshard_seed"))


@pytest.fixture
def packshard_judge_batch():
    from packshard.collator_batches import judge_batch

    return judge_batch


@pytest.fixture
def packshard_check_batches(request):
    from packshard.collator_batches import check_batches

    return functools.partial(check_batches, cases=request.config.getoption("packshard_cases"),
                             seed=request.config.getoption("packshard_seed"))
