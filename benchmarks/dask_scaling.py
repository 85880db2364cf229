"""Dask scale-out benchmark: throughput with 1 and 2 workers, overhead against direct calls.

Runs ``twellpy.dask.gated_forward`` on a synthetic gated FFN (docs/workloads.md)
with 1 and 2 Dask workers, and the same FFN directly in this process
(``twellpy.ffn.GatedFFN`` on the whole batch), then prints one table:
time, tokens/s, scaling against 1 worker, overhead against the direct call,
and the relative error of the Dask result against the direct one.

* GPU (dask-cuda and a CUDA GPU present, unless ``--cpu``): a
  ``LocalCUDACluster`` (one worker per GPU), W1-64k sizes (M=65536, D=2048,
  H=5632, 30 active neurons per token, bfloat16), one row chunk per worker
  per batch unless ``--chunks`` says otherwise. Target:
  Dask overhead at 1 worker <= 10%. With one GPU only the 1-worker row runs.
* CPU: a ``LocalCluster`` of single-threaded worker processes (Numba/BLAS
  limited to one thread per worker and for the direct call), C1 sizes
  (M=8192, D=1024, H=2816, 15 per token, float32) by default.

Usage::

    python benchmarks/dask_scaling.py              # GPU if possible, else CPU
    python benchmarks/dask_scaling.py --cpu --rows 4096

Throughput is measured on a stream of batches: one timed run processes
``--batches`` batches of M tokens (8 on the GPU, where one W1-64k batch takes
only milliseconds), direct calls back to back against Dask graphs persisted
together, so Dask's fixed costs per call are amortised as in a real stream.

Full numbers go to ``$OUT/dask_scaling.json`` when ``OUT`` is set.
"""
# twellpy-bench: suite
import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _dask_bench as bench  # noqa: E402  (sets the NVLS variables before CUDA is touched)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true", help="force a CPU LocalCluster")
    p.add_argument("--workload", default=None, help="workload name, see docs/workloads.md (default W1-64k on GPU, C1 on CPU)")
    p.add_argument("--rows", type=int, default=None, help="override M")
    p.add_argument("--chunks", type=int, default=None,
                   help="row chunks per batch (default: one per worker, so the 1-worker row measures "
                        "Dask's own cost; benchmarks/multi_gpu.py uses 8)")
    p.add_argument("--batches", type=int, default=None,
                   help="batches of M tokens per timed repetition (default 8 on GPU, 1 on CPU)")
    p.add_argument("--long-batches", type=int, default=None,
                   help="also time streams of this many batches and report the marginal overhead per "
                        "added batch and the fixed latency per wait (default 64 on GPU, none on CPU)")
    p.add_argument("--direct-keeps-outputs", action="store_true",
                   help="the direct stream holds all its outputs until it ends, as the Dask worker "
                        "holds its persisted outputs (same allocations and memory on both sides)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (median)")
    p.add_argument("--workers", default="1,2", help="worker counts (default 1,2)")
    p.add_argument("--dtype", default=None, help="bfloat16 (GPU default) or float32 (CPU default)")
    p.add_argument("--threads", type=int, default=1,
                   help="threads per GPU worker, so tasks overlap their host synchronisations "
                        "(CPU workers always use one thread: the benchmark pins BLAS/Numba to one)")
    p.add_argument("--ptds", action="store_true",
                   help="GPU workers use CuPy's per-thread default stream (CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1), "
                        "so with --threads > 1 one task's Dask bookkeeping and host sync overlap another "
                        "thread's kernels instead of waiting on one shared stream")
    p.add_argument("--ffn-mode", default=None, choices=("auto", "sparse", "dense"),
                   help="FFN mode of both the direct and the Dask runs (default: the library's)")
    p.add_argument("--no-check-finite", action="store_true",
                   help="skip the NaN/Inf input check (a host synchronisation) in both runs")
    p.add_argument("--submit", default="pipelined", choices=("pipelined", "together", "eager"),
                   help="pipelined: each batch is persisted as soon as its graph is built (a serving "
                        "loop); eager: the same through gated_forward(..., persist=True), one "
                        "client.submit per chunk; together: all batches of a repetition persisted "
                        "in one call")
    p.add_argument("--comm-interval-ms", type=float, default=None,
                   help="experiment: set distributed's hard-coded batched-send throttles "
                        "(10/5/2 ms) to this value, to measure their share of the overhead")
    p.add_argument("--switch-interval-ms", type=float, default=None,
                   help="experiment: sys.setswitchinterval on the workers (Python's default 5 ms). A task "
                        "thread that wakes from a host sync may wait that long for the GIL while the "
                        "worker's event loop thread runs")
    args = p.parse_args(argv)
    if args.switch_interval_ms is not None:
        os.environ["TWELLPY_BENCH_SWITCH_INTERVAL_MS"] = str(args.switch_interval_ms)
    if args.comm_interval_ms is not None:
        os.environ["TWELLPY_BENCH_COMM_INTERVAL_MS"] = str(args.comm_interval_ms)

    mode = "cpu" if args.cpu else ("gpu" if bench.gpu_count() > 0 and bench.have_dask_cuda() else "cpu")
    if mode == "cpu":
        bench.limit_cpu_threads(1)  # before numpy/numba start their thread pools
    from benchmarks.workloads import WORKLOADS

    name = args.workload or ("W1-64k" if mode == "gpu" else "C1")
    sizes = dict(WORKLOADS[name])
    if args.rows:
        sizes["M"] = args.rows
    counts = [int(c) for c in args.workers.split(",")]
    if mode == "gpu":
        n_gpu = bench.gpu_count()
        dropped = [c for c in counts if c > n_gpu]
        counts = [c for c in counts if c <= n_gpu]
        if dropped:
            print(f"only {n_gpu} GPU(s): skipping worker counts {dropped}")
    reps = args.reps or (20 if mode == "gpu" else 5)
    dtype = args.dtype or ("bfloat16" if mode == "gpu" else "float32")
    batches = args.batches or (8 if mode == "gpu" else 1)
    chunks = args.chunks if args.chunks else (lambda n_workers: n_workers)
    ffn_kwargs = {}
    if args.ffn_mode:
        ffn_kwargs["mode"] = args.ffn_mode
    if args.no_check_finite:
        ffn_kwargs["check_finite"] = False
    threads = args.threads if mode == "gpu" else 1
    if args.ptds:
        # read by CuPy at import: the worker processes, started after this, inherit it
        os.environ["CUPY_CUDA_PER_THREAD_DEFAULT_STREAM"] = "1"
    results = bench.run(mode, sizes, counts, chunks, reps, dtype, batches=batches, threads=threads,
                        ffn_kwargs=ffn_kwargs, submit=args.submit,
                        keep_outputs=args.direct_keeps_outputs,
                        long_batches=args.long_batches if args.long_batches is not None
                        else (64 if mode == "gpu" else None))
    results["workload"] = name
    bench.write_out(results, "dask_scaling.json")
    print()
    print(f"Dask scaling, {name} (M={sizes['M']}), {dtype}, {mode}, "
          f"{batches} batch(es) per run, median of {reps} runs, {threads} thread(s) per worker, "
          f"FFN options {ffn_kwargs or 'default'}, batches submitted {args.submit}"
          f"{', per-thread default streams on the workers' if args.ptds and mode == 'gpu' else ''}")
    print(bench.table(results, unit="GPU" if mode == "gpu" else "worker"))
    one = [r for r in results["dask"] if r["workers"] == 1]
    if one:
        verdict = "ok" if one[0]["overhead_vs_direct"] <= 0.10 else "ABOVE the 10% target"
        print(f"Dask overhead at 1 worker: {one[0]['overhead_vs_direct'] * 100:.1f}% ({verdict}); "
              f"a no-op task's round trip: {one[0]['noop_round_trip_seconds'] * 1e3:.2f} ms")
        ls = one[0].get("long_stream")
        if ls:
            verdict = "ok" if ls["marginal_overhead"] <= 0.10 else "ABOVE the 10% target"
            print(f"streams of {ls['long_batches']} batches: {ls['overhead_long_stream'] * 100:.1f}% overhead; "
                  f"marginal overhead per batch {ls['marginal_overhead'] * 100:.1f}% ({verdict}); "
                  f"fixed latency per wait {ls['fixed_latency_seconds'] * 1e3:.2f} ms")
    return results


if __name__ == "__main__":
    main()
