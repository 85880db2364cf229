"""Why does the freed-object warning not come under compute-sanitizer? (pending item 2)
Replays the end of test_decode_calls_defer_the_finite_check with prints."""
import gc, os, sys, traceback, warnings, weakref
sys.path.insert(0, ".")
import numpy as np
import cupy as cp
if os.environ.get("TWELLPY_SANITIZE") == "1":
    cp.cuda.set_allocator(None)
from benchmarks.workloads import make_ffn
from twellpy.ffn import GatedFFN

m = 4
w = make_ffn(m, 128, 512, 12, dtype=np.float32, xp=cp, seed=74)
bad = w["x"].copy(); bad[m - 1, 3] = np.nan
for label in ("inspect", "free"):
    f = GatedFFN(w["w_gate"], w["w_up"], w["w_down"])
    f(w["x"]); f(bad)
    plan = f._plan
    print(label, "info", f.last_info.get("finite_check"), "graphs", getattr(plan, "graphs", None),
          "check", plan._check, "ledger", plan._ledger, "unreported", plan._unreported, flush=True)
    if label == "inspect":
        try:
            print("  in flight", plan._counts_in_flight(), flush=True)
            plan._done.synchronize()
            print("  landed", plan._landed_counts(wait="all"), flush=True)
        except Exception:
            traceback.print_exc()
        del plan, f
        continue
    wr = weakref.ref(plan)
    referrers = len(gc.get_referrers(plan))
    del plan
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        del f
        gc.collect()
    print("  plan freed:", wr() is None, "referrers before:", referrers, "warnings:", [str(g.message)[:120] for g in got], flush=True)
    if wr() is not None:
        for r in gc.get_referrers(wr()):
            print("  held by", type(r), str(r)[:200])
