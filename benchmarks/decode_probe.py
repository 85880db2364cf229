"""Where a decode-sized FFN call spends its time (issue 4, W4: never slower than dense).

For M in 1, 4, 8, 16, 32, 64 and 128 at W1's D and H, it times, back to back and one
call at a time (synchronised), the dense FFN (three cuBLAS GEMMs through CuPy,
and torch's when torch is installed) and the twellpy call unchecked,
``mode="auto"``, with the default NaN/Inf check, and that default call with
the decode kernels off (``decode_rows = 0``: the general path; M <= 16 only) and
forced on (``decode_rows = 16``: "checked decode", whatever the default);
for M > 16 (general path by default) also the same call with ``decode_rows = 128``
(the decode kernels in groups of 16 rows: "grouped decode"), which decides whether
the default should rise past 16; and for every M the same calls with CUDA graphs
(``graphs=True``: "graph" unchecked, "graph checked" the default call), whose bits must
equal the ordinary call's (a line says so). Then it profiles the checked call with
cProfile (host functions by own time), with graphs too at M = 16 and 128. A call that
costs more host time than GPU time is host-bound: that is what decides decode speed.
"host ms" is the host's own time a call (100 calls queued, no wait).

Usage (device): ``python benchmarks/decode_probe.py``
"""
# twellpy-bench: suite gpu-only
from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from benchmarks.workloads import make_ffn  # noqa: E402
from twellpy._array import bfloat16  # noqa: E402
from twellpy._ffn_infer import GatedFFN  # noqa: E402


def per_call_ms(fn, calls, sync):
    """Milliseconds a call: back to back (sync once), one at a time (sync each), and the
    host's own time (100 calls queued without waiting, then one wait outside the timing)."""
    for _ in range(5):
        fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(100):
        fn()
    host = (time.perf_counter() - t0) / 100 * 1e3
    sync()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    sync()
    stream = (time.perf_counter() - t0) / calls * 1e3
    ts = []
    for _ in range(calls // 4):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return stream, float(np.median(ts)) * 1e3, host


def main():
    import cupy as cp

    sync = cp.cuda.get_current_stream().synchronize
    print(f"device {cp.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    print(f"{'M':>4s} {'variant':>16s} {'stream ms':>10s} {'synced ms':>10s} {'x dense':>8s} {'host ms':>8s}")
    profiled = {}
    try:
        import torch
    except ImportError:
        torch = None
    for M in (1, 4, 8, 16, 32, 64, 128):
        w = make_ffn(M, 2048, 5632, 30, dtype=bfloat16, xp=cp, seed=1)
        x, wg, wu, wd = w["x"], w["w_gate"], w["w_up"], w["w_down"]
        wgT, wuT, wdT = (cp.ascontiguousarray(a.T) for a in (wg, wu, wd))

        def dense():
            return (cp.maximum(x @ wgT, 0) * (x @ wuT)) @ wdT

        ffn = GatedFFN(wg, wu, wd)
        graphed = GatedFFN(wg, wu, wd, graphs=True)  # per_call_ms's first calls warm up and capture
        general = GatedFFN(wg, wu, wd)
        general.decode_rows = 0
        variants = {
            "dense": dense,
            "sparse": lambda: ffn(x, mode="sparse", check_finite=False),
            "auto": lambda: ffn(x, check_finite=False),
            "auto checked": lambda: ffn(x),  # the default: decode calls defer the NaN/Inf report
            "auto sync": lambda: ffn(x, check_finite="sync"),  # every call waits for its count
            "graph": lambda: graphed(x, check_finite=False),
            "graph checked": lambda: graphed(x),  # the default call, as "auto checked"
        }
        if M > 16:
            grouped = GatedFFN(wg, wu, wd)
            grouped.decode_rows = 128
            variants["grouped decode"] = lambda: grouped(x)  # checked, as "auto checked"
            variants["grouped unchecked"] = lambda: grouped(x, check_finite=False)
        if M <= 16:
            forced = GatedFFN(wg, wu, wd)
            forced.decode_rows = 16  # the decode kernels whatever the default (4 since 2026-12-08)
            variants["checked decode"] = lambda: forced(x)
            variants["checked general"] = lambda: general(x)  # the same call without the decode kernels
            # (graphs are on by default since 2026-12-07, so "general" replays a graph of the
            # general path: against "graph"/"graph checked" this is graph against graph)
            variants["general unchecked"] = lambda: general(x, check_finite=False)
            # one token firing every neuron (x[:, 0] carries the threshold): the decode down
            # kernel then walks the whole list in D / 256 blocks
            hot = x.copy()
            hot[0, 0] = -40.0
            variants["hot row"] = lambda: ffn(hot)
            variants["hot row general"] = lambda: general(hot)
        syncs = {}
        if torch is not None and torch.cuda.is_available():
            dev = torch.device("cuda")
            xt = torch.randn(M, 2048, device=dev, dtype=torch.bfloat16)
            wgt, wut = (torch.randn(5632, 2048, device=dev, dtype=torch.bfloat16) for _ in range(2))
            wdt = torch.randn(2048, 5632, device=dev, dtype=torch.bfloat16)
            F = torch.nn.functional
            variants["torch dense"] = lambda: F.linear(F.relu(F.linear(xt, wgt)) * F.linear(xt, wut), wdt)
            syncs["torch dense"] = torch.cuda.synchronize
        base = None
        for name, fn in variants.items():
            stream, synced, host = per_call_ms(fn, 400, syncs.get(name, sync))
            base = stream if base is None else base
            print(f"{M:4d} {name:>16s} {stream:10.4f} {synced:10.4f} {base / stream:8.2f} {host:8.4f}")
        y_graph, y_plain = graphed(x, check_finite=False), ffn(x, check_finite=False)
        same = bool((y_graph.view(cp.uint16) == y_plain.view(cp.uint16)).all())
        print(f"{M:4d} graphs: last call {graphed.last_info.get('graph')!r}, bits "
              f"{'equal to' if same else 'DIFFERENT FROM'} the ordinary call's")
        if M in (1, 128):
            # M = 1 runs the decode kernels; at M = 128 (general path) the checked call cost
            # 0.053 ms more than the unchecked one on an H100 (2026-12-05), cause unknown
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(300):
                ffn(x)
            sync()
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(14)
            profiled[M] = out.getvalue()
        if M in (16, 128):
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(300):
                graphed(x)
            sync()
            prof.disable()
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(14)
            profiled[f"{M}, graphs=True"] = out.getvalue()
    for M, text in profiled.items():
        print(f"\ncProfile of 300 checked calls at M = {M} (own time):")
        lines = [ln for ln in text.splitlines() if ln.strip()]
        start = next(i for i, ln in enumerate(lines) if "ncalls" in ln)
        for ln in lines[start:start + 15]:
            print(ln[:150])


if __name__ == "__main__":
    main()
