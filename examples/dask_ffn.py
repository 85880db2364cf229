"""Scale sparse FFN inference out with Dask: row chunks on a LocalCluster.

Builds a synthetic gated FFN (the recipe of benchmarks/workloads.py), splits a batch of tokens
into row chunks (the last one shorter), and runs it on a two-worker Dask
cluster with ``twellpy.dask.gated_forward``: the weights are shared once per
worker, each chunk runs the fused sparse FFN where it lives. It then stores the
activations row-chunked as TwELL (``twellpy.dask.from_dask``) and multiplies
them by the down projection. Every result is checked against a float64
reference and against the single-process twellpy call.

GPU: with ``--device cuda`` (dask-cuda installed) it starts a
``LocalCUDACluster`` with one worker per GPU and cupy chunks instead.

Usage: ``python examples/dask_ffn.py [--small] [--device cpu|cuda]``; prints
``dask_ffn OK`` last.
"""
import argparse
import os

# NVLink multicast off before anything touches CUDA (shared GPU hosts)
os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")

import numpy as np  # noqa: E402


def make_problem(m, d, h, active, seed=0):
    """x (M, D), w_gate/w_up (H, D), w_down (D, H), about ``active`` gate positives per token."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, d)).astype(np.float32)
    x[:, 0] = 1
    w_gate = (rng.standard_normal((h, d)) / np.sqrt(d - 1)).astype(np.float32)
    w_up = (rng.standard_normal((h, d)) / np.sqrt(d)).astype(np.float32)
    w_down = (rng.standard_normal((d, h)) / np.sqrt(h)).astype(np.float32)
    pre = x[:256, 1:] @ w_gate[:, 1:].T
    w_gate[:, 0] = -np.quantile(pre, 1 - active / h)  # threshold: ~active positives per row
    return x, w_gate, w_up, w_down


def rel_err(got, ref):
    got = np.asarray(got.get() if hasattr(got, "get") else got, dtype=np.float64)
    return float(np.linalg.norm(got - ref) / np.linalg.norm(ref))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--small", action="store_true", help="tiny sizes (seconds on a CPU)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = p.parse_args()

    import dask.array as da
    from distributed import Client

    import twellpy as tw
    import twellpy.dask as twd

    m, d, h, active = (1000, 64, 256, 12) if args.small else (20000, 512, 1408, 15)
    rows = 256 if args.small else 4096          # 1000 = 3*256 + 232: the last chunk is shorter
    x, w_gate, w_up, w_down = make_problem(m, d, h, active)

    if args.device == "cuda":
        import cupy as xp
        from dask_cuda import LocalCUDACluster

        cluster = LocalCUDACluster(threads_per_worker=1, dashboard_address=":0")
    else:
        xp = np
        from distributed import LocalCluster

        cluster = LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
                               silence_logs=40)
    client = Client(cluster)
    try:
        to_dev = (lambda a: xp.asarray(a)) if xp is not np else (lambda a: a)
        dx = da.from_array(x, chunks=(rows, -1))
        if xp is not np:
            dx = dx.map_blocks(xp.asarray)          # chunks move to each worker's GPU
        dx = dx.persist()
        # 1. the weights go to every worker once; later calls reuse them
        named = (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down))
        weights = [twd.share(to_dev(w), n) for n, w in named]
        y = twd.gated_forward(dx, *weights)
        print(f"x: {dx.shape} in {dx.npartitions} row chunks {dx.chunks[0]}; "
              f"y: {y.shape}, {type(y._meta).__name__} chunks")
        got = y.compute()

        x64 = x.astype(np.float64)
        hidden = np.maximum(x64 @ w_gate.T.astype(np.float64), 0) * (x64 @ w_up.T.astype(np.float64))
        ref = hidden @ w_down.T.astype(np.float64)
        direct = tw.ffn.gated_forward(to_dev(x), to_dev(w_gate), to_dev(w_up), to_dev(w_down))
        direct_host = np.asarray(direct.get() if xp is not np else direct, np.float64)
        e_ref, e_direct = rel_err(got, ref), rel_err(got, direct_host)
        print(f"gated FFN on {len(client.scheduler_info()['workers'])} workers: "
              f"rel err {e_ref:.1e} vs float64, {e_direct:.1e} vs the single-process call")
        assert e_ref < 1e-5 and e_direct < 1e-5

        # 2. activations stored row-chunked as TwELL, then A @ w_down.T
        dh = da.from_array(hidden.astype(np.float32), chunks=(rows, -1))
        if xp is not np:
            dh = dh.map_blocks(xp.asarray)
        A = twd.from_dask(dh, "twell", tile=64, slots=8).persist()
        y2 = (A @ to_dev(np.ascontiguousarray(w_down.T))).compute()
        whole = A.compute()
        print(f"activations as {A!r}: nnz {whole.nnz} ({whole.nnz / (m * h):.2%}), "
              f"{whole.n_backup} rows in dense backup; A @ w_down.T rel err {rel_err(y2, ref):.1e}")
        assert whole.nnz == np.count_nonzero(hidden) and rel_err(y2, ref) < 1e-5
    finally:
        client.close()
        cluster.close()
    print("dask_ffn OK")


if __name__ == "__main__":
    main()
