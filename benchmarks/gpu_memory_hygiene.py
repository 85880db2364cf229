"""pytest plugin for the parallel GPU suite on the device: give cached GPU memory back after each test.

Load it with ``-p benchmarks.gpu_memory_hygiene`` (the device scripts do; ``PYTHONPATH=.``).

Why: with 16 xdist workers on one GPU, every worker's CuPy memory pool and torch caching
allocator keep the peak of every test that worker has run. On 2026-12-03 (H200, 139 GiB) the
suite then failed four unrelated tests with ``OutOfMemoryError`` / ``CUBLAS_STATUS_ALLOC_FAILED``
while the exclusive large-shape tests (tens of GiB each) ran or had just run. CuPy frees its own
cache and retries when *it* runs out, but it cannot reach another process's cache, so the
workers have to let go between tests. The tests themselves are unchanged.

With ``TWELLPY_MEMORY_LOG=DIR`` each worker also appends ``test, pool bytes held, pool bytes
in use`` (before the release), the device's used bytes (after it), the time and the pid to ``DIR/pool_<worker>.csv``,
to find the tests that grow a pool or leave memory behind.
"""

import os
import time

import pytest


def _release_cached_gpu_memory():
    held = used = 0
    try:
        import cupy

        pool = cupy.get_default_memory_pool()
        held, used = pool.total_bytes(), pool.used_bytes()
        pool.free_all_blocks()
        cupy.get_default_pinned_memory_pool().free_all_blocks()
    except Exception:  # no CuPy or no GPU: nothing cached
        pass
    try:
        import sys

        torch = sys.modules.get("torch")  # only if a test imported it: importing torch costs seconds
        if torch is not None and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
    except Exception:
        pass
    return held, used


@pytest.hookimpl(hookwrapper=True, trylast=True)
def pytest_runtest_teardown(item, nextitem):
    yield  # the test's own fixtures are torn down first
    held, used = _release_cached_gpu_memory()
    log_dir = os.environ.get("TWELLPY_MEMORY_LOG")
    if log_dir:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        # the whole device's used bytes after the release: with one worker, memory that no pool
        # holds and that outlives its test (what TWELLPY_SANITIZE's direct cudaMalloc runs showed)
        device_used = -1
        try:
            import cupy

            free, total = cupy.cuda.runtime.memGetInfo()
            device_used = total - free
        except Exception:
            pass
        with open(os.path.join(log_dir, f"pool_{worker}.csv"), "a") as f:
            # time and pid: to line the rows up with nvidia-smi's per-process memory
            f.write(f"{item.nodeid},{held},{used},{device_used},{time.time():.1f},{os.getpid()}\n")


def pytest_runtest_logreport(report):
    """With ``TWELLPY_MEMORY_LOG=DIR``, append every failure to ``DIR/failures_<worker>.txt`` at
    once, so a suite that the call's time limit cuts off still says which tests failed and why."""
    log_dir = os.environ.get("TWELLPY_MEMORY_LOG")
    if not log_dir or not report.failed:
        return
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    text = str(report.longrepr) if report.longrepr is not None else ""
    tail = "\n".join(text.splitlines()[-25:])  # the assertion and its location are at the end
    with open(os.path.join(log_dir, f"failures_{worker}.txt"), "a") as f:
        f.write(f"==== FAILED ({report.when}) {report.nodeid} [{report.duration:.1f} s]\n{tail}\n")
