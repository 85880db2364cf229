"""Can cuBLASLt's ReLU bit mask replace the row pack's read of the whole gate output?
(issue 4 inference, issue 5 training: one short GPU call)

The row pack and the training count and pack read all of ``g = x @ w_gate.T`` (184 MB
at W1-16k) after the GEMM wrote it. ``CUBLASLT_EPILOGUE_RELU_AUX`` writes a bit per
entry of g in the GEMM's epilogue (11.5 MB), so a pack could read the bits and only
the flagged values (``twellpy_ffn_rowpack_mask``). Before anything uses it, this
probe answers on the device:

1. **What the bits mean.** On the workload's g and on a small problem made of edge
   cases (an accumulator below bfloat16's smallest denormal, exact zeros, NaN from
   inf * 0, +-inf), it compares the mask, read with either bit order, against the
   row pack's own test on the plain GEMM's g (positive, or NaN): entries it misses
   (would be lost: the mask could not be used where any occur), and extra ones
   (harmless: tested and dropped). It also says whether the epilogue's g has the
   plain GEMM's bits after the ReLU (cuBLASLt may pick another algorithm).
2. **What it costs.** In alternating rounds: the plain GEMM (cuBLAS, as the FFN runs
   it), cuBLASLt with the ReLU-mask epilogue, the row pack of the plain g and the mask
   row pack, the training count and pack of g and its mask twin
   (``relu_count_pack_mask``); then whether each pair wrote the same outputs.

Prediction (H100, W1-16k, written before any run): the epilogue GEMM within 3% of the
plain one; the mask row pack 0.015-0.03 ms against 0.081 ms, the mask count and pack
0.03-0.05 ms against 0.125 ms (its neuron-count atomics stay); an inference call
0.05-0.065 ms shorter (1.38x -> 1.44-1.46x), a training step 0.07-0.10 ms shorter, if the
bits flag every active entry.

Usage (device, repository root): ``PYTHONPATH=. python benchmarks/relu_mask_probe.py [--reps 30] [--rounds 3]``
"""
# twellpy-bench: suite gpu-only
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.train import time_ms  # noqa: E402
from benchmarks.workloads import make_ffn  # noqa: E402
from twellpy._array import bfloat16  # noqa: E402
from twellpy.backends import _registry  # noqa: E402
from twellpy.backends import cuda_train as ct  # noqa: E402
from twellpy.backends._cublaslt import ReluMaskGemm  # noqa: E402

CAPR = 64  # list capacity of the row packs compared (the FFN's LIST_ROW_CAP is larger; 64 covers W1)


def mask_bits(mask, H, order):
    """(M, H) bool of a (M, words) uint32 mask read with bit ``order`` ("little": bit c % 32
    of word c // 32 is the LSB-first bit; "big": MSB-first within each byte)."""
    raw = np.ascontiguousarray(mask).view(np.uint8)
    return np.unpackbits(raw, axis=1, bitorder=order)[:, :H].astype(bool)


def active(g):
    """The row pack's test on the host: positive, or NaN (bfloat16 denormals aside: the
    GPU's -ftz test drops them; they are reported apart)."""
    f = np.asarray(g).astype(np.float32)
    return np.isnan(f) | (f > 0)


def compare(name, g_plain, g_lt, mask, H, log):
    """Report the mask against the row pack's test on ``g_plain``, both bit orders."""
    want = active(g_plain)
    denormal = (np.abs(np.asarray(g_plain).astype(np.float32)) < np.finfo(np.float32).tiny) & want & ~np.isnan(
        np.asarray(g_plain).astype(np.float32))
    out = {"case": name, "active": int(want.sum()), "bf16_denormal_active": int(denormal.sum())}
    for order in ("little", "big"):
        bits = mask_bits(mask, H, order)
        out[f"missed_{order}"] = int((want & ~bits).sum())
        out[f"extra_{order}"] = int((bits & ~want).sum())
    relu_plain = np.where(active(g_plain) & ~np.isnan(np.asarray(g_plain).astype(np.float32)),
                          np.asarray(g_plain).astype(np.float32), 0.0)
    g_lt32 = np.asarray(g_lt).astype(np.float32)
    both_nan = np.isnan(g_lt32) & np.isnan(np.asarray(g_plain).astype(np.float32))
    out["lt_equals_relu_of_plain"] = int(((g_lt32 == relu_plain) | both_nan).sum()) == g_lt32.size
    out["lt_nan"] = int(np.isnan(g_lt32).sum())
    out["plain_nan"] = int(np.isnan(np.asarray(g_plain).astype(np.float32)).sum())
    log(f"{name:28s} active {out['active']:>9d}  missed (little/big) {out['missed_little']}/{out['missed_big']}"
        f"  extra {out['extra_little']}/{out['extra_big']}  Lt g == relu(plain g): {out['lt_equals_relu_of_plain']}"
        f"  NaN plain/Lt {out['plain_nan']}/{out['lt_nan']}  bf16-denormal active {out['bf16_denormal_active']}")
    return out


def edge_problem(cp):
    """x (64, 64), w (256, 64) bfloat16. Rows 8 and on give, column by column: exact
    zeros (0-7), an accumulator of 1e-45 (8-15; below bfloat16's smallest denormal, so it
    rounds to 0), one of 1e-39 (16-23; a bfloat16 denormal), +inf (24-31, overflow), -inf
    (40-47), then ordinary values of both signs. Rows 0-7 hold an inf in x: NaN (inf * 0)
    in most columns, +inf in 48-55 and -inf in 56-63."""
    rng = np.random.default_rng(3)
    M, D, H = 64, 64, 256
    x = rng.standard_normal((M, D)).astype(np.float32)
    w = rng.standard_normal((H, D)).astype(np.float32)
    w[0:48] = 0.0
    x[:, 0] = 1e-23
    w[8:16, 0] = 1e-22                             # 1e-45
    w[16:24, 0] = 1e-16                            # 1e-39
    x[:, 1] = 10.0
    w[24:32, 1] = 3e38                             # 3e39: +inf
    w[40:48, 1] = -3e38                            # -inf
    x[:, 2] = 0.0
    x[0:8, 2] = np.inf
    w[:, 2] = 0.0
    w[48:56, 2] = 1.0
    w[56:64, 2] = -1.0
    return cp.asarray(x.astype(bfloat16)), cp.asarray(w.astype(bfloat16))


EDGE_COLUMNS = (("zeros", slice(0, 8)), ("1e-45", slice(8, 16)), ("1e-39", slice(16, 24)),
                ("+inf", slice(24, 32)), ("-inf", slice(40, 48)), ("ordinary", slice(64, 256)))


def main(argv=None):
    import cupy as cp

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    lines = []

    def log(msg):
        lines.append(msg)
        print(msg, flush=True)

    rows = {"semantics": [], "timing": {}}
    # 1. what the bits mean
    xe, we = edge_problem(cp)
    lte = ReluMaskGemm(we)
    ge_plain = ct.gemm(xe, we.T, bfloat16)  # the GEMM the FFN runs (cublasGemmEx, fp32 accumulation)
    ge_lt = cp.empty_like(ge_plain)
    me = lte.new_mask(xe.shape[0])
    me.fill(0xA5A5A5A5)  # poison: words the epilogue leaves alone show up as extra or missed bits
    lte(xe, ge_lt, me)
    rows["semantics"].append(compare("edge cases", ge_plain.get(), ge_lt.get(), me.get(), we.shape[0], log))
    f_plain, f_lt = ge_plain.get().astype(np.float32), ge_lt.get().astype(np.float32)
    bits = mask_bits(me.get(), we.shape[0], "little")  # LSB-first (the compare line says which order holds)
    cases = [(label, slice(8, 64), cols) for label, cols in EDGE_COLUMNS]
    cases += [("x inf: NaN", slice(0, 8), slice(0, 48)), ("x inf: +inf", slice(0, 8), slice(48, 56)),
              ("x inf: -inf", slice(0, 8), slice(56, 64))]
    for label, rws, cols in cases:
        log(f"  {label:12s} plain g {np.unique(f_plain[rws, cols])[:3]}  Lt g {np.unique(f_lt[rws, cols])[:3]}"
            f"  bits set {int(bits[rws, cols].sum())} of {bits[rws, cols].size}")
    w = make_ffn(16384, 2048, 5632, 30, dtype=bfloat16, xp=cp, seed=1)
    x, wg = w["x"], cp.ascontiguousarray(w["w_gate"])
    M, H = x.shape[0], wg.shape[0]
    lt = ReluMaskGemm(wg)
    lt_plain = ReluMaskGemm(wg, relu_mask=False)  # cuBLASLt's own algorithm choice, no epilogue
    g_plain = cp.empty((M, H), bfloat16)
    g_lt = cp.empty((M, H), bfloat16)
    mask = lt.new_mask(M)
    mask.fill(0xA5A5A5A5)
    g_spare = cp.empty((M, H), bfloat16)
    ct.gemm(x, wg.T, bfloat16, into=g_plain)
    lt(x, g_lt, mask)
    rows["semantics"].append(compare("W1-16k", g_plain.get(), g_lt.get(), mask.get(), H, log))
    lt_plain(x, g_spare, None)
    same_plain = bool((g_spare.view(cp.uint16) == g_plain.view(cp.uint16)).all())
    log(f"cuBLASLt without epilogue gives the plain GEMM's bits: {same_plain}")
    rows["lt_plain_same_bits"] = same_plain
    # 2. what it costs
    ctype = _registry.ctype(bfloat16)
    rowpack = _registry.get_kernel("ffn_pack.cu", f"twellpy_ffn_rowpack<{ctype}>")
    rowpack_mask = _registry.get_kernel("ffn_pack.cu", f"twellpy_ffn_rowpack_mask<{ctype}>")
    lists = [(cp.empty((M, CAPR), cp.int32), cp.empty((M, CAPR), cp.float32), cp.empty(M, cp.int32)) for _ in range(2)]
    null = np.uint64(0)  # no total

    def pack_plain():
        rowpack(((M + 7) // 8,), (256,), (g_plain, cp.int64(H), cp.int32(M), cp.int32(H), cp.int32(CAPR),
                                          *lists[0], null))

    def pack_mask():
        rowpack_mask(((M + 7) // 8,), (256,), (mask, cp.int64(lt.mask_words), g_lt, cp.int64(H), cp.int32(M),
                                               cp.int32(H), cp.int32(CAPR), *lists[1], null))

    W, cap = 64, 64  # the training forward's width and a backup capacity at W1-16k
    cases = {"plain GEMM (cuBLAS)": lambda: ct.gemm(x, wg.T, bfloat16, into=g_plain),
             "cuBLASLt GEMM + ReLU mask": lambda: lt(x, g_lt, mask),
             "cuBLASLt GEMM, no epilogue": lambda: lt_plain(x, g_spare, None),
             "row pack of g": pack_plain,
             "mask row pack": pack_mask,
             "training count and pack of g": lambda: ct.relu_count_pack(g_plain, W, cap),
             "training count and pack, mask": lambda: ct.relu_count_pack_mask(mask, g_lt, W, cap)}
    for r in range(args.rounds):
        names = list(cases)
        for name in names[r % len(names):] + names[:r % len(names)]:
            rows["timing"].setdefault(name, []).append(time_ms(cases[name], args.reps)[0])
    # the mask pack against the row pack of the same g (the epilogue's): the lists must be equal
    rowpack(((M + 7) // 8,), (256,), (g_lt, cp.int64(H), cp.int32(M), cp.int32(H), cp.int32(CAPR), *lists[0], null))
    pack_mask()
    live = cp.arange(CAPR)[None, :] < cp.minimum(lists[0][2], CAPR)[:, None]
    same = bool((lists[0][2] == lists[1][2]).all() and (lists[0][0] == lists[1][0])[live].all()
                and (lists[0][1].view(cp.uint32) == lists[1][1].view(cp.uint32))[live].all())
    plain_cp = ct.relu_count_pack(g_lt, W, cap)
    mask_cp = ct.relu_count_pack_mask(mask, g_lt, W, cap)
    same_cp = all(bool((a.view(cp.uint8) == b.view(cp.uint8)).all())
                  for a, b in zip((plain_cp[0][:M * W],) + tuple(plain_cp[1:]), (mask_cp[0][:M * W],) + tuple(mask_cp[1:])))
    rows["same_count_pack"] = same_cp
    log("")
    log(f"{'what (W1-16k, bf16)':32s} {'median ms':>10s}  rounds")
    for name, times in rows["timing"].items():
        log(f"{name:32s} {float(np.median(times)):10.4f}  {' '.join(f'{t:.4f}' for t in times)}")
    log(f"mask row pack wrote the row pack's lists of the epilogue's g: {same}")
    log(f"mask count and pack wrote the count and pack's outputs of the epilogue's g: {same_cp}")
    rows["same_lists"] = same
    out = os.environ.get("OUT")
    if out:
        Path(out, "relu_mask_probe.json").write_text(json.dumps(rows, indent=1, default=float))


if __name__ == "__main__":
    main()
