"""Where the GPU time of one FFN call goes: every kernel, copy and idle gap (one device call).

The phase marks of ``benchmarks/train.py`` say how long each phase takes, not
which kernels fill it or how long the GPU waits for the host. This script runs
the W1-16k training step (``gated_forward_train`` + ``gated_backward``) and the
default inference call (``GatedFFN(...)(x)``) under ``torch.profiler``, whose
CUPTI tracing records every kernel, copy and memset of the process (CuPy's and
twellpy's RawKernels included, not only torch's), and prints for each:

* the GPU span (first activity start to last activity end) and the busy time
  (union of the activity intervals), so the idle share is measured, not guessed;
* kernels grouped by name: count, total and mean microseconds, sorted by total;
* the longest idle gaps with the activities on both sides (a host
  synchronisation or Python work between two launches shows up here).

Usage (on the device): ``PYTHONPATH=. python benchmarks/step_timeline.py [--workload W1-16k] [--top 25]``.
The raw Chrome traces go to ``$OUT`` when it is set (``step_timeline_<part>.json``).
"""
# twellpy-bench: suite gpu-only
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.workloads import WORKLOADS, make_ffn  # noqa: E402
from twellpy._array import bfloat16  # noqa: E402

#: Chrome-trace categories of device activity (names differ a little between torch versions)
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation_excluded")


def device_events(trace_path):
    """Kernels, copies and memsets of a Chrome trace as ``(start_us, end_us, kind, name)``, sorted."""
    with open(trace_path) as f:
        trace = json.load(f)
    out = []
    for ev in trace.get("traceEvents", []):
        cat = str(ev.get("cat", "")).lower()
        if ev.get("ph") != "X" or cat not in _DEVICE_CATS[:3]:
            continue
        t0 = float(ev["ts"])
        out.append((t0, t0 + float(ev.get("dur", 0.0)), cat, str(ev.get("name", "?"))))
    out.sort()
    return out


def short_name(name):
    """Kernel name without template arguments and parameter lists (groups instantiations)."""
    name = re.sub(r"\(.*", "", name)
    return name if len(name) <= 70 else name[:67] + "..."


def summarize(events, top):
    """Span, busy time, per-name totals and the longest gaps of a sorted event list."""
    if not events:
        return None
    span = events[-1][1] - events[0][0]
    busy, cur0, cur1 = 0.0, events[0][0], events[0][1]
    gaps = []
    prev = events[0]
    for ev in events[1:]:
        if ev[0] > cur1:
            busy += cur1 - cur0
            gaps.append((ev[0] - cur1, short_name(prev[3]), short_name(ev[3])))
            cur0, cur1 = ev[0], ev[1]
        else:
            cur1 = max(cur1, ev[1])
        if ev[1] >= prev[1]:
            prev = ev
    busy += cur1 - cur0
    by_name = defaultdict(lambda: [0, 0.0])
    for t0, t1, cat, name in events:
        key = short_name(name) if cat == "kernel" else cat
        by_name[key][0] += 1
        by_name[key][1] += t1 - t0
    table = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    gaps.sort(reverse=True)
    return {"span_us": span, "busy_us": busy, "idle_us": span - busy, "n_events": len(events),
            "kernels": [{"name": k, "count": c, "total_us": t} for k, (c, t) in table],
            "gaps": [{"idle_us": g, "after": a, "before": b} for g, a, b in gaps[:top]]}


def profile(fn, label, out_dir):
    """Run ``fn`` once (after warm-up) under torch.profiler; return the summary of its device activity."""
    import cupy as cp
    import torch
    from torch.profiler import ProfilerActivity

    for _ in range(3):
        fn()
    cp.cuda.Device().synchronize()
    with torch.profiler.profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        cp.cuda.Device().synchronize()
    path = os.path.join(out_dir or tempfile.gettempdir(), f"step_timeline_{label}.json")
    prof.export_chrome_trace(path)
    return device_events(path)


def print_summary(label, s, top):
    if s is None:
        print(f"== {label}: no device activity recorded (CUPTI tracing unavailable?)")
        return
    print(f"== {label}: span {s['span_us'] / 1e3:.3f} ms, busy {s['busy_us'] / 1e3:.3f} ms, "
          f"idle {s['idle_us'] / 1e3:.3f} ms ({100 * s['idle_us'] / max(s['span_us'], 1e-9):.0f}%), "
          f"{s['n_events']} activities")
    print(f"   {'count':>5} {'total us':>9} {'mean us':>8}  kernel (or copy / memset)")
    for k in s["kernels"][:top]:
        print(f"   {k['count']:5d} {k['total_us']:9.1f} {k['total_us'] / k['count']:8.1f}  {k['name']}")
    print("   longest idle gaps (us): after -> before")
    for g in s["gaps"][: min(top, 12)]:
        print(f"   {g['idle_us']:9.1f}  {g['after']} -> {g['before']}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", default="W1-16k")
    p.add_argument("--top", type=int, default=25)
    args = p.parse_args(argv)

    import cupy as cp

    import twellpy.ffn as tf
    from twellpy.backends import cuda_train as ct

    spec = WORKLOADS[args.workload]
    w = make_ffn(**spec, dtype=np.float32, xp=cp, seed=0)
    x, wg, wu, wd = (ct.from_acc(w[k], bfloat16) for k in ("x", "w_gate", "w_up", "w_down"))
    del w
    M, D = x.shape
    dy = ct.from_acc(cp.random.default_rng(5).standard_normal((M, D), dtype=cp.float32) / np.float32(np.sqrt(M)),
                     bfloat16)
    out_dir = os.environ.get("OUT")

    def train_step():
        y, ctx = tf.gated_forward_train(x, wg, wu, wd, l1=2e-5)
        return tf.gated_backward(ctx, dy)

    ffn = tf.GatedFFN(wg, wu, wd)
    parts = {"train": train_step, "infer": lambda: ffn(x)}
    summaries = {}
    for label, fn in parts.items():
        summaries[label] = summarize(profile(fn, label, out_dir), args.top)
    if out_dir:
        with open(os.path.join(out_dir, "step_timeline.json"), "w") as f:
            json.dump({"workload": args.workload, **summaries}, f, indent=1)
    print(f"{args.workload}: M={M} D={D} H={spec['H']} nnz={spec['nnz']}, bf16, defaults (check_finite=True)")
    for label, s in summaries.items():
        print_summary(label, s, args.top)


if __name__ == "__main__":
    main()
