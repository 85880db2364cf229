"""Training-step benchmark: twellpy sparse FFN forward+backward vs dense torch autograd.

One command on the GPU machine::

    PYTHONPATH=. python benchmarks/train.py [--workloads W1-16k W2] [--reps 30]
    PYTHONPATH=. python benchmarks/train.py --cpu      # small model on the CPU (Numba)

For each workload (docs/workloads.md recipe, bf16) it times, with CUDA events
(median of ``--reps`` after warm-up):

* twellpy ``gated_forward_train`` + ``gated_backward`` (l1 = 2e-5) with the
  library's defaults (on the GPU the Hybrid is sized from the layer's previous
  step and the token counts are read only after the ELL kernel is queued), also
  the forward and backward alone, and the dense gate GEMM alone (the floor).
  Every repetition has the same inputs, so every speculative step is a hit; a
  real training run, whose counts drift, re-runs now and then
  (``benchmarks/width_drift.py`` models how often W moves);
* the same step on the exact path (``speculate=False``: the host reads the
  counts before sizing the Hybrid), its forward, phases and memory, and
  whether the default gave the exact path's bits;
* dense forward+backward through torch autograd in bf16 (same inputs,
  shared through DLPack, same L1 penalty).

It reports the relative error of y and of every gradient for both against a
float32 torch autograd reference (TF32 off), and the extra peak device
memory of each step: peak during forward+backward minus what existed before
(inputs, weights, dy) minus the outputs (y and the gradients). twellpy's is
measured with a CuPy memory hook on its pool, torch's with
``torch.cuda.max_memory_allocated``. A short table is printed last; full
numbers go to ``$OUT/train_bench.json`` when ``$OUT`` is set.
"""
# twellpy-bench: suite cpu-args=--cpu
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.workloads import WORKLOADS, make_ffn  # noqa: E402
from twellpy import _ffn_train as T  # noqa: E402
from twellpy._array import bfloat16  # noqa: E402

L1 = 2e-5


def _cp():
    import cupy

    return cupy


def time_ms(fn, reps, warmup=3):
    """Median wall time of ``fn`` on the device (CUDA events), in ms."""
    cp = _cp()
    for _ in range(warmup):
        fn()
    cp.cuda.Device().synchronize()
    ts = []
    for _ in range(reps):
        s, e = cp.cuda.Event(), cp.cuda.Event()
        s.record()
        fn()
        e.record()
        e.synchronize()
        ts.append(cp.cuda.get_elapsed_time(s, e))
    return statistics.median(ts), min(ts), max(ts)


class PeakHook:
    """CuPy memory hook tracking bytes handed out by the pool (current and peak)."""

    def __new__(cls):
        cp = _cp()

        class _Hook(cp.cuda.MemoryHook):
            name = "twellpy_peak"

            def __init__(self):
                self.live = {}
                self.cur = 0
                self.peak = 0

            def malloc_postprocess(self, **kw):
                self.live[kw["mem_ptr"]] = kw["mem_size"]
                self.cur += kw["mem_size"]
                self.peak = max(self.peak, self.cur)

            def free_postprocess(self, **kw):
                self.cur -= self.live.pop(kw["mem_ptr"], 0)

        return _Hook()


def to_torch(a):
    import torch

    if a.dtype == bfloat16:
        return torch.from_dlpack(a.view(_cp().int16)).view(torch.bfloat16)
    return torch.from_dlpack(a)


def rel(a, b):
    import torch

    a = a.float()
    b = b.float()
    return float(torch.linalg.norm(a - b) / torch.linalg.norm(b))


def train_inputs(name):
    """bf16 device arrays ``(x, w_gate, w_up, w_down, dy)`` of workload ``name``: the
    FFN of :func:`benchmarks.workloads.make_ffn` (seed 0) and dy ~ N(0, 1/M)."""
    cp = _cp()
    from twellpy.backends import cuda_train as ct

    w = make_ffn(**WORKLOADS[name], dtype=np.float32, xp=cp, seed=0)
    # bf16 through twellpy's cast kernel: works whatever CuPy's bfloat16 support is
    x, wg, wu, wd = (ct.from_acc(w[k], bfloat16) for k in ("x", "w_gate", "w_up", "w_down"))
    del w
    M, D = x.shape
    dy = ct.from_acc(cp.random.default_rng(5).standard_normal((M, D), dtype=cp.float32) / np.float32(np.sqrt(M)),
                     bfloat16)
    return x, wg, wu, wd, dy


def torch_dense_step(tt, dtype):
    """Dense gated FFN forward + backward through torch autograd (the baseline):
    ``tt`` = torch (x, w_gate, w_up, w_down, dy); returns (y, dx, dw_gate, dw_up, dw_down)."""
    import torch

    xs, wgs, wus, wds = (t.to(dtype).detach().requires_grad_(True) for t in tt[:4])
    h = torch.relu(xs @ wgs.T) * (xs @ wus.T)
    yy = h @ wds.T
    pen = L1 * h.abs().sum() / xs.shape[0]
    torch.autograd.backward([yy, pen], [tt[4].to(dtype), torch.ones_like(pen)])
    return (yy.detach(), xs.grad, wgs.grad, wus.grad, wds.grad)


def torch_extra_peak_mb(step):
    """Extra peak device memory (MB) of one torch ``step()``: the peak during it minus
    what was allocated before and minus the outputs it returns."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    outs = step()
    torch.cuda.synchronize()
    out_bytes = sum(o.numel() * o.element_size() for o in outs)
    return (torch.cuda.max_memory_allocated() - base - out_bytes) / 2**20, outs


def cupy_extra_peak_mb(step):
    """Extra peak pool memory (MB) of one twellpy ``step()``, as :func:`torch_extra_peak_mb`."""
    cp = _cp()
    cp.cuda.Device().synchronize()
    hook = PeakHook()
    with hook:
        base = hook.cur
        outs = step()
        cp.cuda.Device().synchronize()
    return (hook.peak - base - sum(o.nbytes for o in outs)) / 2**20, outs


def width_line(row, dense_ms, dense_mb):
    """One printed line of a :func:`time_widths` row against the dense step."""
    line = (f"W {row['W']}, R {row['R']}, step {row['ms'][0]:.3f} ms ({dense_ms / row['ms'][0]:.2f}x dense; "
            f"check_finite=True {row['ms_checked'][0]:.3f} ms), "
            f"extra memory {row['extra_peak_MB']:.0f} MB ({row['extra_peak_MB'] / max(dense_mb, 1e-9):.2f} "
            f"of dense), max rel err {row['rel_err']:.2e}")
    if "ms_wgrad_gather" in row:
        line += f"; backup wgrad by GEMM (by gather: {row['ms_wgrad_gather'][0]:.3f} ms)"
    return line


def time_widths(fwd, step, widths, reps, ref):
    """The step ``step(width, checked=False)`` (forward ``fwd(width)``) at each ELL width, with the
    library's defaults (speculative on the GPU: at a fixed width every step after the first is a
    hit, the exact path's bits): W, backup rows R, whether their weight gradients took the GEMM
    route (``_ffn_train.BACKUP_WGRAD_GEMM_*``),
    extra peak memory, max relative error against ``ref`` (torch tensors, the
    order of the step's outputs) and time; where the GEMM route ran, the step
    again with those rows' gradients gathered instead ("ms_wgrad_gather")."""
    rows = []
    saved_route = T.BACKUP_WGRAD_GEMM
    T.BACKUP_WGRAD_GEMM = True  # whatever TWELLPY_TRAIN_BACKUP_GEMM says: these rows time the route
    try:
        for width in widths:
            rows.append(_time_width(fwd, step, width, reps, ref))
    finally:
        T.BACKUP_WGRAD_GEMM = saved_route
    return rows


def _time_width(fwd, step, width, reps, ref):
    """One row of :func:`time_widths`."""
    cp = _cp()
    cp.get_default_memory_pool().free_all_blocks()
    _, ctx = fwd(width)
    R = ctx.stats["n_backup_rows"]
    gemm_route = T._backup_wgrad_by_gemm(R, ctx.nnz_total - ctx.ell_entries)
    row = {"width_arg": width, "W": ctx.stats["width"], "R": R, "wgrad_gemm": gemm_route}
    del ctx
    row["extra_peak_MB"], outs = cupy_extra_peak_mb(lambda: step(width))
    row["rel_err"] = max(rel(to_torch(o), r) for o, r in zip(outs, ref))
    del outs
    row["ms"] = time_ms(lambda: step(width), reps)
    # check_finite=True (the default): finite x and dy let the backup rows' GEMM sums
    # accumulate chunk after chunk; unchecked, each chunk's sums are checked and added
    row["ms_checked"] = time_ms(lambda: step(width, checked=True), reps)
    if gemm_route:
        saved = T.BACKUP_WGRAD_GEMM_MIN_ROWS
        T.BACKUP_WGRAD_GEMM_MIN_ROWS = 1 << 62
        try:
            row["ms_wgrad_gather"] = time_ms(lambda: step(width), reps)
        finally:
            T.BACKUP_WGRAD_GEMM_MIN_ROWS = saved
    return row


def _rows(smem, batch):
    return {"TW_XSRC_SMEM": smem, "TW_SLOT_BATCH": batch}


#: (label, cuda_train.ROWS, cuda_train.TWO_PASS) of each variant of the row-loop table: the
#: first is the reference for "same bits"; the defaults are "two-pass, vec 1"
ROW_VARIANTS = [("off (vec 1)", None, False), ("regs, batch 2", _rows(0, 2), False),
                ("regs, batch 1", _rows(0, 1), False), ("smem, batch 2", _rows(1, 2), False),
                ("smem, batch 1", _rows(1, 1), False), ("smem, batch 4", _rows(1, 4), False),
                ("two-pass, vec 1", None, True), ("two-pass, regs b2", _rows(0, 2), True),
                ("two-pass, regs b1", _rows(0, 1), True), ("two-pass, smem b1", _rows(1, 1), True)]


def time_row_variants(fwd, dy, reps, on_row=None):
    """Forward and backward times of every :data:`ROW_VARIANTS` entry, each with a check
    that it gives the first variant's bits; ``on_row(row)`` sees each row as it is made."""
    cp = _cp()
    from twellpy.backends import cuda_train as ct

    rows, base = [], None
    saved = ct.ROWS, ct.TWO_PASS
    try:
        for label, setting, two_pass in ROW_VARIANTS:
            ct.ROWS, ct.TWO_PASS = setting, two_pass
            y, ctx = fwd()
            outs = (y,) + T.gated_backward(ctx, dy)
            base = outs if base is None else base
            same = all(bool((a.view(cp.uint16) == b.view(cp.uint16)).all()) for a, b in zip(outs, base))
            rows.append({"variant": label, "same_bits": same, "fwd_ms": time_ms(fwd, reps),
                         "bwd_ms": time_ms(lambda: T.gated_backward(ctx, dy), reps)})
            if on_row is not None:
                on_row(rows[-1])
            del y, ctx, outs
    finally:
        ct.ROWS, ct.TWO_PASS = saved
    return rows


class _Skip(Exception):
    """Leaves a variant's block early under --quick."""


def time_setting(attr, values, tw_step, bwd, reps, rounds=3, module=None):
    """The step and the backward with ``module.<attr>`` (``twellpy._ffn_train`` by
    default) at each of ``values``, in alternating rounds (so drift hits each alike),
    and whether each gives the first value's bits."""
    cp = _cp()
    T_ = T if module is None else module
    saved = getattr(T_, attr)
    try:
        base, same = None, {}
        for v in values:
            setattr(T_, attr, v)
            outs = tw_step()
            base = outs if base is None else base
            same[v] = all(bool((a.view(cp.uint16) == b.view(cp.uint16)).all()) for a, b in zip(outs, base))
            del outs
        del base
        times = {v: {"step_ms": [], "bwd_ms": []} for v in values}
        for _ in range(rounds):
            for v in values:
                setattr(T_, attr, v)
                times[v]["step_ms"].append(time_ms(tw_step, reps)[0])
                times[v]["bwd_ms"].append(time_ms(bwd, reps)[0])
    finally:
        setattr(T_, attr, saved)
    return {"default": saved, "values": [{"value": v, "same_bits": same[v], **times[v]} for v in values]}


def setting_line(workload, label, d):
    """One printed line of a :func:`time_setting` result."""
    parts = [f"{v['value']!s}: step " + "/".join(f"{t:.3f}" for t in v["step_ms"]) + " ms, bwd "
             + "/".join(f"{t:.3f}" for t in v["bwd_ms"]) + f", same bits {v['same_bits']}" for v in d["values"]]
    return f"{workload} {label} (default {d['default']!s}), alternating rounds: " + "; ".join(parts)


def device_lead(tw_fwd, dy):
    """How far the device trails the host at each mark of one whole step (forward,
    then backward, no sync between them, as a training loop runs them), in ms: the
    device's time to reach the mark's event minus the host's time to record it, both
    from the step's start. Near 0 (a launch's latency): the device had run out of
    queued work and waited for the host there; larger: it still had that much queued."""
    cp = _cp()
    cp.cuda.Device().synchronize()
    T._PROFILE = []
    start = cp.cuda.Event()
    start.record()
    t0 = time.perf_counter()
    try:
        y, ctx = tw_fwd()
        n_fwd = len(T._PROFILE)  # a re-run forward (a speculative miss) marks twice
        T.gated_backward(ctx, dy)
        cp.cuda.Device().synchronize()
        marks = T._PROFILE
    finally:
        T._PROFILE = None
    lead = {}
    for i, (name, ev, t) in enumerate(marks):
        lead[f"{'fwd' if i < n_fwd else 'bwd'}: {name}"] = cp.cuda.get_elapsed_time(start, ev) - (t - t0) * 1e3
    return lead


def bench(name, reps, widths=(), quick=False):
    import torch

    cp = _cp()
    spec = WORKLOADS[name]
    from twellpy.backends import cuda_train as ct

    x, wg, wu, wd, dy = train_inputs(name)
    M, D = x.shape
    res = {"workload": name, **spec}

    # ---------------- twellpy (the library's defaults unless speculate is given)
    def tw_step(speculate=None, width="auto", checked=False):
        y, ctx = T.gated_forward_train(x, wg, wu, wd, l1=L1, check_finite=checked, speculate=speculate,
                                       width=width)
        return (y,) + T.gated_backward(ctx, dy)

    def tw_fwd(speculate=None):
        return T.gated_forward_train(x, wg, wu, wd, l1=L1, check_finite=False, speculate=speculate)

    t0 = time.perf_counter()
    outs = tw_step()  # compiles kernels
    res["tw_first_call_s"] = time.perf_counter() - t0
    y, ctx = tw_fwd()
    res["tw_path"] = ctx.speculation  # "hit": the previous step's layout was this step's
    res["tw_width"] = ctx.stats["width"]
    res["tw_backup_rows"] = ctx.stats["n_backup_rows"]
    res["l0"] = ctx.stats["l0"]
    res["tw_ms"] = time_ms(tw_step, reps)
    res["tw_fwd_ms"] = time_ms(tw_fwd, reps)
    res["tw_bwd_ms"] = time_ms(lambda: T.gated_backward(ctx, dy), reps)
    # the ELL kernels' row loops (TWELLPY_TRAIN_ROWS, TWELLPY_TRAIN_TWO_PASS): off (the x / dy
    # row re-read for every slot) and the define sets; each must give the first one's bits
    res["rows"] = [] if quick else time_row_variants(tw_fwd, dy, reps)
    # the split step (TWELLPY_TRAIN_SPLIT: y from a shared-memory slice of w_down, dx
    # from slices of w_up and w_gate, twellpy_spmm_resident), against the fused
    # kernels: the backward on the same context, the forward's y
    from twellpy.backends import cuda as tc

    saved_split, launch = ct.SPLIT, tc._resident_spmm
    calls = []

    def counted(*a, **k):
        calls.append(1)
        return launch(*a, **k)

    if quick:
        res["tw_split_ran"] = None
    try:
        if quick:
            raise _Skip
        ct.SPLIT = False
        fused_grads = T.gated_backward(ctx, dy)
        ct.SPLIT, tc._resident_spmm = True, counted
        split_grads = T.gated_backward(ctx, dy)
        tc._resident_spmm = launch
        res["tw_split_ran"] = bool(calls)  # False: the two weight slices did not fit (fused ran)
        res["tw_split_bits_equal"] = all(bool((a.view(cp.uint16) == b.view(cp.uint16)).all())
                                         for a, b in zip(split_grads, fused_grads))
        y_split, _ = tw_fwd()
        res["tw_split_bits_equal"] = res["tw_split_bits_equal"] and bool((y_split.view(cp.uint16)
                                                                          == y.view(cp.uint16)).all())
        del y_split
        res["tw_bwd_split_ms"] = time_ms(lambda: T.gated_backward(ctx, dy), reps)
        res["tw_fwd_split_ms"] = time_ms(tw_fwd, reps)
        res["tw_split_ms"] = time_ms(tw_step, reps)
        del split_grads, fused_grads
    except _Skip:
        pass
    finally:
        ct.SPLIT, tc._resident_spmm = saved_split, launch
    # the side stream (TWELLPY_TRAIN_SIDE_STREAM) off and on, on fresh contexts each step
    res["side_stream"] = time_setting("SIDE_STREAM", (False, True), tw_step, lambda: T.gated_backward(ctx, dy),
                                      reps)
    res["pair_transpose"] = time_setting("PAIR_TRANSPOSE", (False, True), tw_step,
                                         lambda: T.gated_backward(ctx, dy), reps, module=ct)
    # the backward's ELL kernel launched before the transpose (TWELLPY_TRAIN_BWD_ELL_FIRST)
    res["bwd_ell_first"] = time_setting("BWD_ELL_FIRST", (False, True), tw_step,
                                        lambda: T.gated_backward(ctx, dy), reps)
    # the gate GEMM and the count and pack over row chunks (TWELLPY_TRAIN_GATE_CHUNKS, slower
    # at 2-8 chunks on an H100: not timed again unless asked); a batch larger than one gate
    # chunk speculates chunk by chunk (TWELLPY_TRAIN_SPECULATE_CHUNKED)
    if M * wg.shape[0] * x.dtype.itemsize <= T.GATE_CHUNK_BYTES:
        if not quick:
            res["gate_chunks"] = time_setting("GATE_CHUNKS", (1, 2, 4, 8), tw_step,
                                              lambda: T.gated_backward(ctx, dy), reps)
    else:
        res["speculate_chunked"] = time_setting("SPECULATE_CHUNKED", (False, True), tw_step,
                                                lambda: T.gated_backward(ctx, dy), reps)
    del ctx, y
    # the exact path (issue 5): the host waits for the token counts before the ELL
    # kernel; the default (speculative on the GPU) must give its bits
    exact_outs = tw_step(False)
    y_d, ctx_d = tw_fwd()
    res["tw_compared_path"] = ctx_d.speculation   # "hit": the comparison is not exact against exact
    default_outs = (y_d,) + T.gated_backward(ctx_d, dy)
    del y_d, ctx_d
    res["tw_exact_bits_equal"] = all(bool((a.view(cp.uint16) == b.view(cp.uint16)).all())
                                     for a, b in zip(default_outs, exact_outs))
    del default_outs, exact_outs
    res["tw_exact_ms"] = time_ms(lambda: tw_step(False), reps)
    res["tw_exact_fwd_ms"] = time_ms(lambda: tw_fwd(False), reps)
    # the backward's dh by neuron (TWELLPY_TRAIN_DH_BY_NEURON) against the row-oriented
    # flow, each way on one context: the gradients differ only by the dot products' order
    saved_dh = T.DH_BY_NEURON
    try:
        if quick:
            raise _Skip
        y_n, ctx_n = tw_fwd()
        flows = {}
        for on in (False, True):
            T.DH_BY_NEURON = on
            grads = T.gated_backward(ctx_n, dy)
            flows[on] = {"bwd_ms": time_ms(lambda: T.gated_backward(ctx_n, dy), reps),
                         "step_ms": time_ms(tw_step, reps), "grads": grads}
        res["dh_by_neuron"] = {"default": saved_dh, "rel_diff": max(
            rel(to_torch(a), to_torch(b)) for a, b in zip(flows[True]["grads"], flows[False]["grads"]))}
        for on in (False, True):
            res["dh_by_neuron"]["on" if on else "off"] = {k: flows[on][k] for k in ("bwd_ms", "step_ms")}
        del y_n, ctx_n, flows, grads
    except _Skip:
        pass
    finally:
        T.DH_BY_NEURON = saved_dh
    # the default again in the same run, after the exact rows (drift check)
    res["tw_ms_after"] = time_ms(tw_step, reps)
    # per-phase device timeline of one step (gaps include host-side work)
    for label, spec in (("", None), ("exact_", False)):
        phases, host_phases = {}, {}
        for part in ("fwd", "bwd"):
            T._PROFILE = []
            if part == "fwd":
                y, ctx = tw_fwd(spec)
            else:
                T._PROFILE = []
                T.gated_backward(ctx, dy)
            cp.cuda.Device().synchronize()
            marks = T._PROFILE
            T._PROFILE = None
            for (_, e0, t0), (nm, e1, t1) in zip(marks[:-1], marks[1:]):
                phases[f"{part}: {nm}"] = cp.cuda.get_elapsed_time(e0, e1)
                host_phases[f"{part}: {nm}"] = (t1 - t0) * 1e3
        res[f"tw_{label}phases_ms"] = phases
        res[f"tw_{label}host_phases_ms"] = host_phases  # host clock between the same marks
        del ctx, y
    saved_first = T.BWD_ELL_FIRST
    try:
        for first in (False, True):
            T.BWD_ELL_FIRST = first
            res[f"tw_device_lead_ms{'_ell_first' if first else ''}"] = device_lead(tw_fwd, dy)
    finally:
        T.BWD_ELL_FIRST = saved_first
    res["gate_gemm_ms"] = time_ms(lambda: ct.gemm(x, wg.T, bfloat16), reps)

    # memory: pool bytes in use during one step, minus the outputs it returns
    del outs
    res["tw_extra_peak_MB"], tw_outs = cupy_extra_peak_mb(tw_step)
    res["tw_exact_extra_peak_MB"], outs = cupy_extra_peak_mb(lambda: tw_step(False))
    del outs

    # ---------------- torch dense (bf16 autograd) and the fp32 reference
    tt = [to_torch(a) for a in (x, wg, wu, wd, dy)]

    def torch_step(dtype=torch.bfloat16):
        return torch_dense_step(tt, dtype)

    res["torch_ms"] = time_ms(torch_step, reps)
    # requires_grad leaves are fresh copies of the inputs inside torch_step (.to
    # of a bf16 tensor is a no-op view, .detach() shares storage), so nothing
    # besides intermediates and outputs is allocated by torch here
    res["torch_extra_peak_MB"], t_outs = torch_extra_peak_mb(torch_step)

    torch.backends.cuda.matmul.allow_tf32 = False
    ref = torch_step(torch.float32)
    names = ("y", "dx", "dw_gate", "dw_up", "dw_down")
    res["tw_rel_err"] = {n: rel(to_torch(o), r) for n, o, r in zip(names, tw_outs, ref)}
    res["torch_rel_err"] = {n: rel(o, r) for n, o, r in zip(names, t_outs, ref)}
    del t_outs, tw_outs
    # other ELL widths (--widths), the defaults: a small W sends most rows to the dense
    # backup rows (cuBLAS GEMMs), which may beat the gathers at high density (W2)
    res["widths"] = time_widths(lambda width: T.gated_forward_train(x, wg, wu, wd, l1=L1, check_finite=False,
                                                                    width=width),
                                lambda width, checked=False: tw_step(width=width, checked=checked), widths,
                                reps, ref)
    del ref
    torch.cuda.empty_cache()
    res["speedup"] = res["torch_ms"][0] / res["tw_ms"][0]
    res["speedup_exact"] = res["torch_ms"][0] / res["tw_exact_ms"][0]
    res["mem_ratio"] = res["tw_extra_peak_MB"] / max(res["torch_extra_peak_MB"], 1e-9)
    return res


def dense_numpy_step(x, wg, wu, wd, dy, l1):
    """Dense float32 gated FFN forward+backward with numpy (the CPU baseline)."""
    M = x.shape[0]
    z = x @ wg.T
    pat = z > 0
    g = np.where(pat, z, 0)
    u = x @ wu.T
    h = g * u
    y = h @ wd.T
    dh = np.where(pat, dy @ wd + np.float32(l1 / M) * np.sign(h), 0)
    du, dg = dh * g, dh * u
    return y, du @ wu + dg @ wg, dg.T @ x, du.T @ x, dy.T @ h


def bench_cpu(steps=5, M=4096, D=256, H=1024, nnz=30):
    """CPU (Numba) step of a small model vs dense numpy, float32."""
    w = make_ffn(M=M, D=D, H=H, nnz=nnz, dtype=np.float32, xp=np, seed=0)
    x, wg, wu, wd = w["x"], w["w_gate"], w["w_up"], w["w_down"]
    dy = (np.random.default_rng(1).standard_normal((M, D)) / np.sqrt(M)).astype(np.float32)

    def tw_step():
        y, ctx = T.gated_forward_train(x, wg, wu, wd, l1=1e-3, check_finite=False)
        return (y,) + T.gated_backward(ctx, dy)

    def dense_step():
        return dense_numpy_step(x, wg, wu, wd, dy, 1e-3)

    t0 = time.perf_counter()
    tw_out = tw_step()  # Numba compiles (or loads its cache) here
    first = time.perf_counter() - t0
    res = {"M": M, "D": D, "H": H, "nnz": nnz, "tw_first_call_s": first}
    for name, fn in (("tw_ms", tw_step), ("dense_ms", dense_step)):
        ts = []
        for _ in range(steps):
            t0 = time.perf_counter()
            fn()
            ts.append(1e3 * (time.perf_counter() - t0))
        res[name] = statistics.median(ts)
    ref = dense_step()
    res["rel_err"] = {n: float(np.linalg.norm(a - b) / np.linalg.norm(b))
                      for n, a, b in zip(("y", "dx", "dw_gate", "dw_up", "dw_down"), tw_out, ref)}
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", nargs="+", default=["W1-16k", "W2"])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--widths", nargs="*", default=[],
                    help="also time the step with these ELL widths (ints or strategies, e.g. 1 32 "
                         "quantile:0.5); rows wider than W take the dense backup-row GEMMs")
    ap.add_argument("--quick", action="store_true",
                    help="leave out the variant tables (row loops, split step, dh by neuron)")
    ap.add_argument("--cpu", action="store_true",
                    help="time the CPU (Numba) step of a small model (D=256, H=1024, M=4096) instead")
    args = ap.parse_args(argv)
    if args.cpu:
        r = bench_cpu()
        print(json.dumps(r))
        print(f"\nCPU training step, gated FFN M={r['M']} D={r['D']} H={r['H']} nnz={r['nnz']} float32: "
              f"twellpy {r['tw_ms']:.1f} ms, dense numpy {r['dense_ms']:.1f} ms, "
              f"speedup {r['dense_ms'] / r['tw_ms']:.2f}x, max rel err {max(r['rel_err'].values()):.1e}")
        return 0
    cp = _cp()
    dev = cp.cuda.runtime.getDeviceProperties(0)["name"].decode()
    results = []
    for name in args.workloads:
        r = bench(name, args.reps, [int(w) if w.isdigit() else w for w in args.widths], quick=args.quick)
        print(json.dumps(r), flush=True)
        results.append(r)
        cp.get_default_memory_pool().free_all_blocks()
    out = os.environ.get("OUT")
    if out:
        Path(out, "train_bench.json").write_text(json.dumps({"device": dev, "results": results}, indent=1))
    print(f"\ntraining fwd+bwd, gated FFN, bf16, l1={L1}, {dev}")
    print(f"{'workload':9} {'l0':>6} {'W':>4} {'R':>5} {'dense ms':>9} {'twellpy ms':>10} {'(fwd/bwd)':>13} "
          f"{'speedup':>7} {'gate GEMM':>9} {'mem dense MB':>12} {'mem tw MB':>9} {'ratio':>5} "
          f"{'max rel err tw / dense':>22}")
    for r in results:
        e_tw = max(r["tw_rel_err"].values())
        e_d = max(r["torch_rel_err"].values())
        print(f"{r['workload']:9} {r['l0']:6.1f} {r['tw_width']:4d} {r['tw_backup_rows']:5d} "
              f"{r['torch_ms'][0]:9.3f} {r['tw_ms'][0]:10.3f} "
              f"{r['tw_fwd_ms'][0]:6.2f}/{r['tw_bwd_ms'][0]:<6.2f} {r['speedup']:6.2f}x "
              f"{r['gate_gemm_ms'][0]:9.3f} {r['torch_extra_peak_MB']:12.0f} {r['tw_extra_peak_MB']:9.0f} "
              f"{r['mem_ratio']:5.2f} {e_tw:10.2e} / {e_d:9.2e}")
    for r in results:
        for row in r["widths"]:
            print(f"{r['workload']} width {row['width_arg']!s:>13}: " + width_line(row, r["torch_ms"][0],
                                                                                 r["torch_extra_peak_MB"])
                  + f" (default width {r['tw_ms'][0]:.3f} ms)")
    for r in results:
        for row in r["rows"]:
            print(f"{r['workload']} row loops (TWELLPY_TRAIN_ROWS) {row['variant']:>14}: fwd {row['fwd_ms'][0]:.3f} ms, "
                  f"bwd {row['bwd_ms'][0]:.3f} ms, same bits as {ROW_VARIANTS[0][0]}: {row['same_bits']}")
    for r in results:
        if r["tw_split_ran"] is None:
            continue
        print(f"{r['workload']} split step (TWELLPY_TRAIN_SPLIT): fwd {r['tw_fwd_split_ms'][0]:.3f} ms "
              f"(fused {r['tw_fwd_ms'][0]:.3f}), bwd {r['tw_bwd_split_ms'][0]:.3f} ms "
              f"(fused {r['tw_bwd_ms'][0]:.3f}), step {r['tw_split_ms'][0]:.3f} ms "
              f"({r['torch_ms'][0] / r['tw_split_ms'][0]:.2f}x dense); split ran: {r['tw_split_ran']}, "
              f"same bits: {r['tw_split_bits_equal']}")
    for r in results:
        print(f"{r['workload']} exact path (speculate=False, TWELLPY_TRAIN_SPECULATE=0): step "
              f"{r['tw_exact_ms'][0]:.3f} ms against the default's {r['tw_ms'][0]:.3f} (again after: "
              f"{r['tw_ms_after'][0]:.3f}), {r['speedup_exact']:.2f}x dense; "
              f"fwd {r['tw_exact_fwd_ms'][0]:.3f} ms (default {r['tw_fwd_ms'][0]:.3f}); the default "
              f"({r['tw_compared_path']}) gave "
              f"its bits: {r['tw_exact_bits_equal']}; extra memory {r['tw_exact_extra_peak_MB']:.0f} MB")
    for r in results:
        print(setting_line(r["workload"], "side stream (TWELLPY_TRAIN_SIDE_STREAM)", r["side_stream"]))
        print(setting_line(r["workload"], "pair transpose (TWELLPY_PAIR_TRANSPOSE)", r["pair_transpose"]))
        if "gate_chunks" in r:
            print(setting_line(r["workload"], "gate chunks (TWELLPY_TRAIN_GATE_CHUNKS)", r["gate_chunks"]))
        print(setting_line(r["workload"], "backward's ELL kernel first (TWELLPY_TRAIN_BWD_ELL_FIRST)",
                           r["bwd_ell_first"]))
        if "speculate_chunked" in r:
            print(setting_line(r["workload"], "chunked speculation (TWELLPY_TRAIN_SPECULATE_CHUNKED)",
                               r["speculate_chunked"]))
    for r in results:
        if "on" not in r.get("dh_by_neuron", {}):
            continue
        d = r["dh_by_neuron"]
        print(f"{r['workload']} dh by neuron (TWELLPY_TRAIN_DH_BY_NEURON, default {int(d['default'])}): "
              f"bwd {d['on']['bwd_ms'][0]:.3f} ms against {d['off']['bwd_ms'][0]:.3f} by rows, step "
              f"{d['on']['step_ms'][0]:.3f} against {d['off']['step_ms'][0]:.3f} "
              f"({r['torch_ms'][0] / d['on']['step_ms'][0]:.2f}x / {r['torch_ms'][0] / d['off']['step_ms'][0]:.2f}x "
              f"dense); gradients' largest rel difference {d['rel_diff']:.2e}")
    for r in results:
        for label, name in (("", "twellpy"), ("exact_", "twellpy exact path")):
            print(f"{r['workload']} {name} phases (ms): " +
                  ", ".join(f"{k} {v:.3f}" for k, v in r[f"tw_{label}phases_ms"].items()))
            print(f"{r['workload']} {name} host clock between the same marks (ms): " +
                  ", ".join(f"{k} {v:.3f}" for k, v in r[f"tw_{label}host_phases_ms"].items()))
    for r in results:
        for key, how in (("tw_device_lead_ms", "transpose first"), ("tw_device_lead_ms_ell_first", "ELL first")):
            print(f"{r['workload']} device lead over the host at each mark of one step, {how} (ms; near 0: "
                  "the device waited for the host): " + ", ".join(f"{k} {v:.3f}" for k, v in r[key].items()))
    print("targets: speedup >= 2.0x at W1-16k, >= 1.2x at W2; memory ratio <= 0.5; rel err <= 1e-2")
    return 0


if __name__ == "__main__":
    sys.exit(main())
