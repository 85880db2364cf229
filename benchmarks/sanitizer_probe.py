"""Positive control for the memcheck runs of ``benchmarks/device_suite.sh``.

Launches a templated kernel named like twellpy's (``twellpy_sanitizer_probe<float>``,
so its mangled name is what ``--kernel-name kns=twellpy_`` must match) that
writes one float just past the end of a 64-float allocation, with CuPy's
memory pool off as in the sanitizer test runs. Run under compute-sanitizer,
the log must show an ``Invalid __global__ write``; if it does not, the tool or
the kernel filter checks nothing and a clean suite run would prove nothing.
"""
import cupy as cp

SOURCE = r"""
template <typename T>
__global__ void twellpy_sanitizer_probe(T* a, int n) {
    if (threadIdx.x == 0 && blockIdx.x == 0) a[n] = T(1);  // one element past the end: planted
}
"""


def main():
    cp.cuda.set_allocator(None)  # exact cudaMalloc sizes: the pool would hide the overrun
    module = cp.RawModule(code=SOURCE, options=("--std=c++17",),
                          name_expressions=["twellpy_sanitizer_probe<float>"])
    kernel = module.get_function("twellpy_sanitizer_probe<float>")
    a = cp.zeros(64, cp.float32)
    try:
        kernel((1,), (32,), (a, cp.int32(a.size)))
        cp.cuda.Device().synchronize()
        print("sanitizer probe: kernel ran (no sanitizer attached, or it did not stop the kernel)")
    except cp.cuda.runtime.CUDARuntimeError as exc:  # memcheck aborts the kernel
        print(f"sanitizer probe: kernel stopped: {exc}")


if __name__ == "__main__":
    main()
