"""Which host calls wait for queued GPU work under compute-sanitizer, and which do not.

Two GPU tests (``test_backward_check_of_dy_does_not_wait_for_its_own_kernels``) queue a
kernel that holds the stream (up to about four seconds), then time a call that must return
without waiting for it. Under memcheck they failed (2026-12-06, H100: 4.15 s and 4.24 s)
while the same tests pass without the sanitizer. This probe times each kind of host call
the backward makes, with the stream held, once plain and once under the sanitizer::

    python benchmarks/sanitizer_sync_probe.py
    compute-sanitizer --tool memcheck --kernel-name kns=twellpy_ python benchmarks/sanitizer_sync_probe.py

A call that takes about as long as the hold waited for it.
"""
import sys
import time
from pathlib import Path

import cupy as cp
import cupyx
import numpy as np

# the tests' own stream hold (about 4 s before it gives up), so the probe holds the stream
# exactly as the timing tests do
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _stream_hold import StreamHold  # noqa: E402

_SRC = r"""
extern "C" __global__ void twellpy_probe_touch(float* a) { a[threadIdx.x] += 1.0f; }
extern "C" __global__ void other_probe_touch(float* a) { a[threadIdx.x] += 1.0f; }
"""


def main():
    mod = cp.RawModule(code=_SRC)
    touch_ours = mod.get_function("twellpy_probe_touch")
    touch_other = mod.get_function("other_probe_touch")
    hold = StreamHold()  # compiles and loads its kernel now
    a = cp.zeros(1024, cp.float32)
    pinned_out = cupyx.empty_pinned((4,), np.float32)
    side = cp.cuda.Stream(non_blocking=True)
    touch_ours((1,), (32,), (a,))
    touch_other((1,), (32,), (a,))
    cp.cuda.Device().synchronize()
    sizes = iter(range(1, 1000))

    def fresh_alloc():  # a size the pool has never seen: a cudaMalloc
        cp.cuda.alloc((64 << 20) + next(sizes) * 4096)

    def async_copy_to_pinned():
        a[:4].get(out=pinned_out, stream=cp.cuda.get_current_stream(), blocking=False)

    def event_record():
        cp.cuda.Event().record()

    def side_stream_kernel():
        with side:
            touch_ours((1,), (32,), (a[512:],))

    probes = {
        "launch twellpy_ kernel (instrumented)": lambda: touch_ours((1,), (32,), (a,)),
        "launch other kernel (not instrumented)": lambda: touch_other((1,), (32,), (a,)),
        "twellpy_ kernel on another stream": side_stream_kernel,
        "fresh cudaMalloc (pool miss)": fresh_alloc,
        "pool hit (cp.empty of a freed size)": lambda: cp.empty(1024, cp.float32),
        "async copy to pinned host": async_copy_to_pinned,
        "event record": event_record,
    }
    print(f"{'host call with the stream held':42s} {'seconds':>8s} {'hold launch':>12s}")
    for name, call in probes.items():
        hold.rearm()
        t0 = time.perf_counter()
        hold.enqueue()
        hold_launch = time.perf_counter() - t0
        t0 = time.perf_counter()
        call()
        took = time.perf_counter() - t0
        hold.release()
        cp.cuda.Device().synchronize()
        print(f"{name:42s} {took:8.3f} {hold_launch:12.3f}{'   <- waited for the hold' if took > 0.5 else ''}")


if __name__ == "__main__":
    main()
