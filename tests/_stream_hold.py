"""A kernel that holds a CUDA stream until the host releases it (GPU tests only).

Used to prove that a call returns without waiting for the kernels it queued:
queue a hold in the middle of the call's work, time the call, then release.
The kernel gives up on its own after about four seconds, so an implementation
that does wait fails its timing assertion instead of hanging the suite.
"""
import numpy as np

_SRC = r"""
extern "C" __global__ void twellpy_test_hold(const volatile unsigned int* flag, long long max_cycles) {
    const long long t0 = clock64();
    while (*flag == 0u && clock64() - t0 < max_cycles) __nanosleep(1000);
}
"""
#: about 4 s at the H100/H200 SM clock
MAX_CYCLES = np.int64(8_000_000_000)


class StreamHold:
    """``enqueue(stream)`` queues a hold; ``release()`` lets every queued hold finish."""

    def __init__(self):
        import cupy as cp
        import cupyx

        self._kernel = cp.RawKernel(_SRC, "twellpy_test_hold")
        # pinned host memory is addressable from the device at the same pointer (UVA)
        self._flag = cupyx.empty_pinned((1,), np.uint32)
        # compile and load now, outside the caller's timed window: a released hold returns at once
        self._flag[0] = 1
        self.enqueue()
        cp.cuda.get_current_stream().synchronize()
        self._flag[0] = 0

    def enqueue(self, stream=None):
        import cupy as cp

        with (stream or cp.cuda.get_current_stream()):
            self._kernel((1,), (1,), (np.uint64(self._flag.ctypes.data), MAX_CYCLES))

    def release(self):
        self._flag[0] = 1

    def rearm(self):
        self._flag[0] = 0
