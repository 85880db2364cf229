"""pytest plugin: record when each test ran, for placing sanitizer reports in time.

Load it with ``-p benchmarks.run_times`` and ``TWELLPY_TEST_TIMES=DIR``. Each process that
runs tests (each xdist worker) appends ``<node id>\\t<start>\\t<stop>`` (unix seconds; setup
through teardown) to ``DIR/times_<pid>.tsv``. ``memcheck_triage.py`` reads the directory.

It lives in ``benchmarks/`` rather than in ``tests/conftest.py`` because the memcheck ledger
is keyed by a hash of ``tests/``: tooling around a sanitizer run must not invalidate it.
"""

import os
import time

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    directory = os.environ.get("TWELLPY_TEST_TIMES")
    start = time.time()
    yield
    if directory:
        with open(os.path.join(directory, f"times_{os.getpid()}.tsv"), "a") as f:
            f.write(f"{item.nodeid}\t{start:.3f}\t{time.time():.3f}\n")
