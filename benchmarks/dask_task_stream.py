"""Where does Dask's overhead go? Task-stream breakdown of one W1-64k batch run (GPU or CPU).

Starts the same cluster as ``benchmarks/dask_scaling.py`` (1 worker), runs
``twellpy.dask.gated_forward`` on ``--batches`` batches persisted together and
prints, from ``client.get_task_stream``: the client-side graph-building time,
each task's compute / transfer / deserialisation time, the gap between
submission and the first task, and the direct (no Dask) time of one batch.

    PYTHONPATH=. python benchmarks/dask_task_stream.py [--cpu] [--batches 8]
"""
# twellpy-bench: suite
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import _dask_bench as eng  # noqa: E402  (sets the NVLink variables first)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--rows", type=int, default=None)
    p.add_argument("--submit", default="together", choices=("together", "pipelined", "eager"))
    a = p.parse_args()
    if a.batches < 1:
        p.error(f"--batches must be >= 1, got {a.batches}")
    mode = "cpu" if a.cpu or not eng.gpu_count() else "gpu"
    import dask
    import numpy as np
    from distributed import futures_of, get_task_stream, wait

    import twellpy.dask as twd
    from benchmarks.workloads import WORKLOADS, make_ffn
    from twellpy._array import bfloat16
    from twellpy.ffn import GatedFFN

    sizes = dict(WORKLOADS["W1-64k" if mode == "gpu" else "C1"])
    if a.rows:
        sizes["M"] = a.rows
    if mode == "gpu":
        import cupy as xp
        dtype = bfloat16
    else:
        xp, dtype = np, np.float32
    w = make_ffn(sizes["M"], sizes["D"], sizes["H"], sizes["nnz"], dtype=dtype, xp=xp, seed=0)
    x, wg, wu, wd = w["x"], w["w_gate"], w["w_up"], w["w_down"]
    ffn = GatedFFN(wg, wu, wd)
    sync = (lambda: xp.cuda.runtime.deviceSynchronize()) if mode == "gpu" else (lambda: None)
    ffn(x)
    sync()
    t0 = time.perf_counter()
    for _ in range(a.batches):
        ffn(x)
    sync()
    direct = (time.perf_counter() - t0) / a.batches
    cluster, client, kind = eng.start_cluster(mode, 1, 1)
    try:
        dx, futs = eng.scatter_rows(client, x, 1)
        wait(futs)
        shared = [twd.share(v, n, client=client) for n, v in (("w_gate", wg), ("w_up", wu), ("w_down", wd))]
        for rep in range(4):
            t0 = time.perf_counter()
            if a.submit == "together":
                ys = [twd.gated_forward(dx, *shared, name=f"probe-{rep}-{i}") for i in range(a.batches)]
            t_graph = time.perf_counter() - t0
            with get_task_stream(client) as ts:
                t1, t1_wall = time.perf_counter(), time.time()
                if a.submit == "together":
                    ys = dask.persist(*ys)
                elif a.submit == "eager":  # one client.submit per chunk (persist=True)
                    ys = [twd.gated_forward(dx, *shared, name=f"probe-{rep}-{i}", persist=True)
                          for i in range(a.batches)]
                else:  # batch i's graph is built and submitted before batch i+1's (graph time included)
                    ys = [client.persist(twd.gated_forward(dx, *shared, name=f"probe-{rep}-{i}"))
                          for i in range(a.batches)]
                wait([f for y in ys for f in futures_of(y)])
                t_wait = time.perf_counter() - t1
                if mode == "gpu":
                    client.run(eng._sync_device)
                t_total = time.perf_counter() - t0
            comp, other = [], {}
            starts = []
            spans = sorted((s["start"], s["stop"]) for rec in ts.data for s in rec["startstops"]
                           if s["action"] == "compute")
            if spans:
                base = spans[0][0]
                print("  task spans (ms from the first start): " + ", ".join(
                    f"{(b - base) * 1e3:.1f}-{(e - base) * 1e3:.1f}" for b, e in spans))
            for rec in ts.data:
                for s in rec["startstops"]:
                    d = s["stop"] - s["start"]
                    if s["action"] == "compute":
                        comp.append(d)
                        starts.append(s["start"])
                    else:
                        other[s["action"]] = other.get(s["action"], 0.0) + d
            print(f"rep {rep}: {a.batches} batches, total {t_total * 1e3:.2f} ms (direct would be "
                  f"{direct * a.batches * 1e3:.2f} ms); graph build {t_graph * 1e3:.2f} ms; persist+wait "
                  f"{t_wait * 1e3:.2f} ms; tasks {len(comp)}, compute median "
                  f"{(statistics.median(comp) if comp else float('nan')) * 1e3:.2f} ms "
                  f"(direct per batch {direct * 1e3:.2f} ms), compute sum {sum(comp) * 1e3:.2f} ms; "
                  f"other actions (s): { {k: round(v, 5) for k, v in other.items()} }; "
                  f"first compute starts {(min(starts) - t1_wall) * 1e3 if starts else float('nan'):.1f} ms "
                  f"after persist (clocks of one host)")
    finally:
        client.close()
        cluster.close()


if __name__ == "__main__":
    main()
