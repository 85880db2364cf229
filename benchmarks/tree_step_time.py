"""Time one gated training step of another twellpy tree, to find which commit moved a number.

Copy the package of each commit to compare into the working tree (untracked folders travel
to the device), then time them on one machine in one call::

    for c in 3ae8b00 e563fda; do mkdir -p oldtrees/$c && git archive $c twellpy raw_kernels | tar -x -C oldtrees/$c; done
    # device, repo root:
    for t in oldtrees/3ae8b00 oldtrees/e563fda .; do python benchmarks/tree_step_time.py $t W1-16k W2; done

The inputs come from this tree's ``benchmarks/workloads.py`` (bf16 through torch), so
every tree gets the same ones; only the ``twellpy`` package differs. A tree whose
forward takes ``speculate`` runs with ``speculate=False`` (the exact path, as older
trees). It prints the median of 10 steps (forward + backward, ``check_finite=False``)
after 3 warm-up steps, with W and R. The thirty-third session found a 24% regression
of the training step at W1-16k this way (docs/bench_logs/session33_2026-12-07/).
"""
import importlib.util
import inspect
import statistics
import sys
from pathlib import Path


def step_ms(T, wl, name):
    """Median and min ms of one training step of module ``T`` (a tree's ``twellpy._ffn_train``)
    at workload ``name`` of the workloads module ``wl``, and the step's W and R."""
    import cupy as cp
    import numpy as np
    import torch

    w = wl.make_ffn(**wl.WORKLOADS[name], dtype=np.float32, xp=cp, seed=0)
    tt = [torch.from_dlpack(w[k]).to(torch.bfloat16) for k in ("x", "w_gate", "w_up", "w_down")]
    del w
    M, D = tt[0].shape
    gen = torch.Generator("cuda").manual_seed(5)
    dy = (torch.randn(M, D, device="cuda", generator=gen) / M ** 0.5).to(torch.bfloat16)
    # the signature, not __code__: the public functions are wrapped (quiet_underflow)
    kw = {"speculate": False} if "speculate" in inspect.signature(T.gated_forward_train).parameters else {}

    def step():
        _, ctx = T.gated_forward_train(*tt, l1=2e-5, check_finite=False, **kw)
        T.gated_backward(ctx, dy)
        return ctx

    for _ in range(3):
        ctx = step()
    times = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), min(times), ctx.width, ctx.R


def main(argv):
    root = Path(argv[0]).resolve()
    sys.path.insert(0, str(root))   # the tree's twellpy before this one's
    spec = importlib.util.spec_from_file_location(
        "_tree_workloads", Path(__file__).resolve().parent / "workloads.py")
    wl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wl)
    import twellpy
    from twellpy import _ffn_train as T

    assert Path(twellpy.__file__).resolve().is_relative_to(root), f"imported {twellpy.__file__}, not {root}"
    for name in argv[1:]:
        med, low, W, R = step_ms(T, wl, name)
        print(f"{root.name} {name}: step {med:.3f} ms (min {low:.3f}), W {W}, R {R}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
