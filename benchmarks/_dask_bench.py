"""Shared engine of benchmarks/dask_scaling.py and benchmarks/multi_gpu.py.

Runs ``twellpy.dask.gated_forward`` on a synthetic workload (docs/workloads.md)
with 1, 2, ... workers and compares it with a direct, single-process
``twellpy.ffn.GatedFFN`` call on the same data:

* CPU: a ``distributed.LocalCluster`` of single-threaded worker processes
  (Numba and BLAS limited to one thread per worker; the direct call too).
* GPU: a dask-cuda ``LocalCUDACluster`` (one worker per GPU). Without
  dask-cuda, a ``distributed.SpecCluster`` of nannies with
  ``CUDA_VISIBLE_DEVICES`` set per worker does the same job.

What is timed for Dask: building the graph, scheduling, running every chunk
and waiting for the GPUs; ``x`` already lives on the workers (scattered row
chunks, round robin) and the weights were broadcast once (twellpy.dask.share).
Results stay on the workers (persist); they are gathered once, outside the
timing, to measure the relative error against the direct call.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# NVLink multicast off (device README: a program using it can take the host's
# shared GPUs out of service). Set before anything touches CUDA, inherited by
# every worker process.
NVLS_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(NVLS_ENV)

try:  # workers need not import this module: its functions travel by value
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
except Exception:  # pragma: no cover - old cloudpickle, or imported unusually
    pass

THREAD_ENV = ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def limit_cpu_threads(n):
    """One setting for the direct call and every CPU worker; call before importing numpy."""
    for k in THREAD_ENV:
        os.environ[k] = str(n)


def gpu_count():
    """Usable CUDA devices (0 without CuPy or a GPU)."""
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def have_dask_cuda():
    try:
        import dask_cuda  # noqa: F401
    except Exception:
        return False
    return True


def _sync_device():
    """Run on a worker: wait for its GPU (tasks return before their kernels end)."""
    import cupy

    cupy.cuda.runtime.deviceSynchronize()
    return True


def _sync_after(*chunks):
    """Run on a worker after the given chunks: wait for its GPU."""
    import cupy

    cupy.cuda.runtime.deviceSynchronize()
    return len(chunks)


def _noop():
    return None


def round_trip_floor(client, reps=40):
    """Median seconds for ``client.submit(no-op).result()``: Dask's own latency
    from a submit to a known result, which no task of ours can go under."""
    times = []
    for _ in range(reps + 5):
        t0 = time.perf_counter()
        client.submit(_noop, pure=False).result()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[5:])


def _worker_env():
    import os as _os

    return {k: _os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "NCCL_NVLS_ENABLE",
                                            "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS",
                                            "NUMBA_NUM_THREADS", "CUPY_CUDA_PER_THREAD_DEFAULT_STREAM")}


def start_cluster(mode, n_workers, threads):
    """(cluster, client, description) for ``n_workers`` CPU workers or GPUs."""
    from distributed import Client

    if mode == "cpu":
        from distributed import LocalCluster

        cluster = LocalCluster(n_workers=n_workers, threads_per_worker=threads, processes=True,
                               dashboard_address=":0", silence_logs=40)
        kind = "LocalCluster"
    elif have_dask_cuda():
        from dask_cuda import LocalCUDACluster

        # threads > 1: while one task waits for its GPU (a host synchronisation in
        # the FFN call), another launches; each thread has its own cuBLAS handles
        cluster = LocalCUDACluster(CUDA_VISIBLE_DEVICES=list(range(n_workers)), n_workers=n_workers,
                                   threads_per_worker=threads, dashboard_address=":0", silence_logs=40)
        kind = "LocalCUDACluster"
    else:
        from distributed import Nanny, Scheduler, SpecCluster

        workers = {i: {"cls": Nanny, "options": {"nthreads": threads, "env": {
            "CUDA_VISIBLE_DEVICES": str(i), **NVLS_ENV}}} for i in range(n_workers)}
        cluster = SpecCluster(workers=workers, scheduler={"cls": Scheduler, "options": {
            "dashboard_address": ":0"}}, silence_logs=40)
        kind = "SpecCluster+CUDA_VISIBLE_DEVICES (dask-cuda not installed)"
    client = Client(cluster)
    client.wait_for_workers(n_workers, timeout=300)
    switch = os.environ.get("TWELLPY_BENCH_SWITCH_INTERVAL_MS")
    if switch is not None:
        client.run(sys.setswitchinterval, float(switch) / 1000)
        kind += f", GIL switch interval {switch} ms"
    interval = os.environ.get("TWELLPY_BENCH_COMM_INTERVAL_MS")
    if interval is not None:
        set_comm_intervals(client, float(interval) / 1000)
        kind += f", batched-send intervals {interval} ms"
    return cluster, client, kind


def _set_scheduler_intervals(dask_scheduler, seconds):
    for comm in dask_scheduler.stream_comms.values():
        comm.interval = seconds
    for comm in dask_scheduler.client_comms.values():
        comm.interval = seconds


def _set_worker_interval(dask_worker, seconds):
    dask_worker.batched_stream.interval = seconds


def set_comm_intervals(client, seconds):
    """Experiment only: change distributed's hard-coded BatchedSend throttles
    (client -> scheduler 10 ms, scheduler -> worker 5 ms, worker -> scheduler
    2 ms, scheduler -> client 2 ms). Each stream sends at most once per interval,
    so a lone message can wait up to that long; this measures how much of Dask's
    fixed per-submission latency they are. Private attributes: not for production."""
    client.scheduler_comm.interval = seconds
    client.run_on_scheduler(_set_scheduler_intervals, seconds=seconds)
    client.run(_set_worker_interval, seconds=seconds)


def scatter_rows(client, x, n_chunks):
    """Dask array of ``x``'s row chunks, scattered round robin to the workers.

    The chunks are scattered under the dask array's own keys, so the graph
    holds the futures themselves (as after ``persist``), no alias tasks.
    """
    import uuid

    import dask.array as da
    import numpy as np

    m = x.shape[0]
    bounds = np.linspace(0, m, n_chunks + 1).astype(int)
    name = f"bench-x-{uuid.uuid4().hex}"
    data = {(name, i, 0): x[a:b].copy() for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:]))}
    futures = client.scatter(data)
    sizes = tuple(int(b - a) for a, b in zip(bounds[:-1], bounds[1:]))
    return (da.Array(dict(futures), name, chunks=(sizes, (x.shape[1],)), dtype=x.dtype, meta=x[:0, :0]),
            list(futures.values()))


def _median_time(fn, reps, warmup=1):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def _alternate(first, second, reps):
    """Times of ``reps`` alternating calls of ``first`` and ``second`` (two lists),
    so that both see the same machine load."""
    t_first, t_second = [], []
    for _ in range(reps):
        for fn, times in ((first, t_first), (second, t_second)):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return t_first, t_second


def rel_err(got, ref):
    import numpy as np

    got = np.asarray(got.get() if hasattr(got, "get") else got, dtype=np.float64)
    ref = np.asarray(ref.get() if hasattr(ref, "get") else ref, dtype=np.float64)
    den = np.linalg.norm(ref)
    return float(np.linalg.norm(got - ref) / den) if den else float(np.linalg.norm(got))


def run(mode, sizes, worker_counts, n_chunks, reps, dtype_name, seed=0, threads=1, batches=1,
        log=print, ffn_kwargs=None, submit="pipelined", long_batches=None, keep_outputs=False):
    """Time direct and Dask runs; returns a dict of results (JSON-serialisable).

    One timed repetition processes ``batches`` batches of M tokens back to back
    (direct: ``batches`` calls, then one device sync; Dask: ``batches`` graphs
    submitted batch by batch (``submit="pipelined"``, as a serving loop would;
    ``"eager"``: the same through ``gated_forward(..., persist=True)``) or
    persisted together (``"together"``), then one synchronising task per worker
    that depends on every chunk), so that
    throughput is measured the way a stream of batches runs, with Dask's fixed
    per-call costs (graph, scheduling, round trips) amortised as they would be.

    ``keep_outputs`` makes the direct stream hold all its outputs until it
    ends, as the Dask worker holds every persisted output until the wait.

    ``long_batches`` (> ``batches``) also times streams of that many batches,
    alternating with direct calls, and reports the *marginal* overhead: the
    extra Dask time per added batch over the extra direct time per added batch.
    The difference to the short stream's overhead is the fixed latency of one
    wait (Dask's round trip), which a stream pays once, not per batch.
    """
    import numpy as np

    import twellpy.dask as twd
    from benchmarks.workloads import make_ffn, reference_ffn
    from twellpy._array import bfloat16
    from twellpy.ffn import GatedFFN

    dtype = {"bfloat16": bfloat16, "float16": np.float16, "float32": np.float32,
             "float64": np.float64}[dtype_name]
    if mode == "gpu":
        import cupy as xp
    else:
        xp = np
        import numba

        numba.set_num_threads(threads)

    def sync():
        if mode == "gpu":
            xp.cuda.runtime.deviceSynchronize()

    log(f"workload M={sizes['M']} D={sizes['D']} H={sizes['H']} nnz/token={sizes['nnz']} "
        f"sigma={sizes.get('sigma', 0.0)} dtype={dtype_name} mode={mode}")
    w = make_ffn(sizes["M"], sizes["D"], sizes["H"], sizes["nnz"], sizes.get("sigma", 0.0),
                 dtype=dtype, xp=xp, seed=seed)
    x, w_gate, w_up, w_down = w["x"], w["w_gate"], w["w_up"], w["w_down"]
    m = x.shape[0]

    # ---- direct, one process, one device --------------------------------------
    ffn_kwargs = dict(ffn_kwargs or {})
    ffn = GatedFFN(w_gate, w_up, w_down, **ffn_kwargs)

    def direct(count=batches):
        # keep_outputs: hold every output until the stream ends, as the Dask worker
        # holds every persisted chunk until the wait (same allocations, same memory)
        kept = [] if keep_outputs else None
        for _ in range(count):
            y = ffn(x)
            if kept is not None:
                kept.append(y)
        sync()

    t_direct, _ = _median_time(direct, reps)
    y_direct = ffn(x)
    sync()
    ref = reference_ffn(x, w_gate, w_up, w_down, dtype=np.float32)
    err_direct = rel_err(y_direct, ref)
    del ref
    tokens = m * batches
    results = {"mode": mode, "sizes": sizes, "dtype": dtype_name, "ffn_kwargs": ffn_kwargs,
               "threads_per_worker": threads, "submit": submit, "direct_keeps_outputs": keep_outputs,
               "chunks": "workers x " + str(n_chunks(1)) if callable(n_chunks) else n_chunks, "reps": reps,
               "batches_per_rep": batches,
               "direct": {"seconds": t_direct, "tokens_per_s": tokens / t_direct,
                          "rel_err_vs_fp32_reference": err_direct, "info": dict(ffn.last_info)},
               "dask": []}
    log(f"direct: {t_direct * 1e3:.2f} ms for {batches} batch(es), rel err vs fp32 reference "
        f"{err_direct:.2e}")
    y_direct_host = xp.asnumpy(y_direct) if mode == "gpu" else y_direct

    # ---- Dask with 1, 2, ... workers --------------------------------------------
    import dask
    from distributed import futures_of, wait

    if submit not in ("pipelined", "together", "eager"):
        raise ValueError(f"submit must be 'pipelined', 'together' or 'eager', got {submit!r}")

    for n in worker_counts:
        cluster, client, kind = start_cluster(mode, n, threads)
        try:
            envs = client.run(_worker_env)
            worker_addrs = sorted(envs)
            chunks_n = n_chunks(n) if callable(n_chunks) else n_chunks
            dx, x_futures = scatter_rows(client, x, chunks_n)
            wait(x_futures)
            homes = client.who_has(x_futures)
            x_home = {f.key[1]: sorted(homes[f.key])[0] for f in x_futures}
            shared = [twd.share(a, name, client=client) for name, a in
                      (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down))]

            counter = iter(range(10**9))

            def dask_run(batches=batches):
                # fresh output names per run: identical calls would otherwise share keys
                # with results still in worker memory and time nothing
                if submit == "together":
                    ys = [twd.gated_forward(dx, *shared, name=f"bench-y-{n}-{next(counter)}", **ffn_kwargs)
                          for _ in range(batches)]
                    ys = dask.persist(*ys)
                elif submit == "eager":
                    # the library's streaming path: one client.submit per chunk, no
                    # collection machinery (gated_forward(..., persist=True))
                    ys = [twd.gated_forward(dx, *shared, name=f"bench-y-{n}-{next(counter)}", persist=True,
                                            **ffn_kwargs) for _ in range(batches)]
                else:
                    # each batch is submitted as soon as its graph is built, as a
                    # serving loop would: batch k runs while batch k+1's graph is built
                    ys = [client.persist(twd.gated_forward(dx, *shared, name=f"bench-y-{n}-{next(counter)}",
                                                           **ffn_kwargs)) for _ in range(batches)]
                if mode == "gpu":
                    # one task after every chunk, on the workers holding them: it returns
                    # when the GPU is done (cheaper than another client.run round trip)
                    # (only chunks expected on that worker: output chunk i runs where x's
                    # chunk i lives; a dependency elsewhere would copy a chunk across GPUs)
                    by_worker = {}
                    for y in ys:
                        for f in futures_of(y):
                            by_worker.setdefault(x_home.get(f.key[1], worker_addrs[0]), []).append(f)
                    done = [client.submit(_sync_after, *fs, workers=[addr], pure=False)
                            for addr, fs in by_worker.items()]
                    wait(done)
                else:
                    wait(list(ys))
                return ys[0]

            # Direct and Dask runs alternate, so both see the same machine load
            # (on a shared machine the load drifts by more than the effect measured).
            dask_run()
            dask_run()
            t_direct_n, t_dask_list = _alternate(direct, dask_run, reps)
            t_dask, all_times = statistics.median(t_dask_list), t_dask_list
            t_floor = round_trip_floor(client)
            t_direct_here = statistics.median(t_direct_n)
            marginal = None
            if long_batches and long_batches > batches:
                # long streams: what one more batch costs, without the fixed wait latency
                t_dl, t_kl = _alternate(lambda: direct(long_batches), lambda: dask_run(long_batches),
                                        max(5, reps // 2))
                d_long, k_long = statistics.median(t_dl), statistics.median(t_kl)
                added = long_batches - batches
                per_direct = (d_long - t_direct_here) / added
                per_dask = (k_long - t_dask) / added
                marginal = {"long_batches": long_batches, "direct_seconds": d_long, "dask_seconds": k_long,
                            "overhead_long_stream": k_long / d_long - 1.0,
                            "direct_seconds_per_batch": per_direct, "dask_seconds_per_batch": per_dask,
                            "marginal_overhead": per_dask / per_direct - 1.0,
                            "fixed_latency_seconds": (t_dask - t_direct_here) - batches * (per_dask - per_direct)}
                log(f"dask {n} worker(s), streams of {long_batches} batches: {k_long * 1e3:.2f} ms against "
                    f"{d_long * 1e3:.2f} ms direct ({100 * marginal['overhead_long_stream']:.1f}%); per added "
                    f"batch {per_dask * 1e3:.3f} ms against {per_direct * 1e3:.3f} ms: marginal overhead "
                    f"{100 * marginal['marginal_overhead']:.1f}%, fixed latency per wait "
                    f"{marginal['fixed_latency_seconds'] * 1e3:.2f} ms")
            y = dask_run()
            got = y.compute()
            got_host = xp.asnumpy(got) if mode == "gpu" else got
            err = rel_err(got_host, y_direct_host)
            per_worker = client.run(lambda dask_worker: len(dask_worker.data))
            rec = {"workers": n, "chunks": chunks_n, "cluster": kind, "seconds": t_dask,
                   "all_seconds": all_times,
                   "tokens_per_s": tokens / t_dask, "direct_seconds_interleaved": t_direct_here,
                   "overhead_vs_direct": t_dask / t_direct_here - 1.0,
                   "rel_err_vs_direct": err, "worker_env": envs, "keys_per_worker": per_worker,
                   "noop_round_trip_seconds": t_floor, "long_stream": marginal}
            results["dask"].append(rec)
            log(f"dask {n} worker(s) [{kind}], {chunks_n} chunks: {t_dask * 1e3:.2f} ms "
                f"(direct meanwhile {t_direct_here * 1e3:.2f} ms), {tokens / t_dask:,.0f} tokens/s, "
                f"rel err vs direct {err:.2e}; a no-op task's round trip {t_floor * 1e3:.2f} ms "
                f"(Dask's floor: {100 * t_floor / t_direct_here:.1f}% of the direct time)")
            del y, got, dx, x_futures, shared
        finally:
            client.close()
            cluster.close()
    base = results["dask"][0]["tokens_per_s"] if results["dask"] else None
    for rec in results["dask"]:
        rec["scaling_vs_1_worker"] = rec["tokens_per_s"] / base
    return results


def table(results, unit="worker"):
    """Short text table of :func:`run` results.

    ``overhead`` compares each Dask row with direct calls timed in alternation
    with it (same machine load); the direct row is the first, separate timing.
    """
    d = results["direct"]
    lines = [f"{'run':<22}{'chunks':>7}{'ms':>10}{'tokens/s':>14}{'vs 1 ' + unit:>12}{'overhead':>11}{'rel err':>11}",
             f"{'direct (no Dask)':<22}{1:>7}{d['seconds'] * 1e3:>10.2f}{d['tokens_per_s']:>14,.0f}"
             f"{'':>12}{'':>11}{d['rel_err_vs_fp32_reference']:>11.1e}"]
    for r in results["dask"]:
        label = f"dask, {r['workers']} {unit}{'s' if r['workers'] > 1 else ''}"
        lines.append(f"{label:<22}{r['chunks']:>7}{r['seconds'] * 1e3:>10.2f}{r['tokens_per_s']:>14,.0f}"
                     f"{r['scaling_vs_1_worker']:>11.2f}x{r['overhead_vs_direct'] * 100:>10.1f}%"
                     f"{r['rel_err_vs_direct']:>11.1e}")
    return "\n".join(lines)


def write_out(results, name):
    out = os.environ.get("OUT")
    if out:
        path = Path(out) / name
        path.write_text(json.dumps(results, indent=2, default=str))
        print(f"full numbers: {path}")
