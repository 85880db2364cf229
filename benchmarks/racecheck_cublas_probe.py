"""Does compute-sanitizer racecheck survive one bfloat16 cuBLAS GEMM? (no twellpy kernel involved)

On the H200 (2026-12-04, compute-sanitizer of CUDA 13, CuPy 14) it does not: run under
``compute-sanitizer --tool racecheck --kernel-name kns=twellpy_`` this script ends with
"Internal Sanitizer Error: The Sanitizer failed to handle a hardware exception" and
cudaErrorIllegalAddress, while the same script without the sanitizer prints the right sum.
The training tests in bfloat16 start with that GEMM, so racecheck cannot run them; memcheck
can (it checked the same tests with 0 errors). float32 GEMMs are not affected.

Usage on the device:  PYTHONPATH=. compute-sanitizer --tool racecheck --kernel-name kns=twellpy_ \\
    python benchmarks/racecheck_cublas_probe.py
"""
import numpy as np

import cupy as cp
import twellpy.backends.cuda_train as cuda_train
from twellpy._array import bfloat16

x = cp.asarray(np.ones((256, 512), dtype=bfloat16))
c = cuda_train.gemm(x, x.T, np.float32)  # cublasGemmEx, bf16 inputs, fp32 accumulation
cp.cuda.Device().synchronize()
print("bf16 gemm ok:", float(c[0, 0]), "(expected 512.0)")
