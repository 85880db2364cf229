"""twellpy.dask on a real dask.distributed LocalCluster (worker processes, CPU backend).

One module-scoped cluster of two single-threaded worker processes serves every
distributed test; tests that kill a worker wait for the nanny to restart it.
"""
import os
import pickle
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import scipy.sparse as sp

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")

import dask  # noqa: E402

import twellpy as tw  # noqa: E402
import twellpy.dask as twd  # noqa: E402
from conftest import RTOL, rel_err  # noqa: E402

FORMAT_PARAMS = [
    ("twell", {"tile": 16, "slots": 4}),
    ("ell", {}),
    ("hybrid", {"width": "auto"}),
]


# ----------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------
def sparse_rows(m, n, seed, density=0.08, dtype=np.float32):
    """Random sparse matrix with uneven rows: a few hot rows overflow any tile."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, n)).astype(dtype)
    keep = rng.random((m, n)) < density
    hot = rng.choice(m, size=max(1, m // 20), replace=False)
    keep[hot] = rng.random((hot.size, n)) < 0.7  # rows that overflow TwELL slots and ELL width
    x[~keep] = 0
    if m > 3:
        x[3] = 0  # an all-zero row
    return x


def ffn_problem(m, d, h, seed, active=12, dtype=np.float32):
    """x, w_gate, w_up, w_down per docs/workloads.md, about ``active`` gate positives per row."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, d)).astype(np.float64)
    x[:, 0] = 1.0
    w_gate = rng.standard_normal((h, d)) / np.sqrt(d - 1)
    w_up = rng.standard_normal((h, d)) / np.sqrt(d)
    w_down = rng.standard_normal((d, h)) / np.sqrt(h)
    pre = x[:, 1:] @ w_gate[:, 1:].T
    t = np.quantile(pre, 1.0 - active / h)  # threshold that leaves ~active positives per row
    w_gate[:, 0] = -t
    return tuple(a.astype(dtype) for a in (x, w_gate, w_up, w_down))


def by_chunks(func, x, rows, *args):
    """``func`` applied to consecutive row chunks of ``x`` in this process, concatenated."""
    return np.concatenate([func(x[s:s + rows], *args) for s in range(0, x.shape[0], rows)])


def slow_identity(block, delay):
    """Identity that takes ``delay`` seconds: keeps a task running while a worker is killed."""
    time.sleep(delay)
    return block


# ----------------------------------------------------------------------------
# cluster
# ----------------------------------------------------------------------------
def _warm_numba_cache():
    """Compile (or load) the CPU kernels here once, so the worker processes load
    them from Numba's on-disk cache instead of each compiling them again."""
    x = sparse_rows(40, 24, seed=0)
    w = np.ones((24, 3), np.float32)
    for fmt, params in FORMAT_PARAMS:
        a = {"twell": tw.TwELL, "ell": tw.ELL, "hybrid": tw.Hybrid}[fmt].from_dense(x, **params)
        a.toarray(), a.to_scipy(), a @ w
    xf, w_gate, w_up, w_down = ffn_problem(30, 16, 64, seed=0)
    tw.ffn.gated_forward(xf, w_gate, w_up, w_down)
    tw.ffn.relu_forward(xf, w_up, w_down)


@pytest.fixture(scope="module")
def client():
    from distributed import Client, LocalCluster

    _warm_numba_cache()
    # A loaded 2-core CI machine can stall a worker for many seconds (Numba
    # compiles, other processes): generous timeouts keep the scheduler from
    # declaring a slow-but-alive worker lost, which surfaced as "lost
    # dependencies". No memory limit: the nanny must not kill a worker mid-test.
    cfg = {"distributed.scheduler.worker-ttl": None,
           "distributed.comm.timeouts.connect": "120s",
           "distributed.comm.timeouts.tcp": "300s",
           "distributed.scheduler.allowed-failures": 10}
    with dask.config.set(cfg):
        cluster = LocalCluster(n_workers=2, processes=True, threads_per_worker=1,
                               dashboard_address=":0", silence_logs=40, memory_limit=0)
        c = Client(cluster)
        try:
            yield c
        finally:
            c.close()
            cluster.close()


def _wait_for_workers(client, n):
    # a killed worker is restarted by its nanny; that takes a while on a loaded machine
    client.wait_for_workers(n, timeout=180)


# ----------------------------------------------------------------------------
# import hygiene
# ----------------------------------------------------------------------------
def test_import_twellpy_does_not_import_dask():
    code = "import sys, twellpy; bad = [m for m in ('dask', 'distributed') if m in sys.modules]; print(bad)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# ----------------------------------------------------------------------------
# containers
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,params", FORMAT_PARAMS)
def test_from_dask_round_trip_uneven_chunks(client, fmt, params):
    x = sparse_rows(103, 40, seed=1)
    dx = da.from_array(x, chunks=(17, 40))  # 103 = 6*17 + 1: a 1-row last chunk
    A = twd.from_dask(dx, fmt, **params)
    assert A.shape == x.shape and A.dtype == x.dtype and A.format == fmt
    assert A.chunks[0] == dx.chunks[0] and A.npartitions == 7
    meta_class = {"twell": tw.TwELL, "ell": tw.ELL, "hybrid": tw.Hybrid}[fmt]
    assert isinstance(A.blocks._meta, meta_class) and A.blocks._meta.shape == (0, 40)

    dense = A.to_dense()
    assert dense.chunks == dx.chunks and dense.dtype == x.dtype and type(dense._meta) is np.ndarray
    np.testing.assert_array_equal(dense.compute(), x)

    whole = A.compute()
    assert type(whole).format == fmt and whole.shape == x.shape
    whole.check_format(full_check=True)
    np.testing.assert_array_equal(whole.toarray(), x)
    direct = type(whole).from_dense(x, **params)
    assert whole.nnz == direct.nnz == np.count_nonzero(x)
    if fmt != "hybrid":  # row-local layout: chunked build == direct build, bit for bit
        for name, arr in direct.components().items():
            got = whole.components()[name]
            if isinstance(arr, np.ndarray):
                np.testing.assert_array_equal(got, arr, err_msg=name)

    mats = dask.compute(*A.to_scipy("csr"))
    assert len(mats) == 7 and all(sp.issparse(m) for m in mats)
    np.testing.assert_array_equal(sp.vstack(mats).toarray(), x)


def test_container_chunks_through_dask_dispatch(client):
    """concatenate_lookup and tensordot_lookup registrations: plain dask.array code works."""
    x = sparse_rows(50, 33, seed=2)
    w = np.random.default_rng(3).standard_normal((33, 5)).astype(np.float32)
    A = twd.from_dask(da.from_array(x, chunks=(12, 33)), "twell", tile=8, slots=2)
    whole = A.blocks.compute()  # dask concatenates container chunks through concatenate_lookup
    assert isinstance(whole, tw.TwELL)
    np.testing.assert_array_equal(whole.toarray(), x)
    y = da.tensordot(A.blocks, w, axes=1).compute()
    np.testing.assert_allclose(y, x.astype(np.float64) @ w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt,params", FORMAT_PARAMS)
def test_matmul_equals_single_process(client, fmt, params):
    x = sparse_rows(91, 48, seed=4)
    w = np.random.default_rng(5).standard_normal((48, 7)).astype(np.float32)
    A = twd.from_dask(da.from_array(x, chunks=(20, 48)), fmt, **params)
    y = A @ w
    assert y.shape == (91, 7) and y.chunks == ((20, 20, 20, 20, 11), (7,))
    assert y.dtype == np.float32 and type(y._meta) is np.ndarray
    got = y.compute()
    # chunk by chunk, the same calls as a single process: identical bits
    cls = type(A.compute())
    want = np.concatenate([cls.from_dense(x[s:s + 20], **params) @ w for s in range(0, 91, 20)])
    np.testing.assert_array_equal(got, want)
    assert rel_err(got, x.astype(np.float64) @ w) < RTOL[np.dtype(np.float32)]


def test_persist_keeps_chunks_on_workers(client):
    x = sparse_rows(60, 30, seed=6)
    A = twd.from_dask(da.from_array(x, chunks=(25, 30)), "hybrid").persist()
    assert isinstance(A, twd.SparseDaskArray)
    futures = [v for v in dict(A.__dask_graph__()).values()]
    assert len(futures) == 3 and all(isinstance(f, distributed.Future) for f in futures)
    np.testing.assert_array_equal(A.to_dense().compute(), x)


# ----------------------------------------------------------------------------
# FFN inference
# ----------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["gated", "relu"])
def test_ffn_equals_single_process(client, kind):
    x, w_gate, w_up, w_down = ffn_problem(157, 32, 96, seed=7)
    dx = da.from_array(x, chunks=(40, 32))  # 157 = 3*40 + 37
    if kind == "gated":
        y = twd.gated_forward(dx, w_gate, w_up, w_down)
        direct = tw.ffn.gated_forward(x, w_gate, w_up, w_down)
        per_chunk = [tw.ffn.gated_forward(x[s:s + 40], w_gate, w_up, w_down) for s in range(0, 157, 40)]
        x64 = x.astype(np.float64)
        hidden = np.maximum(x64 @ w_gate.T.astype(np.float64), 0) * (x64 @ w_up.T.astype(np.float64))
        ref = hidden @ w_down.T
    else:
        y = twd.relu_forward(dx, w_up, w_down)
        direct = tw.ffn.relu_forward(x, w_up, w_down)
        per_chunk = [tw.ffn.relu_forward(x[s:s + 40], w_up, w_down) for s in range(0, 157, 40)]
        ref = np.maximum(x.astype(np.float64) @ w_up.T, 0) @ w_down.T.astype(np.float64)
    assert y.shape == (157, 32) and y.chunks == ((40, 40, 40, 37), (32,))
    assert y.dtype == direct.dtype and type(y._meta) is np.ndarray
    got = y.compute()
    np.testing.assert_array_equal(got, np.concatenate(per_chunk))
    assert rel_err(got, direct) < RTOL[np.dtype(np.float32)]
    assert rel_err(got, ref) < RTOL[np.dtype(np.float32)]


@pytest.mark.parametrize("kind", ["gated", "relu"])
@pytest.mark.parametrize("persisted_input", [True, False], ids=["persisted-x", "lazy-x"])
def test_ffn_persist_submits_now_and_matches_lazy(client, kind, persisted_input):
    """persist=True: one submitted task per chunk, same values as the lazy graph."""
    x, w_gate, w_up, w_down = ffn_problem(131, 24, 80, seed=23)
    dx = da.from_array(x, chunks=(30, 24))  # 131 = 4*30 + 11
    if persisted_input:
        dx = client.persist(dx)
    ws = (w_gate, w_up, w_down) if kind == "gated" else (w_up, w_down)
    fn = twd.gated_forward if kind == "gated" else twd.relu_forward
    shared = [twd.share(w, f"w{i}", client=client) for i, w in enumerate(ws)]
    lazy = fn(dx, *shared, name=f"lazy-{kind}-{persisted_input}")
    eager = fn(dx, *shared, name=f"eager-{kind}-{persisted_input}", persist=True)
    futures = distributed.futures_of(eager)
    # every chunk is already a future: the work started without compute()/persist()
    assert len(futures) == 5 and all(isinstance(f, distributed.Future) for f in futures)
    assert eager.chunks == ((30, 30, 30, 30, 11), (24,)) and eager.dtype == lazy.dtype
    assert type(eager._meta) is np.ndarray
    distributed.wait(futures)
    got, want = eager.compute(), lazy.compute()
    np.testing.assert_array_equal(got, want)
    direct = (tw.ffn.gated_forward if kind == "gated" else tw.ffn.relu_forward)(x, *ws)
    assert rel_err(got, direct) < RTOL[np.dtype(np.float32)]
    # the result composes with ordinary dask code
    np.testing.assert_array_equal((eager[:50] * 2).compute(), want[:50] * 2)


def test_ffn_persist_needs_a_client_and_scattered_weights(client):
    x, w_gate, w_up, w_down = ffn_problem(20, 8, 16, seed=24)
    dx = da.from_array(x, chunks=(5, 8))
    with pytest.raises(ValueError, match="persist=True needs a distributed.Client"):
        twd.gated_forward(dx, w_gate, w_up, w_down, client=False, persist=True)
    local = [twd.share(w, "w", client=False) for w in (w_gate, w_up, w_down)]
    with pytest.raises(ValueError, match="persist=True needs weights shared through a client"):
        twd.gated_forward(dx, *local, client=client, persist=True)
    with pytest.raises(TypeError, match="persist must be a bool"):
        twd.gated_forward(dx, w_gate, w_up, w_down, client=client, persist="yes")


def test_distinct_calls_get_distinct_keys(client):
    """Two FFN calls on different data never share output keys (would silently mix results)."""
    x, w_gate, w_up, w_down = ffn_problem(64, 16, 48, seed=19)
    x2 = x[::-1].copy()
    dx, dx2 = da.from_array(x, chunks=(16, 16)), da.from_array(x2, chunks=(16, 16))
    y1 = twd.gated_forward(dx, w_gate, w_up, w_down)
    y2 = twd.gated_forward(dx2, w_gate, w_up, w_down)
    y3 = twd.relu_forward(dx, w_up, w_down)
    y4 = twd.gated_forward(dx, w_gate, w_up * 2, w_down)
    assert len({y1.name, y2.name, y3.name, y4.name}) == 4
    assert twd.gated_forward(dx, w_gate, w_up, w_down).name == y1.name  # deterministic
    assert twd.gated_forward(dx, w_gate, w_up, w_down, name="fresh").name == "fresh"
    g1, g2, g3, g4 = dask.compute(y1, y2, y3, y4)
    np.testing.assert_array_equal(g1, by_chunks(tw.ffn.gated_forward, x, 16, w_gate, w_up, w_down))
    np.testing.assert_array_equal(g2, by_chunks(tw.ffn.gated_forward, x2, 16, w_gate, w_up, w_down))
    np.testing.assert_array_equal(g3, by_chunks(tw.ffn.relu_forward, x, 16, w_up, w_down))
    np.testing.assert_array_equal(g4, by_chunks(tw.ffn.gated_forward, x, 16, w_gate, w_up * 2, w_down))


@pytest.fixture
def amm_stopped(client):
    """distributed's Active Memory Manager drops idle replicas of broadcast
    weights within seconds; tests of where data sits stop it meanwhile."""
    client.amm.stop()
    try:
        yield client
    finally:
        client.amm.start()


def test_weights_reach_each_worker_once(amm_stopped):
    client = amm_stopped
    x, w_gate, w_up, w_down = ffn_problem(240, 32, 128, seed=8)
    shared = [twd.share(w, name) for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down))]
    assert all(isinstance(s.ref, distributed.Future) for s in shared)
    dx = da.from_array(x, chunks=(20, 32))  # 12 chunk tasks for 2 workers
    y = twd.gated_forward(dx, *shared)
    graph = dict(y.__dask_graph__())
    ffn_keys = [k for k in graph if isinstance(k, tuple) and "gated-forward" in k[0]]
    assert len(ffn_keys) == 12
    for k in ffn_keys:  # every chunk task depends on the one shared key of each weight
        assert {s.key for s in shared} <= set(graph[k].dependencies)
    for k, task in graph.items():  # and no task carries a copy of a weight
        assert len(pickle.dumps(task)) < w_up.nbytes // 2, k
    want = np.concatenate([tw.ffn.gated_forward(x[s:s + 20], w_gate, w_up, w_down)
                           for s in range(0, 240, 20)])
    np.testing.assert_array_equal(y.compute(), want)
    # every worker holds each weight, and received it at most once (broadcast puts it
    # there up front; a worker the broadcast had not reached yet fetches it once)
    workers = set(client.scheduler_info()["workers"])
    for s in shared:
        assert set(client.who_has(s.ref)[s.key]) == workers
    fetched = client.run(lambda dask_worker: [k for ev in dask_worker.transfer_incoming_log
                                              for k in ev["keys"]])
    for s in shared:
        for addr, keys in fetched.items():
            assert keys.count(s.key) <= 1, (addr, s.key, keys)
    # sharing again gives a fresh key: a hashed key would be shared with the
    # futures above, and their release could delete data a later call needs
    assert twd.share(w_up, "w_up").key != shared[1].key


def _prepared_ffn_count():
    return sum(len(cache) for cache in twd._FFN_CACHES.values())


def test_dropped_weight_replicas_do_not_rebuild_the_ffn(client):
    """The Active Memory Manager drops idle broadcast replicas; a worker that
    receives a weight again (a new object) still reuses its prepared FFN."""
    x, w_gate, w_up, w_down = ffn_problem(120, 16, 64, seed=26)
    shared = [twd.share(w, n, client=client) for n, w in (("w_gate", w_gate), ("w_up", w_up),
                                                           ("w_down", w_down))]
    dx = da.from_array(x, chunks=(20, 16))
    client.run(twd.clear_ffn_cache)
    first = twd.gated_forward(dx, *shared, name="amm-first").compute()
    built = client.run(_prepared_ffn_count)
    assert sum(built.values()) >= 1
    # wait until the manager has dropped the extra replicas (it runs every 2 s)
    deadline = time.time() + 30
    while any(len(client.who_has(s.ref)[s.key]) > 1 for s in shared) and time.time() < deadline:
        time.sleep(0.2)
    again = twd.gated_forward(dx, *shared, name="amm-again").compute()
    np.testing.assert_array_equal(again, first)
    after = client.run(_prepared_ffn_count)
    for addr, n in after.items():  # no worker prepared the same weights a second time
        assert n <= max(built.get(addr, 0), 1), (addr, built, after)


def test_weights_are_one_graph_key_without_client(client):
    x, w_gate, w_up, w_down = ffn_problem(90, 16, 64, seed=9)
    dx = da.from_array(x, chunks=(10, 16))
    y = twd.gated_forward(dx, w_gate, w_up, w_down, client=False)
    graph = dict(y.__dask_graph__())
    holders = [k for k, t in graph.items() if getattr(t, "value", None) is w_up]
    assert len(holders) == 1
    for k, task in graph.items():
        if getattr(task, "value", None) is None:
            assert len(pickle.dumps(task)) < w_up.nbytes // 2, k
    got = y.compute(scheduler="sync")
    want = np.concatenate([tw.ffn.gated_forward(x[s:s + 10], w_gate, w_up, w_down) for s in range(0, 90, 10)])
    np.testing.assert_array_equal(got, want)


def test_bad_chunk_data_raises_on_compute(client):
    x = sparse_rows(40, 16, seed=12)
    x[33, 5] = np.nan
    A = twd.from_dask(da.from_array(x, chunks=(10, 16)), "ell")
    with pytest.raises(ValueError, match="NaN"):
        A.to_dense().compute()
    B = twd.from_dask(da.from_array(x, chunks=(10, 16)), "ell", check_finite=False)
    got = B.to_dense().compute()
    np.testing.assert_array_equal(np.isnan(got), np.isnan(x))


# ----------------------------------------------------------------------------
# failures
# ----------------------------------------------------------------------------
def _kill_a_busy_worker(client, prefix, timeout=30.0):
    """Wait until a worker is running a task whose key contains ``prefix``; kill it.

    (Blockwise fusion runs ``slow_identity`` inside the final layer's tasks, so
    ``prefix`` is the name of the collection being computed.)"""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for addr, keys in client.processing().items():
            if any(prefix in str(k) for k in keys):
                time.sleep(0.2)  # let the task start running
                client.run(os._exit, 1, workers=[addr], on_error="ignore")
                return addr
        time.sleep(0.02)
    raise AssertionError(f"no task with prefix {prefix!r} started within {timeout} s")


def test_worker_killed_mid_computation_completes(client):
    _wait_for_workers(client, 2)  # a survivor must remain
    x, w_gate, w_up, w_down = ffn_problem(120, 16, 64, seed=10)
    dx = da.from_array(x, chunks=(20, 16)).map_blocks(slow_identity, 0.6, dtype=x.dtype)
    y = twd.gated_forward(dx, w_gate, w_up, w_down)
    future = client.compute(y)
    killed = _kill_a_busy_worker(client, y.name)
    got = future.result(timeout=60)
    assert killed not in client.scheduler_info()["workers"]  # the kill really happened
    want = by_chunks(tw.ffn.gated_forward, x, 20, w_gate, w_up, w_down)
    np.testing.assert_array_equal(got, want)


def test_worker_killed_without_retries_fails_clearly(client):
    # the last test that uses the cluster: it does not wait for the killed worker's restart
    _wait_for_workers(client, 1)
    from distributed.scheduler import KilledWorker

    def set_allowed(dask_scheduler, n):
        old = dask_scheduler.allowed_failures
        dask_scheduler.allowed_failures = n
        return old

    old = client.run_on_scheduler(set_allowed, n=0)
    try:
        x = sparse_rows(80, 24, seed=11)
        dx = da.from_array(x, chunks=(20, 24)).map_blocks(slow_identity, 0.6, dtype=x.dtype)
        dense = twd.from_dask(dx, "twell", tile=8, slots=2).to_dense()
        future = client.compute(dense)
        _kill_a_busy_worker(client, dense.name)
        with pytest.raises(KilledWorker, match="died"):
            future.result(timeout=60)
    finally:
        client.run_on_scheduler(set_allowed, n=old)


# ----------------------------------------------------------------------------
# bad input (no cluster needed)
# ----------------------------------------------------------------------------
def test_bad_input_messages():
    x = sparse_rows(30, 12, seed=13)
    with pytest.raises(TypeError, match="dask.array.Array"):
        twd.from_dask(x)
    with pytest.raises(ValueError, match="2-D"):
        twd.from_dask(da.zeros((5,), chunks=2, dtype=np.float32))
    multi = da.from_array(x, chunks=(10, 5))
    with pytest.raises(ValueError, match="3 column chunks"):
        twd.from_dask(multi, rechunk=False)
    A = twd.from_dask(multi, "ell")  # rechunked to one column chunk
    assert A.chunks == ((10, 10, 10), (12,))
    np.testing.assert_array_equal(A.to_dense().compute(scheduler="sync"), x)
    with pytest.raises(ValueError, match="unknown format 'csr'"):
        twd.from_dask(da.from_array(x), "csr")
    with pytest.raises(TypeError, match="x has dtype int64"):
        twd.from_dask(da.from_array(np.zeros((4, 4), np.int64)))
    with pytest.raises(ValueError, match="unknown chunk sizes"):
        dx = da.from_array(x, chunks=(10, 12))
        twd.from_dask(dx[dx[:, 0] > 0])
    with pytest.raises(TypeError, match="unexpected keyword argument 'no_such_parameter'"):
        twd.from_dask(da.from_array(x), "twell", no_such_parameter=1)
    with pytest.raises(ValueError, match="w has shape"):
        A @ np.zeros((11, 3), np.float32)

    xf, w_gate, w_up, w_down = ffn_problem(20, 8, 16, seed=14)
    dxf = da.from_array(xf, chunks=(5, 8))
    with pytest.raises(ValueError, match="w_up has shape"):
        twd.gated_forward(dxf, w_gate, w_up[:, :7], w_down, client=False)
    with pytest.raises(ValueError, match="w_down has shape"):
        twd.relu_forward(dxf, w_up, w_down[:, :15], client=False)
    with pytest.raises(ValueError, match="w_gate must be 2-D"):
        twd.gated_forward(dxf, w_gate[0], w_up, w_down, client=False)
    with pytest.raises(TypeError, match="w_down has dtype int32"):
        twd.relu_forward(dxf, w_up, w_down.astype(np.int32), client=False)
    with pytest.raises(TypeError, match="w_up has dtype float64 but x has dtype float32"):
        twd.relu_forward(dxf, w_up.astype(np.float64), w_down, client=False)
    with pytest.raises(ValueError, match="return_activations"):
        twd.relu_forward(dxf, w_up, w_down, client=False, return_activations=True)
    with pytest.raises(TypeError, match="'heavy'"):
        twd.relu_forward(dxf, w_up, w_down, client=False, heavy=3)


def test_concatenate_checks_parts():
    x = sparse_rows(20, 12, seed=15)
    a = tw.ELL.from_dense(x[:10])
    b = tw.TwELL.from_dense(x[10:], tile=4, slots=2)
    with pytest.raises(TypeError, match="format 'twell', expected 'ell'"):
        twd.concatenate([a, b])
    with pytest.raises(ValueError, match="columns"):
        twd.concatenate([a, tw.ELL.from_dense(x[10:, :11])])
    with pytest.raises(ValueError, match="axis"):
        twd.concatenate([a, a], axis=1)
    with pytest.raises(ValueError, match="empty"):
        twd.concatenate([])
    c = twd.concatenate([b, tw.TwELL.from_dense(x[:10], tile=4, slots=5)])  # slots padded to 5
    np.testing.assert_array_equal(c.toarray(), np.concatenate([x[10:], x[:10]]))
    c.check_format(full_check=True)


# ----------------------------------------------------------------------------
# GPU (cupy chunks, threaded scheduler)
# ----------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("fmt,params", FORMAT_PARAMS)
def test_cupy_chunks(fmt, params):
    import cupy as cp

    x = sparse_rows(203, 70, seed=16)
    w = np.random.default_rng(17).standard_normal((70, 9)).astype(np.float32)
    poison = cp.full((16, 1 << 20), cp.nan, cp.float32)  # freed blocks hold NaN (see test_cupy_ffn)
    del poison
    dx = da.from_array(cp.asarray(x), chunks=(64, 70), asarray=False)
    A = twd.from_dask(dx, fmt, **params)
    dense = A.to_dense()
    assert type(dense._meta) is cp.ndarray
    np.testing.assert_array_equal(cp.asnumpy(dense.compute(scheduler="threads")), x)
    y = A.matmul(cp.asarray(w), client=False)
    assert type(y._meta) is cp.ndarray
    assert rel_err(y.compute(scheduler="threads"), x.astype(np.float64) @ w) < RTOL[np.dtype(np.float32)]
    whole = A.compute(scheduler="threads")
    assert whole.device.startswith("cuda")
    np.testing.assert_array_equal(cp.asnumpy(whole.toarray()), x)


@pytest.mark.gpu
def test_cupy_ffn():
    import cupy as cp

    x, w_gate, w_up, w_down = ffn_problem(300, 64, 256, seed=18)
    xg, wg = cp.asarray(x), [cp.asarray(w) for w in (w_gate, w_up, w_down)]
    # poison the memory pool: blocks freed here hold NaN, so an output element the
    # kernels forget to write shows up as NaN in the result
    poison = cp.full((16, 1 << 20), cp.nan, cp.float32)
    del poison
    y = twd.gated_forward(da.from_array(xg, chunks=(128, 64), asarray=False), *wg, client=False)
    assert type(y._meta) is cp.ndarray
    got = y.compute(scheduler="threads")
    assert not bool(cp.isnan(got).any())
    want = tw.ffn.gated_forward(xg, *wg)
    assert rel_err(got, want) < RTOL[np.dtype(np.float32)]
    x64 = x.astype(np.float64)
    ref = (np.maximum(x64 @ w_gate.T, 0) * (x64 @ w_up.T)) @ w_down.T.astype(np.float64)
    assert rel_err(got, ref) < RTOL[np.dtype(np.float32)]


def test_void_transport_is_viewed_back_as_bfloat16():
    # distributed ships a cupy bfloat16 array as raw '<V2' voids; chunk tasks view it back
    from twellpy._array import bfloat16

    a = np.arange(12, dtype=np.float32).reshape(3, 4).astype(bfloat16)
    voids = a.view(np.dtype("V2"))
    back = twd._restore_dtype(voids, twd._dtype_named("bfloat16"))
    assert back.dtype == np.dtype(bfloat16)
    np.testing.assert_array_equal(back.astype(np.float32), a.astype(np.float32))
    # a genuine dtype mismatch is left alone (the FFN then names it), also a real
    # bfloat16 where float16 was promised (ml_dtypes' bfloat16 is a kind-"V" dtype)
    f32 = np.zeros((2, 2), np.float32)
    assert twd._restore_dtype(f32, np.dtype(np.float16)) is f32
    assert twd._restore_dtype(a, np.dtype(np.float16)) is a
    u16 = a.view(np.uint16)
    assert twd._restore_dtype(u16, np.dtype(np.float16)) is u16


def test_repaired_weights_hit_the_prepared_ffn_cache():
    # weights that arrive as uint16 carriers are viewed back per task; the
    # prepared FFN must still be built once per weight set, not once per task
    from twellpy._array import bfloat16

    x, w_gate, w_up, w_down = ffn_problem(40, 16, 64, seed=23)
    carriers = [w.astype(bfloat16).view(np.uint16) for w in (w_gate, w_up, w_down)]
    xb = x.astype(bfloat16)
    twd.clear_ffn_cache()
    y1 = twd._ffn_chunk(xb, *carriers, kind="gated", ffn_kwargs={}, in_dtype="bfloat16")
    first = dict(twd._FFN_CACHES[threading.get_ident()])
    y2 = twd._ffn_chunk(xb.view(np.uint16), *carriers, kind="gated", ffn_kwargs={}, in_dtype="bfloat16")
    assert len(first) == 1 and dict(twd._FFN_CACHES[threading.get_ident()]) == first
    assert y1.dtype == np.dtype(bfloat16)
    np.testing.assert_array_equal(y1.view(np.uint16), y2.view(np.uint16))
    want = tw.ffn.gated_forward(xb, *[c.view(bfloat16) for c in carriers])
    np.testing.assert_array_equal(y1.view(np.uint16), want.view(np.uint16))
    twd.clear_ffn_cache()


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["cuda", "dask"])
def test_cupy_bfloat16_survives_distributed_serialization(family):
    import cupy as cp
    from distributed.protocol import deserialize, serialize

    from twellpy._array import bfloat16

    twd._install_bf16_serializers()  # what share() and chunk tasks do before cupy data move
    a = cp.asarray(np.linspace(-3, 3, 40, dtype=np.float32).reshape(5, 8).astype(bfloat16))
    header, frames = serialize(a, serializers=[family])
    back = deserialize(header, frames, deserializers=[family])
    assert back.dtype == np.dtype(bfloat16)
    np.testing.assert_array_equal(cp.asnumpy(back.view(cp.uint16)), cp.asnumpy(a.view(cp.uint16)))


@pytest.mark.gpu
def test_cupy_bfloat16_ffn_on_local_cuda_cluster():
    # the weights are scattered to a worker process and the result comes back: both
    # cross distributed's cupy serializer, which used to turn bfloat16 into '<V2'
    import cupy as cp
    from distributed import Client, LocalCluster

    from twellpy._array import bfloat16

    x, w_gate, w_up, w_down = ffn_problem(300, 64, 256, seed=19)
    xb, wb = cp.asarray(x.astype(bfloat16)), [cp.asarray(w.astype(bfloat16)) for w in (w_gate, w_up, w_down)]
    with LocalCluster(n_workers=1, processes=True, threads_per_worker=1, dashboard_address=None) as cluster, \
            Client(cluster) as client:
        y = twd.gated_forward(da.from_array(xb, chunks=(128, 64), asarray=False), *wb, client=client)
        got = y.compute()
    assert isinstance(got, cp.ndarray) and got.dtype == np.dtype(bfloat16)
    want = tw.ffn.gated_forward(xb, *wb)
    assert rel_err(got, want) < RTOL[np.dtype(bfloat16)]
    x64 = x.astype(bfloat16).astype(np.float64)
    w64 = [w.astype(bfloat16).astype(np.float64) for w in (w_gate, w_up, w_down)]
    ref = (np.maximum(x64 @ w64[0].T, 0) * (x64 @ w64[1].T)) @ w64[2].T
    assert rel_err(got, ref) < RTOL[np.dtype(bfloat16)]


# ----------------------------------------------------------------------------
# the example
# ----------------------------------------------------------------------------
def _run_example(tmp_path, device):
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (repo, os.environ.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, os.path.join(repo, "examples", "dask_ffn.py"), "--small",
                           "--device", device], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=300)


@pytest.mark.slow
def test_example_runs_on_cpu(tmp_path):
    r = _run_example(tmp_path, "cpu")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "dask_ffn OK"


@pytest.mark.gpu
def test_example_runs_on_gpu(tmp_path):
    pytest.importorskip("dask_cuda")
    r = _run_example(tmp_path, "cuda")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "dask_ffn OK"


@pytest.mark.parametrize("fmt,params", FORMAT_PARAMS)
def test_reductions_over_row_chunks(client, fmt, params):
    """sum / count_nonzero of the collection: per row equal to the chunk containers'
    own (same bits), per column and in all within float32 summation error of float64."""
    x = sparse_rows(91, 48, seed=8)
    A = twd.from_dask(da.from_array(x, chunks=(20, 48)), fmt, **params)
    cls = type(A.compute())
    x64 = x.astype(np.float64)
    s1 = A.sum(axis=1)
    assert s1.shape == (91,) and s1.chunks == ((20, 20, 20, 20, 11),) and s1.dtype == np.float32
    want = np.concatenate([cls.from_dense(x[s:s + 20], **params).sum(axis=1) for s in range(0, 91, 20)])
    np.testing.assert_array_equal(s1.compute(), want)
    s0 = A.sum(axis=0).compute()
    bound = 2 * 91 * np.finfo(np.float32).eps * np.abs(x64).sum(axis=0)
    assert s0.shape == (48,) and s0.dtype == np.float32 and (np.abs(s0 - x64.sum(axis=0)) <= bound).all()
    assert abs(float(A.sum().compute()) - x64.sum()) <= 2 * x.size * np.finfo(np.float32).eps * np.abs(x64).sum()
    np.testing.assert_array_equal(A.count_nonzero(axis=0).compute(), np.count_nonzero(x, axis=0))
    np.testing.assert_array_equal(A.count_nonzero(axis=1).compute(), np.count_nonzero(x, axis=1))
    assert int(A.count_nonzero().compute()) == np.count_nonzero(x)
    np.testing.assert_array_equal(A.mean(axis=1).compute(), want / np.float32(48))
    assert abs(float(A.mean().compute()) - x64.mean()) <= 2 * np.finfo(np.float32).eps * np.abs(x64).mean()
    assert bits_equal_arrays(A.sum(axis=0).compute(), s0)       # the same bits on a second run
    with pytest.raises(ValueError, match="axis 2 is out of range for a 2-D SparseDaskArray"):
        A.sum(axis=2)
    with pytest.raises(TypeError, match="axis must be None, 0 or 1"):
        A.count_nonzero(axis="rows")


def bits_equal_arrays(a, b):
    return a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))


def test_row_slices_of_the_collection(client):
    x = sparse_rows(91, 48, seed=9)
    A = twd.from_dask(da.from_array(x, chunks=(20, 48)), "twell", tile=16, slots=4)
    for key in (slice(10, 50), slice(None, None, 3), slice(80, 5, -2), slice(200, 300), (slice(5, 25), slice(None))):
        B = A[key]
        assert isinstance(B, twd.SparseDaskArray) and B.format == "twell"
        k = key[0] if isinstance(key, tuple) else key
        got = B.compute()
        assert got.shape == x[k].shape
        np.testing.assert_array_equal(got.toarray(), x[k])
        np.testing.assert_allclose(np.asarray(B.sum(axis=1).compute()), x[k].astype(np.float64).sum(axis=1),
                                   rtol=1e-6, atol=1e-6)
    with pytest.raises(TypeError, match="rows are selected by a slice"):
        A[[1, 2]]
    with pytest.raises(TypeError, match="rows are selected by a slice"):
        A[3]
    with pytest.raises(TypeError, match="selects whole rows only"):
        A[:, 1:3]
