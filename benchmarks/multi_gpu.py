"""Dask FFN inference on several GPUs of one host (issue 9).

Starts a dask-cuda ``LocalCUDACluster`` with one worker per GPU (1 GPU, then
2 GPUs when the host has them), runs ``twellpy.dask.gated_forward`` on a
W1-64k-sized batch (M=65536, D=2048, H=5632, 30 active neurons per token,
bfloat16) split into 8 or more row chunks, checks the result against a
single-GPU run of ``twellpy.ffn.GatedFFN`` on the whole batch, and prints

* throughput (tokens/s) with 1 GPU and with 2 GPUs,
* the scaling ratio 2 GPUs / 1 GPU (target >= 1.8x),
* the relative error of each Dask result against the single-GPU run.

With one GPU only the 1-GPU numbers are reported. ``--cpu`` runs the same
script on a CPU ``LocalCluster`` (1 and 2 worker processes, small sizes), to
test it on a machine without GPUs.

Environment: NVLink multicast stays off (``NCCL_NVLS_ENABLE=0``,
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1``, ``NVSHMEM_DISABLE_NVLS=1``); the
variables are set before CUDA is touched, every worker inherits them, and
the script checks them on each worker.

dask-cuda is imported only when the script runs on GPUs. The device image
has no dask; carry wheels (see docs/dask.md, "Carrying Dask to the device")::

    bash benchmarks/fetch_dask_wheels.sh          # here, once: fills .whl/
    # on the device, with carry=[".whl"]:
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \\
        --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:.
    python3 benchmarks/multi_gpu.py

Without dask-cuda the script falls back to a ``SpecCluster`` of nannies with
``CUDA_VISIBLE_DEVICES`` set per worker (same layout, reported in the table).
Throughput is measured on a stream of batches: one timed run processes
``--batches`` batches of M tokens (8 on the GPU, where one W1-64k batch takes
only milliseconds), direct calls back to back against Dask graphs persisted
together, so Dask's fixed costs per call are amortised as in a real stream.

Full numbers go to ``$OUT/multi_gpu.json`` when ``OUT`` is set.
"""
# twellpy-bench: suite cpu-args=--cpu
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _dask_bench as bench  # noqa: E402  (sets the NVLS variables before CUDA is touched)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true", help="CPU LocalCluster instead of GPUs (for testing)")
    p.add_argument("--rows", type=int, default=None, help="override M (default 65536; 4096 with --cpu)")
    p.add_argument("--chunks", type=int, default=8, help="row chunks, at least 8 (default 8)")
    p.add_argument("--batches", type=int, default=None,
                   help="batches of M tokens per timed repetition (default 8 on GPU, 1 on CPU)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (median; 20 GPU, 3 CPU)")
    p.add_argument("--max-gpus", type=int, default=2, help="largest worker count (default 2)")
    args = p.parse_args(argv)
    if args.chunks < 8:
        p.error(f"--chunks must be at least 8, got {args.chunks}")

    if args.cpu:
        mode = "cpu"
        bench.limit_cpu_threads(1)
        n_dev = args.max_gpus
    else:
        mode = "gpu"
        n_dev = bench.gpu_count()
        if n_dev == 0:
            p.error("no CUDA GPU found; use --cpu to run on a CPU LocalCluster")
        if not bench.have_dask_cuda():
            print("dask_cuda is not importable: using SpecCluster + CUDA_VISIBLE_DEVICES workers")
    from benchmarks.workloads import WORKLOADS

    sizes = dict(WORKLOADS["W1-64k"])
    if mode == "cpu":
        sizes.update(M=4096, D=512, H=1408, nnz=15)  # C1-like proportions, small enough for 2 cores
    if args.rows:
        sizes["M"] = args.rows
    counts = [n for n in (1, 2) if n <= min(n_dev, args.max_gpus)]
    reps = args.reps or (20 if mode == "gpu" else 3)
    dtype = "bfloat16" if mode == "gpu" else "float32"
    batches = args.batches or (8 if mode == "gpu" else 1)
    results = bench.run(mode, sizes, counts, args.chunks, reps, dtype, batches=batches)
    results["devices_found"] = n_dev
    bad_env = {addr: env for rec in results["dask"] for addr, env in rec["worker_env"].items()
               if any(env.get(k) != v for k, v in bench.NVLS_ENV.items())}
    bench.write_out(results, "multi_gpu.json")

    unit = "GPU" if mode == "gpu" else "worker"
    print()
    print(f"Multi-{unit} Dask FFN, M={sizes['M']} D={sizes['D']} H={sizes['H']} "
          f"nnz/token={sizes['nnz']}, {dtype}, {args.chunks} chunks, {batches} batch(es) per run, "
          f"median of {reps} runs")
    print(bench.table(results, unit=unit))
    by_n = {r["workers"]: r for r in results["dask"]}
    if 2 in by_n:
        ratio = by_n[2]["tokens_per_s"] / by_n[1]["tokens_per_s"]
        verdict = "meets" if ratio >= 1.8 else "BELOW"
        print(f"scaling 2 {unit}s / 1 {unit}: {ratio:.2f}x ({verdict} the 1.8x target)")
    else:
        print(f"only {n_dev} {unit}(s) available: 1-{unit} numbers only")
    worst = max(r["rel_err_vs_direct"] for r in results["dask"])
    print(f"largest relative error against the single-{unit} run: {worst:.2e}")
    print("NVLS variables on every worker: " + ("ok" if not bad_env else f"MISSING on {sorted(bad_env)}"))
    if bad_env:
        sys.exit(1)
    return results


if __name__ == "__main__":
    main()
