"""Thread safety: many threads using the same kernels give single-threaded bits.

CPU: every Numba kernel is ``nogil``, so Python threads really run them at
the same time. Eight threads start together (a barrier) and repeat the
container operations, ``twellpy.ops`` and the FFN forward/backward on shared
inputs; every result must equal the single-threaded one bit for bit, and the
shared inputs must be untouched. A subprocess with an empty Numba cache makes
several threads trigger the *first* compilation of the same kernels at once.

GPU (``gpu`` marker): eight threads ask ``_registry.get_kernel`` for a kernel
that nobody compiled yet (a fresh ``-D`` define forces a new module) and
must all receive the same ``RawKernel`` object; then eight threads run the
container operations on cupy inputs.
"""
import os
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import twellpy as tw
from _reliability_util import bits_equal, host
from _train_ref import to_gpu
from makers import MAKERS
from twellpy._array import bfloat16

#: compute-sanitizer runs (TWELLPY_SANITIZE) are much slower: fewer threads and repeats there
SANITIZE = bool(os.environ.get("TWELLPY_SANITIZE"))
N_THREADS = 4 if SANITIZE else 8
REPEATS = 1 if SANITIZE else 3


def _same(a, b):
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_same(u, v) for u, v in zip(a, b))
    if isinstance(a, tw.SparseArray):
        return a.format == b.format and all(bits_equal(getattr(a, k), getattr(b, k)) for k in a._array_names)
    return bits_equal(a, b)


def run_in_threads(fn, n_threads=N_THREADS, repeats=REPEATS):
    """fn() from n_threads threads started together; returns every result (re-raises errors)."""
    barrier = threading.Barrier(n_threads)
    results = [None] * n_threads
    errors = []

    def worker(i):
        try:
            barrier.wait(timeout=60)
            results[i] = [fn() for _ in range(repeats)]
        except BaseException as e:  # noqa: BLE001 - reported below with the thread id
            errors.append((i, e))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not any(t.is_alive() for t in threads), "a worker thread hung"
    if errors:
        raise AssertionError(f"thread {errors[0][0]} failed") from errors[0][1]
    return [r for rs in results for r in rs]


def _workload(xp_put, dtype):
    """Shared inputs and a list of (name, fn) operations on them."""
    rng = np.random.default_rng(5)
    x = MAKERS["over_capacity"](rng).astype(dtype)
    hot = MAKERS["one_hot_row"](rng).astype(dtype)
    m, n = x.shape
    W = xp_put(rng.standard_normal((n, 6)).astype(dtype))
    G = xp_put(rng.standard_normal((m, 6)).astype(dtype))
    X = xp_put(rng.standard_normal((m, 3)).astype(dtype))
    Y = xp_put(rng.standard_normal((n, 3)).astype(dtype))
    xd, hotd = xp_put(x), xp_put(hot)
    A = tw.TwELL.from_dense(xd, slots=16)
    H = tw.Hybrid.from_dense(hotd, width=8)
    f = np.random.default_rng(6)
    fx = f.standard_normal((96, 16))
    fx[:, 0] = 1.0
    fx[::11, 0] = -5.0
    wg = f.standard_normal((128, 16)) / 4
    wg[:, 0] = -1.0
    wu = f.standard_normal((128, 16)) / 4
    wd = f.standard_normal((16, 128)) / 11
    dy = f.standard_normal((96, 16))
    fx, wg, wu, wd, dy = (xp_put(a.astype(dtype)) for a in (fx, wg, wu, wd, dy))

    def train():
        y, ctx = tw.ffn.gated_forward_train(fx, wg, wu, wd, l1=1e-3, width=4)
        return (y,) + tuple(tw.ffn.gated_backward(ctx, dy))

    ops = [
        ("TwELL.from_dense", lambda: tw.TwELL.from_dense(xd, slots=16)),
        ("ELL.from_dense", lambda: tw.ELL.from_dense(hotd)),
        ("Hybrid.from_dense", lambda: tw.Hybrid.from_dense(hotd)),
        ("asformat", lambda: A.asformat("hybrid", width=3)),
        ("transpose", lambda: A.T),
        ("toarray", lambda: H.toarray()),
        ("A @ W", lambda: A @ W),
        ("G.T @ A", lambda: A.__rmatmul__(G.T)),
        ("ops.spmm", lambda: tw.ops.spmm(H, xp_put(np.ones((hot.shape[1], 2), dtype)))),
        ("ops.spmm_t", lambda: tw.ops.spmm_t(A, G)),
        ("ops.sddmm", lambda: tw.ops.sddmm(X, Y, A)),
        ("ops.transpose", lambda: tw.ops.transpose(H)),
        ("ffn.gated_forward", lambda: tw.ffn.gated_forward(fx, wg, wu, wd, mode="sparse", return_activations=True)),
        ("ffn.relu_forward", lambda: tw.ffn.relu_forward(fx, wu, wd, mode="auto")),
        ("ffn train", train),
    ]
    shared = [xd, hotd, W, G, X, Y, fx, wg, wu, wd, dy, A.values, A.indices, A.counts, A.backup]
    return ops, shared


def _check_ops_concurrently(ops, shared):
    before = [host(a).copy() for a in shared]
    singles = {name: fn() for name, fn in ops}
    for name, fn in ops:  # each op hammered alone: the same kernel from every thread
        for r in run_in_threads(fn):
            assert _same(r, singles[name]), f"{name}: a threaded result differs from the single-threaded one"

    def mixed():  # all ops in a thread-dependent order: different kernels at once
        k = threading.get_ident() % len(ops)
        order = ops[k:] + ops[:k]
        return {name: fn() for name, fn in order}

    for res in run_in_threads(mixed, repeats=1):
        for name, r in res.items():
            assert _same(r, singles[name]), f"{name} (mixed) differs"
    for a, b in zip(before, shared):
        assert bits_equal(a, host(b)), "a shared input was modified"


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), bfloat16], ids=str)
def test_cpu_kernels_from_many_threads(dtype):
    ops, shared = _workload(lambda a: a, dtype)
    _check_ops_concurrently(ops, shared)


def test_cpu_first_compilation_from_many_threads(tmp_path):
    """Threads race to compile the same Numba kernels in a fresh cache."""
    code = textwrap.dedent("""
        import threading, numpy as np, twellpy as tw
        x = np.zeros((37, 300), np.float32); x[::3, ::7] = 1.5; x[5] = 2.0
        ref = None; out = []; errs = []
        barrier = threading.Barrier(4)
        def work():
            try:
                barrier.wait()
                A = tw.TwELL.from_dense(x, slots=8)
                out.append((A.toarray().tobytes(), (A @ np.ones((300, 2), np.float32)).tobytes()))
            except BaseException as e:
                errs.append(repr(e))
        ts = [threading.Thread(target=work) for _ in range(4)]
        [t.start() for t in ts]; [t.join() for t in ts]
        assert not errs, errs
        assert len(out) == 4 and len(set(out)) == 1, "results differ between threads"
        A = tw.TwELL.from_dense(x, slots=8)
        assert out[0] == (A.toarray().tobytes(), (A @ np.ones((300, 2), np.float32)).tobytes())
        assert np.array_equal(A.toarray(), x)
        print("ok")
    """)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba_cache"),
               PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                           os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr


# ---- GPU ----------------------------------------------------------------------
@pytest.mark.gpu
def test_registry_get_kernel_from_many_threads():
    from twellpy.backends import _registry

    import twellpy.backends.cuda  # noqa: F401  - declares the container kernels
    decl = _registry.declared()
    assert decl, "no kernel is declared"
    source, entries = next(iter(sorted(decl.items())))
    names, defines = entries[0]
    name = names[0]
    tag = {"TWELLPY_CONCURRENCY_TEST": int(threading.get_ident() % 100000) + 1}
    # a define nobody used before: every thread asks for a kernel that is not compiled yet
    kernels = run_in_threads(lambda: _registry.get_kernel(source, name, **defines, **tag), repeats=2)
    assert all(k is kernels[0] for k in kernels), "threads received different kernel objects"
    again = _registry.get_kernel(source, name, **defines, **tag)
    assert again is kernels[0]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), bfloat16], ids=str)
def test_gpu_container_ops_from_many_threads(dtype):
    ops, shared = _workload(to_gpu, dtype)
    _check_ops_concurrently(ops, shared)
    # and the GPU results equal the CPU ones for the exact operations
    cpu_ops, _ = _workload(lambda a: a, dtype)
    for (name, fn), (_, cfn) in zip(ops, cpu_ops):
        if name in ("TwELL.from_dense", "ELL.from_dense", "Hybrid.from_dense", "asformat", "transpose",
                    "toarray", "ops.transpose"):
            g, c = fn(), cfn()
            assert _same(g, c) if not isinstance(g, tw.SparseArray) else _same(g.to_device("cpu"), c), name
