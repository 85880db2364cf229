"""Where the training forward's count and pack spends its time (issue 5, one GPU call).

At W1-16k on an H100 (2026-12-07) the forward's gate GEMM plus count and pack took
0.705 ms against 0.514 ms for the GEMM alone: about 0.19 ms for one read of the 184 MB
gate output, while the inference row pack (``twellpy_ffn_rowpack``) reads the same
bytes in about 0.07 ms. This probe times, on the workload's own gate output ``z``:

* the gate GEMM alone, and followed by the count and pack in 1, 2, 4 and 8 row chunks
  (``gate_count_pack``; chunks let each pack read what the GEMM has just written);
* ``relu_count`` (a read of z, no writes), the inference row pack, a copy of z;
* ``relu_count`` and ``relu_count_pack`` with their default tuning and with
  ``TW_PACK_WORDS=1``, ``TW_PACK_STREAM=1``, ``TW_PACK_UNROLL=2`` and combinations, each checked for the default's bits
  and timed in ``--rounds`` alternating rounds (each round starts one variant later).

It prints one line per measurement: median ms and the z read rate (GB/s).

Usage (device, repository root): ``PYTHONPATH=. python benchmarks/count_pack_probe.py [--workload W1-16k] [--reps 50]``
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.train import L1, time_ms, train_inputs  # noqa: E402
from twellpy import _ffn_train as T  # noqa: E402
from twellpy._array import bfloat16  # noqa: E402
from twellpy.backends import _registry  # noqa: E402
from twellpy.backends import cuda_train as ct  # noqa: E402

# TW_PACK_WORDS=1: the word test and the scan's ballot shortcuts (thirty-seventh session, off until
# timed); UNROLL 8 and WARPS 4 were slower in every earlier run
VARIANTS = ({}, {"TW_PACK_WORDS": 1}, {"TW_PACK_STREAM": 1}, {"TW_PACK_UNROLL": 2},
            {"TW_PACK_STREAM": 1, "TW_PACK_UNROLL": 2}, {"TW_PACK_WORDS": 1, "TW_PACK_STREAM": 1},
            {"TW_PACK_WORDS": 1, "TW_PACK_UNROLL": 2})


def main(argv=None):
    import cupy as cp

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="W1-16k")
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of the pack's tunings")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.reps < 1:
        ap.error(f"--rounds and --reps must be at least 1, got {args.rounds} and {args.reps}")
    x, wg, wu, wd, dy = train_inputs(args.workload)
    _, ctx = T.gated_forward_train(x, wg, wu, wd, l1=L1, check_finite=False)
    W, cap = ctx.width, max(8, 2 * ctx.R)
    del ctx
    z = ct.gemm(x, wg.T, bfloat16)
    M, H = z.shape
    z_gb = z.nbytes / 1e9
    rows = []

    def add(label, fn, reads_z=True):
        ms = time_ms(fn, args.reps)[0]
        rows.append({"what": label, "ms": ms, "z_GBps": z_gb / (ms * 1e-3) if reads_z else None})
        print(f"{label:55s} {ms:8.4f} ms" + (f"  {rows[-1]['z_GBps']:7.0f} GB/s of z" if reads_z else ""),
              flush=True)

    add("gate GEMM", lambda: ct.gemm(x, wg.T, bfloat16), reads_z=False)
    for chunks in (1, 2, 4, 8):
        add(f"gate GEMM + count and pack, {chunks} chunk(s)",
            lambda: ct.gate_count_pack(x, wg, W, cap, chunks=chunks), reads_z=False)
    add("relu_count (reads z, writes M counts)", lambda: ct.relu_count(z))
    counts_w = cp.empty(M, cp.int32)
    ct.PACK_DEFINES = {"TW_PACK_WORDS": 1}
    try:
        add("relu_count, TW_PACK_WORDS=1", lambda: ct.relu_count(z, out=counts_w))
    finally:
        ct.PACK_DEFINES = {}
    add("relu_count (default) again", lambda: ct.relu_count(z))
    print(f"relu_count same counts with TW_PACK_WORDS=1: {bool((counts_w == ct.relu_count(z)).all())}")
    capr = 64
    lidx = cp.empty((M, capr), cp.int32)
    lval = cp.empty((M, capr), cp.float32)
    rcount = cp.empty(M, cp.int32)
    packs = {}
    for words in (0, 1, 0, 1):  # alternating: the value test (default) and the word test
        rowpack = _registry.get_kernel("ffn_pack.cu", f"twellpy_ffn_rowpack<{_registry.ctype(z.dtype)}>",
                                       FFN_ROWPACK_WORDS=words)
        add(f"inference ffn_rowpack (cap 64), FFN_ROWPACK_WORDS={words}", lambda: rowpack(((M + 7) // 8,), (256,), (
            z, cp.int64(H), cp.int32(M), cp.int32(H), cp.int32(capr), lidx, lval, rcount, ct._NULL_PTR)))
        packs.setdefault(words, [a.copy() for a in (lidx, lval, rcount)])
    # rows past the cap keep unwritten list tails: compare counts, and lists up to the count
    live = cp.arange(capr)[None, :] < cp.minimum(packs[1][2], capr)[:, None]
    print("inference rowpack same lists with FFN_ROWPACK_WORDS=1:",
          bool((packs[1][2] == packs[0][2]).all() and (packs[1][0] == packs[0][0])[live].all()
               and (packs[1][1].view(cp.uint32) == packs[0][1].view(cp.uint32))[live].all()))
    add("copy of z (read + write)", lambda: z.copy())
    # each variant's bits once, then its time in alternating rounds (a fixed order let the
    # first variant run on a cold, slower GPU on 2026-12-07: 0.205 against 0.163 ms)
    base, same = None, {}
    try:
        for defs in VARIANTS:
            ct.PACK_DEFINES = dict(defs)
            got = [a.copy() for a in ct.relu_count_pack(z, W, cap)]
            got[0] = got[0][:M * W]  # the backup part is unwritten
            if base is None:
                base = got
            same[json.dumps(defs)] = all(bool((a.view(cp.uint8) == b.view(cp.uint8)).all())
                                         for a, b in zip(got, base))
        per_round = {key: [] for key in same}
        for r in range(args.rounds):
            order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
            for defs in order:
                ct.PACK_DEFINES = dict(defs)
                per_round[json.dumps(defs)].append(time_ms(lambda: ct.relu_count_pack(z, W, cap), args.reps)[0])
    finally:
        ct.PACK_DEFINES = {}
    for key, times in per_round.items():
        ms = float(np.median(times))
        rows.append({"what": f"relu_count_pack {key}", "ms": ms, "rounds_ms": times, "same_bits": same[key],
                     "z_GBps": z_gb / (ms * 1e-3)})
        print(f"relu_count_pack {key:38s} same bits {same[key]!s:5s} {ms:8.4f} ms  {rows[-1]['z_GBps']:7.0f} GB/s"
              f" of z  (rounds: {' '.join(f'{t:.4f}' for t in times)})", flush=True)
    out = os.environ.get("OUT")
    if out:
        Path(out, "count_pack_probe.json").write_text(json.dumps(
            {"workload": args.workload, "M": M, "H": H, "W": W, "cap": cap, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
