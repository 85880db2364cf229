"""How often the training step's ELL width W changes from step to step (CPU, seconds).

A speculative training step (``speculate``, on by default on the GPU) is kept only
when the layer's previous W is the one this step's counts pick, so the rate at
which W moves between steps is the rate of re-runs. This models the active neurons
per token of the reference workloads (docs/workloads.md) as their generator makes
them: a token's gate pre-activations are N(0, s^2) with s^2 = |x[1:]|^2 / (D - 1)
(times exp(2 sigma N(0, 1)) for uneven workloads) against the threshold that gives
the mean count, so its count is Binomial(H, P(N(0, s^2) > t)). Fresh tokens every
step; the weights (hence t) stay. For each workload it prints how often the raw
width (``min_storage`` / ``quantile:0.9``, as before the grid) and ``width="auto"``
(on the grid) change between consecutive steps, and the mean number of rows wider
than each (the dense backup rows).

Usage: ``python benchmarks/width_drift.py [--steps 100] [--workloads W1-16k W2]``
"""
# twellpy-bench: suite
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from scipy.stats import norm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.workloads import WORKLOADS  # noqa: E402
from twellpy._ffn_train import choose_width  # noqa: E402


def token_counts(rng, M, D, H, nnz, sigma=0.0, **_):
    """Active neurons per token of one fresh batch (see the module docstring)."""
    t = norm.isf(nnz / H)
    s = np.sqrt(rng.chisquare(D - 1, M) / (D - 1))
    if sigma:
        s *= np.exp(sigma * rng.standard_normal(M))
    return rng.binomial(H, norm.sf(t / s))


def drift(name, steps, seed=0):
    """Change rates of the raw and the grid width over ``steps`` steps of workload ``name``."""
    spec = WORKLOADS[name]
    H = spec["H"]
    sizes = dict(n_cols=H, slot_bytes=2 * 2 + 4, row_bytes=2 * 2 * H)   # gated, bf16
    rng = np.random.default_rng(seed)
    raw, grid, raw_wide, grid_wide = [], [], [], []
    for _ in range(steps):
        c = token_counts(rng, **spec)
        grid.append(choose_width(c, "auto", **sizes))
        raw.append(max(choose_width(c, "min_storage", **sizes), choose_width(c, "quantile:0.9")))
        raw_wide.append(int(np.count_nonzero(c > raw[-1])))
        grid_wide.append(int(np.count_nonzero(c > grid[-1])))
    raw, grid = np.array(raw), np.array(grid)
    return {"workload": name, "raw_range": (int(raw.min()), int(raw.max())),
            "grid_range": (int(grid.min()), int(grid.max())),
            "raw_changes": float(np.mean(raw[1:] != raw[:-1])),
            "grid_changes": float(np.mean(grid[1:] != grid[:-1])),
            "raw_backup_rows": float(np.mean(raw_wide)), "grid_backup_rows": float(np.mean(grid_wide))}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--workloads", nargs="+", default=["W1-16k", "W1-64k", "W2", "W3", "W5", "U1-s0.3"],
                    choices=sorted(WORKLOADS))
    args = ap.parse_args(argv)
    print(f"{'workload':9} {'raw W':>9} {'changes':>8} {'R':>7} {'auto W':>9} {'changes':>8} {'R':>7}"
          f"   ({args.steps} steps; R: mean backup rows)")
    for name in args.workloads:
        r = drift(name, args.steps)
        print(f"{name:9} {'%d-%d' % r['raw_range']:>9} {r['raw_changes']:8.0%} {r['raw_backup_rows']:7.1f} "
              f"{'%d-%d' % r['grid_range']:>9} {r['grid_changes']:8.0%} {r['grid_backup_rows']:7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
