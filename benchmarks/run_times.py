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

The controller also prints ``FAILED-LIVE <node id> (<phase>): <last line of the error>``
to stderr the moment a test fails, so a pass killed by the call's time limit before
pytest's summary still names its failures (twenty-first session: two tests failed under
memcheck in a pass cut by the limit, and nothing said which).

It lives in ``benchmarks/`` rather than in ``tests/conftest.py`` because the memcheck ledger
is keyed by a hash of ``tests/``: tooling around a sanitizer run must not invalidate it.
"""

import os
import sys
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


def pytest_runtest_logreport(report):
    # xdist workers report to the controller, which alone writes to the pass's log
    if report.failed and not os.environ.get("PYTEST_XDIST_WORKER"):
        text = (getattr(report, "longreprtext", "") or "").strip().splitlines()
        errors = [line for line in text if line.startswith("E ")]  # pytest's error lines
        reason = (errors[-1] if errors else text[-1] if text else "")[:300]
        sys.stderr.write(f"\nFAILED-LIVE {report.nodeid} ({report.when}): {reason}\n")
        sys.stderr.flush()
