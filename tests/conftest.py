"""Shared fixtures: backends, dtype tolerances, GPU skip logic."""
import os

# JAX grabs 75% of GPU memory per process by default, which starves CuPy,
# cuBLAS and torch in the same (or a parallel xdist) test process.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# ... and without preallocation its BFC pool still never gives memory back; the
# platform allocator frees on demand, so parallel test processes share the GPU.
os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")

#: Under compute-sanitizer (TWELLPY_SANITIZE=1, set by benchmarks/device_suite.sh)
#: memory comes straight from cudaMalloc: a caching pool hands out pieces of big
#: blocks, and memcheck cannot see an overrun that stays inside such a block.
SANITIZE = os.environ.get("TWELLPY_SANITIZE") == "1"
if SANITIZE:
    os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")

import fcntl
import tempfile

import numpy as np
import pytest

from twellpy._array import bfloat16, gpu_available

HAS_GPU = gpu_available()
#: GPUs this process sees (tests of calls across devices need two)
GPU_COUNT = __import__("cupy").cuda.runtime.getDeviceCount() if HAS_GPU else 0
if HAS_GPU and SANITIZE:
    import cupy

    cupy.cuda.set_allocator(None)  # exact allocation sizes for memcheck (see SANITIZE)

#: Relative-error tolerances by value dtype (errors against a float64 reference).
RTOL = {
    np.dtype(np.float64): 1e-12,
    np.dtype(np.float32): 1e-5,
    np.dtype(np.float16): 5e-3,
    bfloat16: 2e-2,
}

DTYPES = [np.dtype(np.float32), np.dtype(np.float64), np.dtype(np.float16), bfloat16]


def _shard(items, config):
    """Keep shard k of n (``TWELLPY_SHARD=k/n``): device runs split long suites
    (memcheck) into calls that fit the per-call limit. Round robin over the
    collected order, so every shard gets a mix of fast and slow tests."""
    spec = os.environ.get("TWELLPY_SHARD")
    if not spec:
        return
    try:
        k, n = (int(v) for v in spec.split("/"))
        if not 0 <= k < n:
            raise ValueError
    except ValueError:
        raise pytest.UsageError(f"TWELLPY_SHARD must be 'k/n' with 0 <= k < n, got {spec!r}") from None
    keep = [it for i, it in enumerate(items) if i % n == k]
    drop = [it for i, it in enumerate(items) if i % n != k]
    if drop:
        config.hook.pytest_deselected(items=drop)
    items[:] = keep


# ---- test ledger: resumable long device runs (memcheck) -------------------------
# TWELLPY_LEDGER=path appends the node id of every test that passed, as soon as
# it finishes, under a hash of the code it ran; TWELLPY_LEDGER_DONE=glob deselects
# tests already in ledgers of the same code hash. A run killed by the per-call
# time limit so still counts, and the next call carries on from there.
_LEDGER_ROOTS = ("twellpy", "raw_kernels", "tests")


def _code_hash():
    """sha256 over the library, kernel and test sources (what a ledger vouches for)."""
    import hashlib
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for top in _LEDGER_ROOTS:
        for path in sorted((root / top).rglob("*")):
            if path.suffix in (".py", ".cu", ".cuh") and "__pycache__" not in path.parts:
                digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def _ledger_done(config, items):
    pattern = os.environ.get("TWELLPY_LEDGER_DONE")
    if not pattern:
        return
    import glob

    code, done = _code_hash(), set()
    for name in sorted(glob.glob(pattern)):
        with open(name) as f:
            lines = f.read().splitlines()
        if not lines or lines[0] != f"# code {code}":
            continue  # another version of the code: its results say nothing about this one
        # "ok <node id>\t<seconds>" (older ledgers have no seconds)
        done.update(line.split(" ", 1)[1].split("\t", 1)[0] for line in lines[1:]
                    if line and not line.startswith("#"))
    drop = [it for it in items if it.nodeid in done]
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = [it for it in items if it.nodeid not in done]


class _Ledger:
    def __init__(self, path):
        new = not os.path.exists(path) or os.path.getsize(path) == 0
        self._file = open(path, "a", buffering=1)
        if new:
            self._file.write(f"# code {_code_hash()}\n")
        self._failed = set()
        self._seconds = {}

    def pytest_runtest_logreport(self, report):
        # a skipped test vouches for nothing, so only passes count as done; the
        # seconds (setup + call + teardown) show where a sanitizer run's time goes
        self._seconds[report.nodeid] = self._seconds.get(report.nodeid, 0.0) + float(report.duration or 0.0)
        if report.failed or report.skipped:
            self._failed.add(report.nodeid)
        elif report.when == "teardown" and report.nodeid not in self._failed:
            self._file.write(f"ok {report.nodeid}\t{self._seconds.pop(report.nodeid, 0.0):.2f}\n")


def pytest_configure(config):
    path = os.environ.get("TWELLPY_LEDGER")
    if path and not hasattr(config, "workerinput"):  # the xdist controller sees every report
        config.pluginmanager.register(_Ledger(path), "twellpy-ledger")


def pytest_collection_modifyitems(config, items):
    _ledger_done(config, items)
    _shard(items, config)
    if HAS_GPU:
        return
    skip = pytest.mark.skip(reason="no CUDA GPU available")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


#: bytes a test may leave cached in CuPy's / torch's pools before they are emptied
_POOL_KEEP = 256 << 20


@pytest.fixture(autouse=True)
def _gpu_memory_lock(request):
    """Keep tests that may fill GPU memory away from the other xdist workers.

    Out-of-memory tests (and the biggest shapes) can hold nearly all device
    memory for a moment; a small allocation in a parallel worker then fails.
    Every GPU test holds a shared lock, ``gpu_exclusive`` tests an exclusive
    one, on a file unique to this pytest run.

    flock grants new shared locks while an exclusive one waits, so a busy
    suite could starve an exclusive test (and every test xdist queued behind
    it on that worker) for a whole device call. A second file, the gate,
    gives the writer priority: an exclusive test takes the gate first and
    holds it; shared tests pass through the gate only on their way in.
    """
    worker_run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not HAS_GPU or not worker_run or "gpu" not in request.keywords:
        yield
        return
    base = os.path.join(tempfile.gettempdir(), f"twellpy-gpu-{worker_run}")
    exclusive = "gpu_exclusive" in request.keywords
    with open(base + ".gate", "a+") as gate, open(base + ".lock", "a+") as lock:
        fcntl.flock(gate, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        if not exclusive:
            fcntl.flock(gate, fcntl.LOCK_UN)  # holds only the lock: a waiting writer goes next
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
            fcntl.flock(gate, fcntl.LOCK_UN)


@pytest.fixture(autouse=True)
def _return_gpu_memory(request):
    """Give cached GPU memory back after each GPU test.

    xdist runs many test processes on one GPU; each memory pool keeps the peak
    of its largest test, and together they starve the others (spurious
    out-of-memory failures). Emptying the pools only past _POOL_KEEP keeps
    small tests fast.
    """
    yield
    if not HAS_GPU or "gpu" not in request.keywords:
        return
    import gc
    import sys

    cp = sys.modules.get("cupy")
    torch = sys.modules.get("torch")
    if (cp is not None and cp.get_default_memory_pool().used_bytes() > _POOL_KEEP) or (
            torch is not None and torch.cuda.is_initialized() and torch.cuda.memory_allocated() > _POOL_KEEP):
        # memory still referenced after the test is usually a reference cycle (a caught
        # exception's traceback holding the frames of a huge request): collect it while this
        # test still holds its GPU lock, or the next tests run out of memory (2026-12-04)
        gc.collect()
    if cp is not None:
        pool = cp.get_default_memory_pool()
        if pool.total_bytes() > _POOL_KEEP:
            cp.cuda.Device().synchronize()
            pool.free_all_blocks()
    if torch is not None and torch.cuda.is_initialized() and torch.cuda.memory_reserved() > _POOL_KEEP:
        torch.cuda.empty_cache()


BACKENDS = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=BACKENDS)
def backend(request):
    """'cpu' or 'cuda'; the cuda case carries the gpu marker."""
    return request.param


@pytest.fixture
def xp(backend):
    if backend == "cuda":
        import cupy

        return cupy
    return np


def poison_gpu_pool(n_bytes=1 << 29):
    """Fill free blocks of CuPy's memory pool with 0xFF bytes (NaN in every float dtype,
    -1 in the integers), so that an output element a kernel forgets to write cannot pass.

    Blocks of several sizes, since the pool keeps free blocks in size bins. Does nothing
    under compute-sanitizer (``SANITIZE``): CuPy's pool is off there, so there is no free
    block to fill, and memcheck keeps the memory of arrays made inside CuPy's functions
    (``cp.full``): the 512 MiB of each call ran the card out of memory (2026-12-06, H100,
    ``docs/bench_logs/session23_2026-12-06``).
    """
    if SANITIZE or not HAS_GPU:
        return
    import cupy as cp

    blocks = []
    for size in (n_bytes, n_bytes // 8, 1 << 20, 1 << 16, 4096, 512):
        a = cp.empty(size, dtype=cp.uint8)
        a.fill(0xFF)
        blocks.append(a)
    cp.cuda.Device().synchronize()
    del a, blocks  # back to the pool, still full of 0xFF bytes


def rel_err(got, ref):
    """||got - ref|| / ||ref|| in float64 (numpy or cupy inputs)."""
    got = np.asarray(got.get() if hasattr(got, "get") else got, dtype=np.float64)
    ref = np.asarray(ref.get() if hasattr(ref, "get") else ref, dtype=np.float64)
    den = np.linalg.norm(ref)
    num = np.linalg.norm(got - ref)
    if den == 0:
        return float(num)
    return float(num / den)
