"""Time the training step with the backward's dh by neuron against the row flow, on the device.

Usage (device, repo root)::

    python benchmarks/dh_by_neuron_probe.py W1-16k W1-64k W2 [--rounds 2]

Each round times, for every workload, one gated training step (median of 10 after 3
warm-ups, ``check_finite=False``, the exact path: ``tree_step_time.step_ms``) with
``_ffn_train.DH_BY_NEURON`` off (the row-oriented backward), then on with each
``cuda_train.DH_DEFINES`` variant of ``twellpy_train_wgrad_dh`` (``TW_DH_BATCH``
entries a step, ``TW_DH_PREFETCH`` the next step's gathers in flight), and prints a
line per step. Rounds alternate the variants so that drift shows. ``train.py``'s
"dh by neuron" line checks the two flows' gradients against each other.
"""
import argparse
import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
VARIANTS = [("rows", False, {}), ("neuron b4", True, {}), ("neuron b2", True, {"TW_DH_BATCH": 2}),
            ("neuron b1", True, {"TW_DH_BATCH": 1}),
            ("neuron b2 pf", True, {"TW_DH_BATCH": 2, "TW_DH_PREFETCH": 1}),
            ("neuron b4 pf", True, {"TW_DH_PREFETCH": 1})]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workloads", nargs="+")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    sys.path[:0] = [str(HERE), str(HERE.parent)]
    import tree_step_time
    from twellpy import _ffn_train as T
    from twellpy.backends import cuda_train as ct

    spec = importlib.util.spec_from_file_location("_probe_workloads", HERE / "workloads.py")
    wl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wl)
    saved = T.DH_BY_NEURON, ct.DH_DEFINES
    try:
        for _ in range(args.rounds):
            for label, on, defines in VARIANTS:
                T.DH_BY_NEURON, ct.DH_DEFINES = on, defines
                for name in args.workloads:
                    med, low, W, R = tree_step_time.step_ms(T, wl, name)
                    print(f"{label:13s} {name}: step {med:.3f} ms (min {low:.3f}) W {W} R {R}", flush=True)
    finally:
        T.DH_BY_NEURON, ct.DH_DEFINES = saved


if __name__ == "__main__":
    main()
