"""pytest plugin: record when each test ran, for placing sanitizer reports in time.

Load it with ``-p benchmarks.run_times`` and ``TWELLPY_TEST_TIMES=DIR``. Each process that
runs tests (each xdist worker, and the controller) writes, in ``DIR``:

- ``times_<pid>.tsv``: ``<node id>\\t<start>\\t<stop>`` (unix seconds; setup through
  teardown) for every test that finished;
- ``started_<pid>.tsv``: ``<node id>\\t<start>`` as each test starts, so a test that never
  finished (killed by the call's time limit, or hung) is still known;
- ``phases_<pid>.tsv``: ``<phase>\\t<time>`` for ``imported`` (this plugin loaded, i.e. the
  process is up), ``configured`` (conftest and plugins ready, the GPU probe included) and
  ``collected`` (collection done), to split a pass's start-up.

``memcheck_triage.py`` reads the directory.

It lives in ``benchmarks/`` rather than in ``tests/conftest.py`` because the memcheck ledger
is keyed by a hash of ``tests/``: tooling around a sanitizer run must not invalidate it.
"""

import os
import time

import pytest

_IMPORTED = time.time()


def _append(kind, line):
    directory = os.environ.get("TWELLPY_TEST_TIMES")
    if directory:
        with open(os.path.join(directory, f"{kind}_{os.getpid()}.tsv"), "a") as f:
            f.write(line + "\n")


def pytest_configure(config):
    _append("phases", f"imported\t{_IMPORTED:.3f}")
    _append("phases", f"configured\t{time.time():.3f}")


def pytest_collection_finish(session):
    _append("phases", f"collected\t{time.time():.3f}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    start = time.time()
    _append("started", f"{item.nodeid}\t{start:.3f}")
    yield
    _append("times", f"{item.nodeid}\t{start:.3f}\t{time.time():.3f}")
