"""CUDA kernels of ``raw_kernels/`` run on the CPU through ``tests/cuda_emu/emu.h``.

The real kernel source is compiled with g++ against a small emulation layer
(one OS thread per CUDA thread, real barriers, warp shuffles through shared
slots), so kernels written on a machine without a GPU have run at least once
before they reach the device: their index arithmetic, barriers, staging and
launch plans are checked here against numpy. The GPU suite (``pytest -m gpu``)
still checks them on the device.

Kernels covered: ``spmm_resident.cu`` (row totals, TwELL compaction, the
resident-slice SpMM), with the launch plan of
:func:`twellpy.backends.cuda.resident_layout`; the fused FFN's split mode and
row pack; the training kernels around the backup rows, the tiled transpose,
the split forward and backward, the row maps and the relu(z) -> Hybrid pack
(also with the speculative forward's backup capacity); the row-block SpMM behind
``TwELL @ W`` (``twellpy_twell_spmm_rows``); the NaN/Inf count of every checked
call (``check.cu``); the counting-sort transpose (``transpose.cu``); and
every loop variant of the
one-pass dense -> TwELL construction (register groups, prefetch, the cp.async
ring, whose copies are plain copies here).
"""
from __future__ import annotations

import ctypes
import hashlib
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from makers import random_sparse
from twellpy._array import bfloat16
from twellpy.backends import _registry as reg
from twellpy.backends import cpu
from twellpy.backends.cuda import resident_layout

EMU = Path(__file__).resolve().parent / "cuda_emu"
GXX = shutil.which("g++")

pytestmark = pytest.mark.skipif(GXX is None, reason="needs g++ (C++20) to build the CPU emulation of the kernels")

# small tunables: few threads per block and short stages, so that several
# blocks, warps, stage windows and row chunks occur at test sizes
DEFINES = {"RES_THREADS": 64, "RES_STAGE": 32, "COMPACT_WARPS": 2}

_HARNESS = r"""
#include "emu.h"
#include "kernel_source.cuh"
#include <type_traits>
static_assert(std::is_same_v<decltype(fma(1.0f, 1.0f, 1.0f)), float>, "fma must stay single precision");

extern "C" {
void row_totals(const int* counts, long long* totals, int M, int n_tiles, int slots) {
    emu::launch(twellpy_twell_row_totals, dim3((M + COMPACT_WARPS - 1) / COMPACT_WARPS), dim3(32 * COMPACT_WARPS),
                0, counts, totals, M, n_tiles, slots);
}
void compact_f32(const float* v, const int* i, const int* c, const long long* indptr, int* cols, float* vals,
                 int M, int n_tiles, int slots, int N) {
    emu::launch(twellpy_twell_compact<float>, dim3((M + COMPACT_WARPS - 1) / COMPACT_WARPS),
                dim3(32 * COMPACT_WARPS), 0, v, i, c, indptr, cols, vals, M, n_tiles, slots, N);
}
void compact_bf16(const __nv_bfloat16* v, const int* i, const int* c, const long long* indptr, int* cols,
                  __nv_bfloat16* vals, int M, int n_tiles, int slots, int N) {
    emu::launch(twellpy_twell_compact<__nv_bfloat16>, dim3((M + COMPACT_WARPS - 1) / COMPACT_WARPS),
                dim3(32 * COMPACT_WARPS), 0, v, i, c, indptr, cols, vals, M, n_tiles, slots, N);
}
#define RESIDENT(NAME, T, V, LPR)                                                                      \
void NAME(const long long* indptr, const int* cols, const V* vals, const T* B, T* out, int M, int N, int K, \
          int rows_per_block, int gx, int gy, long long smem) {                                      \
    emu::launch(twellpy_spmm_resident<T, V, LPR, false>, dim3(gx, gy), dim3(RES_THREADS), (size_t)smem,   \
                indptr, (const int*)nullptr, 0, 0, cols, vals, B, out, M, N, K, rows_per_block,          \
                (const V*)nullptr, (const T*)nullptr);                                                  \
}
RESIDENT(resident_f32_1, float, float, 1)
RESIDENT(resident_f32_2, float, float, 2)
RESIDENT(resident_f32_4, float, float, 4)
RESIDENT(resident_bf16_1, __nv_bfloat16, __nv_bfloat16, 1)
RESIDENT(resident_bf16_2, __nv_bfloat16, __nv_bfloat16, 2)
RESIDENT(resident_bf16_4, __nv_bfloat16, __nv_bfloat16, 4)
RESIDENT(resident_bf16f_1, __nv_bfloat16, float, 1)
RESIDENT(resident_bf16f_2, __nv_bfloat16, float, 2)
}
"""


def _emulation_source(cu_name):
    """The kernel file with CUDA's shared-memory declarations rewritten for emu.h."""
    src = reg.read_source(cu_name)
    src = re.sub(r"extern\s+__shared__\s+(\w+)\s+(\w+)\s*\[\s*\]\s*;",
                 r"\1* \2 = reinterpret_cast<\1*>(emu::dynamic_smem());", src)
    return src.replace("__shared__", "static")


def _build(tmp_path_factory, cu_name, harness, defines):
    """Compile ``harness`` (C++ that includes "kernel_source.cuh") against the
    emulated ``raw_kernels/cu_name``; returns the loaded shared library."""
    src = _emulation_source(cu_name)
    common = reg.read_source("common.cuh")
    key = hashlib.sha256((src + common + harness + str(sorted(defines.items()))
                          + (EMU / "emu.h").read_text()).encode()).hexdigest()[:16]
    d = tmp_path_factory.mktemp(f"emu_{Path(cu_name).stem}_{key}")
    (d / "kernel_source.cuh").write_text(src)
    (d / "common.cuh").write_text(common)
    (d / "harness.cpp").write_text(harness)
    so = d / "harness.so"
    # -ffp-contract=off: the kernels spell every fma that their bits depend on (NVRTC would
    # contract a * b + c by itself; an emulation that does not must not need it)
    # -fno-gnu-unique: a kernel's function-local statics (its __shared__ arrays) stay
    # private to each library; as GNU unique symbols the dynamic linker would share
    # them between builds of one kernel with different defines (different sizes)
    cmd = [GXX, "-std=c++20", "-O1", "-ffp-contract=off", "-fno-gnu-unique", "-shared", "-fPIC", "-pthread",
           f"-I{EMU}", f"-I{d}",
           *(f"-D{k}={v}" for k, v in defines.items()), str(d / "harness.cpp"), "-o", str(so)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, f"emulation build of {cu_name} failed:\n{r.stderr[-4000:]}"
    return ctypes.CDLL(str(so))


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return _build(tmp_path_factory, "spmm_resident.cu", _HARNESS, DEFINES)


def _ptr(a):
    return ctypes.c_void_p(a.ctypes.data)


def _twell(x, tile, slots):
    vals, idx, counts, _ = cpu.dense_to_twell(x, tile, slots)
    return np.ascontiguousarray(vals), np.ascontiguousarray(idx), np.ascontiguousarray(counts)


def _compact(lib, vals, idx, counts, n_cols):
    """indptr, cols, vals through the emulated kernels (prefix sum in numpy, as cupy does)."""
    m, n_tiles = counts.shape
    slots = vals.shape[2] if vals.ndim == 3 else 0
    totals = np.full(m + 1, -7, np.int64)   # poisoned: the kernel writes every entry
    lib.row_totals(_ptr(counts), _ptr(totals), m, n_tiles, slots)
    indptr = np.cumsum(totals)
    cap = max(1, m * n_tiles * slots)
    cols = np.full(cap, 0x7B7B7B7B, np.int32)
    out = np.full(cap, np.nan, np.float32).astype(vals.dtype)
    fn = lib.compact_f32 if vals.dtype == np.float32 else lib.compact_bf16
    fn(_ptr(vals), _ptr(idx), _ptr(counts), _ptr(indptr), _ptr(cols), _ptr(out), m, n_tiles, slots, n_cols)
    return indptr, cols, out


def _reference_compact(vals, idx, counts, n_cols):
    m, n_tiles = counts.shape
    rows_c, rows_v = [], []
    for r in range(m):
        for t in range(n_tiles):
            k = int(min(max(counts[r, t], 0), vals.shape[2]))
            c = idx[r, t, :k].astype(np.int64)
            rows_c.append(np.where((c >= 0) & (c < n_cols), c, -1).astype(np.int32))
            rows_v.append(vals[r, t, :k])
    nnz = np.minimum(np.maximum(counts, 0), vals.shape[2]).sum(axis=1)
    return (np.concatenate([[0], np.cumsum(nnz)]).astype(np.int64),
            np.concatenate(rows_c) if rows_c else np.zeros(0, np.int32),
            np.concatenate(rows_v) if rows_v else np.zeros(0, vals.dtype))


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), bfloat16], ids=str)
@pytest.mark.parametrize("tile,slots", [(64, 4), (32, 32), (256, 8)])
def test_compaction_matches_numpy(lib, dtype, tile, slots):
    rng = np.random.default_rng(3)
    x = random_sparse(rng, 37, 1100, 25)
    x[5] = rng.standard_normal(1100)              # every tile over capacity
    x[[0, 36]] = 0.0
    x = x.astype(dtype)
    vals, idx, counts = _twell(x, tile, slots)    # 18 or 35 tiles: a warp's 32-tile loop wraps at 35
    idx[2, 0, 0] = -5                             # out-of-range indices become -1
    idx[3, 1, 0] = 5000
    indptr, cols, out = _compact(lib, vals, idx, counts, 1100)
    want_p, want_c, want_v = _reference_compact(vals, idx, counts, 1100)
    np.testing.assert_array_equal(indptr, want_p)
    nnz = int(want_p[-1])
    np.testing.assert_array_equal(cols[:nnz], want_c)
    np.testing.assert_array_equal(out[:nnz].view(np.uint8), want_v.view(np.uint8))


def _run_resident(lib, x, b, *, tile=256, slots=32, n_sm=6, smem_limit=48 * 1024, min_chunk_rows=8):
    """A @ B through compaction + the emulated resident kernel, planned by resident_layout."""
    m, n = x.shape
    k_cols = b.shape[1]
    vals, idx, counts = _twell(x, tile, slots)
    indptr, cols, cvals = _compact(lib, vals, idx, counts, n)
    plan = resident_layout(m, n, k_cols, b.dtype.itemsize, n_sm, smem_limit,
                           DEFINES["RES_THREADS"], DEFINES["RES_STAGE"], min_chunk_rows)
    assert plan is not None
    lpr, smem, n_slices, n_chunks, rows = plan
    out = np.full((m, k_cols), np.nan, np.float32).astype(b.dtype)   # poisoned output
    name = f"resident_{'f32' if b.dtype == np.float32 else 'bf16'}_{lpr}"
    getattr(lib, name)(_ptr(indptr), _ptr(cols), _ptr(cvals), _ptr(b), _ptr(out), m, n, k_cols, rows,
                       n_slices, n_chunks, ctypes.c_longlong(smem))
    a_stored = cpu.slots_to_dense(vals.reshape(m, -1), idx.reshape(m, -1), n)
    return out, a_stored, plan


def _sequential_fma(a_stored_rows, b):
    """The resident kernel's arithmetic: fp32 fma over the stored entries in column order."""
    acc = np.zeros((len(a_stored_rows), b.shape[1]), np.float32)
    bf = b.astype(np.float32)
    for r, (c, v) in enumerate(a_stored_rows):
        for cc, vv in zip(c, v):
            acc[r] = (np.float64(vv) * bf[cc].astype(np.float64) + acc[r]).astype(np.float32)
    return acc


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), bfloat16], ids=str)
@pytest.mark.parametrize("k_cols", [8, 24, 40, 72])
def test_resident_spmm_matches_reference(lib, dtype, k_cols):
    """Several slices (one partial), row chunks, stage windows, rows longer than a
    stage, empty rows first and last, M not a multiple of the rows per warp."""
    if k_cols % (16 // np.dtype(dtype).itemsize):
        k_cols += 16 // np.dtype(dtype).itemsize - k_cols % (16 // np.dtype(dtype).itemsize)
    rng = np.random.default_rng(k_cols)
    m, n = 77, 300
    x = random_sparse(rng, m, n, 9)
    x[4] = rng.standard_normal(n)                         # 300 entries: tiles over capacity, 16 kept of 64
    x[9, rng.choice(n, 70, replace=False)] = rng.standard_normal(70)
    x[[0, 30, m - 1]] = 0.0
    x = x.astype(dtype)
    b = (rng.standard_normal((n, k_cols)) / 4).astype(dtype)
    out, a_stored, plan = _run_resident(lib, x, b, tile=64, slots=16)
    assert plan[2] >= 1 and plan[3] > 1, plan             # several row chunks
    got = out.astype(np.float64)
    assert not np.isnan(got).any(), "an output element was never written"
    ref = a_stored.astype(np.float64) @ b.astype(np.float64)
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err <= (1e-6 if dtype == np.float32 else 8e-3), err
    assert not got[[0, 30, m - 1]].any()
    if dtype == np.float32:
        rows = []
        for r in range(m):
            c = np.flatnonzero(a_stored[r] != 0)
            rows.append((c, a_stored[r, c]))
        np.testing.assert_allclose(got, _sequential_fma(rows, b), rtol=1e-6, atol=1e-7)


def test_resident_spmm_every_slice_width_and_tiny_shapes(lib):
    """LPR 4, 2 and 1 (the plan picks the widest that fits), M = 1, N = 1."""
    rng = np.random.default_rng(11)
    warps = DEFINES["RES_THREADS"] // 32
    stage = warps * 32 * 12 + warps * (DEFINES["RES_STAGE"] + 32) * 8
    for n, limit in ((20, 48 * 1024), (300, 300 * 32 + stage + 100), (600, 600 * 16 + stage + 100)):
        x = random_sparse(rng, 21, n, 5).astype(np.float32)
        b = rng.standard_normal((n, 64)).astype(np.float32)
        out, a_stored, plan = _run_resident(lib, x, b, smem_limit=limit)
        assert plan[0] == {20: 4, 300: 2, 600: 1}[n], plan
        ref = a_stored.astype(np.float64) @ b.astype(np.float64)
        assert np.abs(out - ref).max() <= 1e-5 * max(1.0, np.abs(ref).max())
    for m, n in ((1, 50), (9, 1)):
        x = np.ones((m, n), np.float32)
        b = rng.standard_normal((n, 16)).astype(np.float32)
        out, a_stored, _ = _run_resident(lib, x, b)
        np.testing.assert_allclose(out, a_stored @ b, rtol=1e-6)


def test_resident_layout_limits():
    """The plan's arithmetic without a device."""
    from twellpy.backends import cuda

    # a product with no output columns has no slices: no plan (the gather kernel writes the empty result)
    assert cuda._resident_plan(4096, 10, 0, 0, np.float32, mode=True) is None
    assert resident_layout(4096, 10, 0, 4, 132, 232448, 512, 256, 128) is None
    # W1's h @ w_down on an H200: slices of 2 vectors (16 columns), two row chunks
    assert resident_layout(16384, 5632, 2048, 2, 132, 232448, 512, 256, 128) == (2, 223232, 128, 2, 8192)
    # narrow outputs still give every SM a block: 4 slices x 32 chunks of 128 rows
    assert resident_layout(4096, 5632, 64, 2, 132, 232448, 512, 256, 128)[2:] == (4, 32, 128)
    assert resident_layout(16384, 5632, 2048, 2, 108, 166912, 512, 256, 1024)[0] == 1   # A100: narrower
    assert resident_layout(100, 70000, 2048, 2, 132, 232448, 512, 256, 1024) is None     # N > 65535 never fits
    lpr, smem, n_slices, n_chunks, rows = resident_layout(100, 64, 8, 2, 132, 232448, 512, 256, 8)
    assert (lpr, n_slices) == (1, 1) and n_chunks * rows >= 100 and (n_chunks - 1) * rows < 100
    # the split training backward at W1 (two slices of a 5632-row weight) fits with the dual stage
    assert resident_layout(16384, 5632, 2048, 2, 132, 232448, 512, 256, 128, dual=True) is None
    assert resident_layout(16384, 5632, 2048, 2, 132, 232448, 512, 128, 128, dual=True)[:2] == (1, 217088)
    # fp64 stages take 12 bytes an entry; every warp also keeps 32 row starts and lengths
    assert resident_layout(10, 10, 8, 8, 1, 10**6, 512, 256, 1)[1] == 10 * 4 * 16 + 16 * 32 * 12 + 16 * 288 * 12


# ---------------------------------------------------------------------------
# train_ffn.cu: the kernels around the dense backup rows' GEMMs and the tiled
# weight transpose, against their numpy twins in twellpy.backends.cpu_train
# ---------------------------------------------------------------------------
_TRAIN_HARNESS = r"""
#include "emu.h"
#include "kernel_source.cuh"

extern "C" {
#define BACKUP(SUFFIX, T, G)                                                                           \
void backup_fwd_##SUFFIX(const T* g, const typename accum<T>::type* u_acc, T* u, T* h, const int* rows,      \
                         int R, int H, typename accum<T>::type* habs, int grid) {                        \
    emu::launch(twellpy_train_backup_fwd<T, G>, dim3(grid), dim3(256), 0, g, u_acc, u, h, rows, R, H, habs);  \
}                                                                                                      \
void backup_bwd_##SUFFIX(const typename accum<T>::type* dh, const T* g, const T* u, double l1s, T* da,     \
                         T* db, long long n, int grid, T* h) {                                         \
    emu::launch(twellpy_train_backup_bwd<T, G>, dim3(grid), dim3(256), 0, dh, g, u, l1s, da, db, n, h); \
}                                                                                                      \
void wgrad_##SUFFIX(const int* indptr, const int* rows, const int* pos, const T* x, const T* dy,          \
                    const T* da, const T* db, const T* gval, const T* uval, T* dw_a, T* dw_b, T* dw_dT,  \
                    int H, int D, int vec, const typename accum<T>::type* base_a,                       \
                    const typename accum<T>::type* base_b, const typename accum<T>::type* base_h) {     \
    constexpr int per = TW_GATHER_THREADS * VecN<T>::N;                                                  \
    emu::launch(twellpy_train_wgrad<T, G>, dim3(H, (D + per - 1) / per), dim3(TW_GATHER_THREADS), 0,     \
                indptr, rows, pos, x, dy, da, db, gval, uval, dw_a, dw_b, dw_dT, H, D, vec, base_a,      \
                base_b, base_h);                                                                        \
}                                                                                                      \
void wgrad_exact_##SUFFIX(typename accum<T>::type* ba, typename accum<T>::type* bb,                     \
                          typename accum<T>::type* bh, const T* g, const T* u, const T* da, const T* db, \
                          const T* x, const T* dy, const int* rows, int R, int H, int D) {              \
    emu::launch(twellpy_train_backup_wgrad_exact<T, G>, dim3(H, (D + 255) / 256), dim3(256), 0, ba, bb, bh,   \
                g, u, da, db, x, dy, rows, R, H, D);                                                  \
}
#define WGRAD_DH(SUFFIX, T, G)                                                                         \
void wgrad_dh_##SUFFIX(const int* indptr, const int* rows, const int* pos, long long ell_size, const T* x,  \
                       const T* dy, const T* w_downT, T* da, T* db, const T* gval, const T* uval, T* dw_a,  \
                       T* dw_b, T* dw_dT, int H, int D, double l1s, const typename accum<T>::type* base_a,   \
                       const typename accum<T>::type* base_b, const typename accum<T>::type* base_h,         \
                       int nv, int threads) {                                                          \
    if (nv == 1)                                                                                       \
        emu::launch(twellpy_train_wgrad_dh<T, G, 1>, dim3(H), dim3(threads), 0, indptr, rows, pos, ell_size, \
                    x, dy, w_downT, da, db, gval, uval, dw_a, dw_b, dw_dT, D, l1s, base_a, base_b, base_h); \
    else                                                                                               \
        emu::launch(twellpy_train_wgrad_dh<T, G, 2>, dim3(H), dim3(threads), 0, indptr, rows, pos, ell_size, \
                    x, dy, w_downT, da, db, gval, uval, dw_a, dw_b, dw_dT, D, l1s, base_a, base_b, base_h); \
}
using twellpy::accum;
WGRAD_DH(f32_0, float, 0)
WGRAD_DH(f32_1, float, 1)
WGRAD_DH(bf16_0, __nv_bfloat16, 0)
WGRAD_DH(bf16_1, __nv_bfloat16, 1)
BACKUP(f32_0, float, 0)
BACKUP(f32_1, float, 1)
BACKUP(bf16_0, __nv_bfloat16, 0)
BACKUP(bf16_1, __nv_bfloat16, 1)
void scatter_f32(const float* src, const int* rows, float* dst, int R, int D, int grid) {
    emu::launch(twellpy_train_scatter_rows<float>, dim3(grid), dim3(256), 0, src, rows, dst, R, D);
}
void scatter_bf16(const float* src, const int* rows, __nv_bfloat16* dst, int R, int D, int grid) {
    emu::launch(twellpy_train_scatter_rows<__nv_bfloat16>, dim3(grid), dim3(256), 0, src, rows, dst, R, D);
}
#define TRANSPOSE(SUFFIX, U)                                                                           \
void transpose_##SUFFIX(const U* in, U* out, long long rows, long long cols, int gx, int gy) {          \
    emu::launch(twellpy_train_transpose_dense<U>, dim3(gx, gy), dim3(32, 8), 0, in, out, rows, cols);   \
}
TRANSPOSE(u16, unsigned short)
TRANSPOSE(u32, unsigned int)
TRANSPOSE(u64, unsigned long long)
void transpose_pairs(const unsigned int* in, unsigned int* out, long long rows, long long cols, int gx, int gy) {
    emu::launch(twellpy_train_transpose_pairs, dim3(gx, gy), dim3(32, 8), 0, in, out, rows, cols);
}
void tr_count_f32(const int* idx, const int* row_map, const float* backup, long long M, int K, int N, int rpb,
                  int nb, int* counts, int* col_tot, int grid) {
    emu::launch(twellpy_train_tr_count<float>, dim3(grid), dim3(32 * TW_WARPS), 0, idx, row_map, backup, M, K, N,
                rpb, nb, counts, col_tot);
}
#define TO_HYBRID(SUFFIX, T)                                                                          \
void relu_to_hybrid_##SUFFIX(const T* z, long long M, int H, int vec, int vec_store, const int* row_map, int W, \
                             T* ell_val, int* ell_idx, int* ell_nnz, T* backup, int* neuron_counts) {       \
    emu::launch(twellpy_train_relu_to_hybrid<T>, dim3((unsigned)((M + TW_WARPS - 1) / TW_WARPS)),         \
                dim3(32 * TW_WARPS), 0, z, M, H, vec, vec_store, row_map, W, ell_val, ell_idx, ell_nnz,   \
                backup, neuron_counts, (int*)nullptr, 0);                                              \
}                                                                                                     \
void relu_count_pack_##SUFFIX(const T* z, long long M, int H, int vec, int vec_store, const int* row_map,   \
                              int W, T* ell_val, int* ell_idx, int* ell_nnz, T* backup, int* neuron_counts,  \
                              int* token_counts, int mode) {                                          \
    emu::launch(twellpy_train_relu_to_hybrid<T>, dim3((unsigned)((M + TW_WARPS - 1) / TW_WARPS)),         \
                dim3(32 * TW_WARPS), 0, z, M, H, vec, vec_store, row_map, W, ell_val, ell_idx, ell_nnz,   \
                backup, neuron_counts, token_counts, mode);                                            \
}
TO_HYBRID(f32, float)
TO_HYBRID(bf16, __nv_bfloat16)
#define RELU_SCAN(SUFFIX, T)                                                                          \
void relu_bits_##SUFFIX(const uint4* raw, unsigned* bits, long long n) {                               \
    for (long long k = 0; k < n; ++k) bits[k] = twellpy_train::relu_on_bits<T>(raw[k]);               \
}                                                                                                     \
void relu_count_##SUFFIX(const T* z, long long rows, int H, int vec, int* row_nnz) {                    \
    emu::launch(twellpy_train_relu_count<T>, dim3((unsigned)((rows + TW_WARPS - 1) / TW_WARPS)),         \
                dim3(32 * TW_WARPS), 0, z, rows, H, vec, row_nnz);                                      \
}                                                                                                     \
void relu_pack_##SUFFIX(const T* z, long long rows, int H, int vec, const long long* indptr, int* col, T* val) { \
    emu::launch(twellpy_train_relu_pack<T>, dim3((unsigned)((rows + TW_WARPS - 1) / TW_WARPS)),          \
                dim3(32 * TW_WARPS), 0, z, rows, H, vec, indptr, col, val);                              \
}
RELU_SCAN(f32, float)
RELU_SCAN(bf16, __nv_bfloat16)
RELU_SCAN(f16, __half)
void row_maps(const int* counts, int* maps, long long M, int W, long long R, int threads) {
    emu::launch(twellpy_train_row_maps, dim3(1), dim3(threads), 0, counts, maps, M, W, R, 0LL, M, (int*)nullptr, 1);
}
void row_maps_rows(const int* counts, int* maps, long long M, int W, long long R, long long row0, long long n,
                   int* running, int fill_rest, int threads) {
    emu::launch(twellpy_train_row_maps, dim3(1), dim3(threads), 0, counts, maps, M, W, R, row0, n, running,
                fill_rest);
}
}
"""


@pytest.fixture(scope="module", params=[{}, {"TW_WARPS": 2, "TW_PACK_UNROLL": 3, "TW_MAP_ROWS": 3,
                                             "TW_GATHER_THREADS": 32, "TW_DH_PREFETCH": 1, "TW_PACK_WORDS": 1}],
                ids=["default", "2warps-unroll3-maprows3-dhprefetch-packwords"])
def train_lib(request, tmp_path_factory):
    return _build(tmp_path_factory, "train_ffn.cu", _TRAIN_HARNESS, request.param)


def _suffix(dtype, gated=None):
    s = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16"}.get(np.dtype(dtype), "bf16")
    return s if gated is None else f"{s}_{int(gated)}"


def _backup_inputs(dtype, R, H, seed):
    rng = np.random.default_rng(seed)
    g = np.maximum(rng.standard_normal((R, H)), 0).astype(np.float32)   # ReLU values: half zero
    g[0, :7] = [np.nan, -0.0, 0.0, 3.0, 0.5, np.nan, 1e-3]
    g = g.astype(dtype)
    u_acc = rng.standard_normal((R, H)).astype(np.float32)
    dh = rng.standard_normal((R, H)).astype(np.float32)
    return g, u_acc, dh


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), bfloat16], ids=str)
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("R,H,grid", [(5, 300, 5), (7, 1000, 2), (1, 31, 1)])
def test_backup_row_kernels_match_numpy_twins(train_lib, dtype, gated, R, H, grid):
    from twellpy.backends import cpu_train

    g, u_acc, dh = _backup_inputs(dtype, R, H, seed=R * H)
    M = R + 6
    rows = np.sort(np.random.default_rng(R).choice(M, R, replace=False)).astype(np.int32)
    # forward: u and h on the pattern, |h| sums per backup row
    u = np.full((R, H), np.nan, np.float32).astype(dtype)
    h = np.full((R, H), np.nan, np.float32).astype(dtype)
    habs = np.full(M, -1.0, np.float32)
    getattr(train_lib, f"backup_fwd_{_suffix(dtype, gated)}")(
        _ptr(g), _ptr(u_acc), _ptr(u), _ptr(h), _ptr(rows), R, H, _ptr(habs), grid)
    u_want = np.full((R, H), np.nan, np.float32).astype(dtype)
    habs_want = np.full(M, -1.0, np.float32)
    h_want = cpu_train.backup_rows_forward(g, u_acc if gated else None, u_want if gated else None, rows,
                                           habs_want, gated)
    if gated:
        np.testing.assert_array_equal(_bits(u), _bits(u_want))
        np.testing.assert_array_equal(_bits(h), _bits(np.asarray(h_want, dtype=dtype)))
    others = np.setdiff1d(np.arange(M), rows)
    assert (habs[others] == -1.0).all(), "only the backup rows' |h| sums are written"
    np.testing.assert_allclose(habs[rows], habs_want[rows], rtol=2e-6, equal_nan=True)
    # backward: du / dg (or dh), with and without the L1 term
    for l1s in (0.0, 0.01):
        da = np.full((R, H), np.nan, np.float32).astype(dtype)
        db = np.full((R, H), np.nan, np.float32).astype(dtype)
        uu = u if gated else g
        hh = np.full((R, H), np.nan, np.float32).astype(dtype)
        getattr(train_lib, f"backup_bwd_{_suffix(dtype, gated)}")(
            _ptr(dh), _ptr(g), _ptr(uu), ctypes.c_double(l1s), _ptr(da), _ptr(db), ctypes.c_longlong(R * H), grid,
            _ptr(hh) if gated else None)
        da_w = np.full((R, H), np.nan, np.float32).astype(dtype)
        db_w = np.full((R, H), np.nan, np.float32).astype(dtype)
        h_w = np.full((R, H), np.nan, np.float32).astype(dtype) if gated else None
        cpu_train.backup_rows_backward(dh, g, u if gated else None, l1s, gated, da_w, db_w if gated else None,
                                       h_out=h_w)
        np.testing.assert_array_equal(_bits(da), _bits(da_w))
        if gated:
            np.testing.assert_array_equal(_bits(db), _bits(db_w))
            np.testing.assert_array_equal(_bits(hh), _bits(h_w))  # the forward's h, 0 off the pattern
            np.testing.assert_array_equal(_bits(hh), _bits(h))
        else:
            assert np.isnan(hh.astype(np.float32)).all()  # a null h is never written


def _wgrad_pattern(rng, M, K, H):
    """An ELL pattern of M rows of up to K sorted columns of H, rows 4 and 9 backup rows
    (row map 0 and 1, no slots)."""
    idx = np.full((M, K), -1, np.int32)
    for r in range(M):
        n = int(rng.integers(0, K + 1))
        idx[r, :n] = np.sort(rng.choice(H, n, replace=False))
    row_map = np.full(M, -1, np.int32)
    row_map[[4, 9]] = [0, 1]
    idx[[4, 9]] = -1
    return idx, row_map


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), bfloat16], ids=str)
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("D,vec", [(264, 1), (300, 0), (8, 1), (5, 0)])
@pytest.mark.parametrize("with_base", [True, False], ids=["base", "nobase"])
def test_weight_grad_kernel_adds_the_pattern_to_its_base(train_lib, dtype, gated, D, vec, with_base):
    """twellpy_train_wgrad: ``base + sum over entries`` per neuron and column,
    rounded once, against float64 (every column chunk, partial last chunk,
    both loops); the base is the backup rows' GEMM sums."""
    from twellpy.backends import cpu_train

    rng = np.random.default_rng(D + 7 * gated)
    M, K, H, R = 13, 3, 9, 2
    idx, row_map = _wgrad_pattern(rng, M, K, H)
    bk = np.where(rng.random((R, H)) < 0.5, rng.standard_normal((R, H)), 0).astype(np.float32)
    if not with_base:  # the backup rows go through the gather too
        indptr, rows, pos = cpu_train.transpose_pattern(idx, row_map, bk.astype(dtype), H)
    else:
        indptr, rows, pos = cpu_train.transpose_pattern(idx, np.full(M, -1, np.int32), bk[:0], H)
    n_vals = M * K + R * H
    vals = [rng.standard_normal(n_vals).astype(np.float32).astype(dtype) for _ in range(4)]  # da, db, g, u
    x = rng.standard_normal((M, D)).astype(np.float32).astype(dtype)
    dy = rng.standard_normal((M, D)).astype(np.float32).astype(dtype)
    base = [rng.standard_normal((H, D)).astype(np.float32) * 3 for _ in range(3)] if with_base else None
    outs = [np.full((H, D), np.nan, np.float32).astype(dtype) for _ in range(3)]
    getattr(train_lib, f"wgrad_{_suffix(dtype, gated)}")(
        _ptr(indptr), _ptr(rows), _ptr(pos), _ptr(x), _ptr(dy), _ptr(vals[0]), _ptr(vals[1]), _ptr(vals[2]),
        _ptr(vals[3]), _ptr(outs[0]), _ptr(outs[1]), _ptr(outs[2]), H, D, vec,
        *((_ptr(b) for b in base) if with_base else (None, None, None)))
    # float64 reference over the entries of the transposed pattern
    da, db, g, u = (v.astype(np.float64) for v in vals)
    h = (g * u).astype(dtype).astype(np.float64) if gated else g
    want = [np.zeros((H, D)) if base is None else b.astype(np.float64) for b in (base or [None] * 3)]
    xf, dyf = x.astype(np.float64), dy.astype(np.float64)
    for k in range(H):
        for e in range(indptr[k], indptr[k + 1]):
            m, p = rows[e], pos[e]
            want[0][k] += da[p] * xf[m]
            want[1][k] += db[p] * xf[m]
            want[2][k] += h[p] * dyf[m]
    checks = [(outs[0], want[0], "dw_up"), (outs[2], want[2], "dw_downT")]
    checks += [(outs[1], want[1], "dw_gate")] if gated else []
    ulp = 2.0 ** -8 if dtype == bfloat16 else 2.0 ** -20
    for got, ref, name in checks:
        err = np.abs(got.astype(np.float64) - ref)
        assert (err <= ulp * np.abs(ref) + 1e-5 * np.abs(ref).max()).all(), (name, float(err.max()))
    if not gated:
        assert np.isnan(outs[1].astype(np.float32)).all()  # dw_gate is not written
    if with_base:  # the same sums as the CPU backend's from its base
        twin = cpu_train.ffn_weight_grads(indptr, rows, pos, x, dy, vals[0], vals[1], vals[2], vals[3], H, gated,
                                          base=(base[0], base[1] if gated else None, base[2]))
        for got, want_twin in zip((outs[0], outs[2]), (twin[0], twin[2])):
            np.testing.assert_allclose(got.astype(np.float32), want_twin.astype(np.float32),
                                       rtol=2 * ulp, atol=1e-5 * float(np.abs(want_twin.astype(np.float32)).max()))


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), bfloat16], ids=str)
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("D,nv", [(264, 1), (264, 2), (8, 1), (1032, 2)])
@pytest.mark.parametrize("with_base,l1s", [(True, 0.25), (False, 0.25), (False, 0.0)],
                         ids=["base", "nobase", "nobase-l1_0"])
def test_weight_grad_dh_kernel_computes_dh_and_the_weight_grads(train_lib, dtype, gated, D, nv, with_base, l1s):
    """twellpy_train_wgrad_dh (the backward's dh by neuron): for ELL entries dh =
    dy[m] . w_downT[k] + l1s * sign(h), written as du, dg (or dh) at the entry's
    position, and for backup entries the da, db already there; the weight gradients
    are ``base + sum over entries`` against float64. Positions outside the pattern
    keep their poison; several warps and a partial last warp reduce each dot."""
    rng = np.random.default_rng(D + 7 * gated + 3 * nv)
    M, K, H, R = 13, 3, 9, 2
    idx, row_map = _wgrad_pattern(rng, M, K, H)
    idx[7] = [0, 1, 2]   # neurons with many entries span several steps of the kernel
    bk = np.where(rng.random((R, H)) < 0.5, rng.standard_normal((R, H)), 0).astype(np.float32)
    from twellpy.backends import cpu_train

    if with_base:  # the backup rows' sums come in as a base (the GEMM route): ELL entries only
        indptr, rows, pos = cpu_train.transpose_pattern(idx, np.full(M, -1, np.int32), bk[:0], H)
    else:
        indptr, rows, pos = cpu_train.transpose_pattern(idx, row_map, bk.astype(dtype), H)
    ell_size = M * K
    n_vals = M * K + R * H
    g, u = (np.abs(rng.standard_normal(n_vals)).astype(np.float32).astype(dtype) for _ in range(2))
    da, db = (np.full(n_vals, np.nan, np.float32).astype(dtype) for _ in range(2))
    given = rng.standard_normal((2, R * H)).astype(np.float32).astype(dtype)  # the backup rows' da, db
    da[ell_size:], db[ell_size:] = given
    x, dy = (rng.standard_normal((M, D)).astype(np.float32).astype(dtype) for _ in range(2))
    w_downT = rng.standard_normal((H, D)).astype(np.float32).astype(dtype)
    base = [rng.standard_normal((H, D)).astype(np.float32) * 3 for _ in range(3)] if with_base else None
    outs = [np.full((H, D), np.nan, np.float32).astype(dtype) for _ in range(3)]
    threads = 32 * -(-(D // (16 // dtype.itemsize)) // nv // 32)
    getattr(train_lib, f"wgrad_dh_{_suffix(dtype, gated)}")(
        _ptr(indptr), _ptr(rows), _ptr(pos), ctypes.c_longlong(ell_size), _ptr(x), _ptr(dy), _ptr(w_downT),
        _ptr(da), _ptr(db), _ptr(g), _ptr(u), _ptr(outs[0]), _ptr(outs[1]), _ptr(outs[2]), H, D,
        ctypes.c_double(l1s), *((_ptr(b) for b in base) if with_base else (None, None, None)), nv, threads)
    f64 = lambda a: a.astype(np.float64)  # noqa: E731
    gf, uf, xf, dyf, wf = f64(g), f64(u), f64(x), f64(dy), f64(w_downT)
    h = f64((gf * uf).astype(dtype)) if gated else gf
    want = [np.zeros((H, D)) if base is None else f64(b) for b in (base or [None] * 3)]
    ulp = 2.0 ** -8 if dtype == bfloat16 else 2.0 ** -20
    touched = np.zeros(n_vals, bool)
    for k in range(H):
        for e in range(indptr[k], indptr[k + 1]):
            m, p = rows[e], pos[e]
            touched[p] = True
            if p < ell_size:
                dh = dyf[m] @ wf[k] + l1s * np.sign(h[p])
                a_ref, b_ref = (dh * gf[p], dh * uf[p]) if gated else (dh, np.nan)
                scale = np.abs(dyf[m]) @ np.abs(wf[k]) * max(gf[p], uf[p], 1)
                assert abs(f64(da[p]) - a_ref) <= 2 * ulp * abs(a_ref) + 1e-5 * scale, ("da", k, e)
                if gated:
                    assert abs(f64(db[p]) - b_ref) <= 2 * ulp * abs(b_ref) + 1e-5 * scale, ("db", k, e)
            a, b = f64(da[p]), f64(db[p])   # the kernel's own rounded values feed the sums
            want[0][k] += a * xf[m]
            want[1][k] += b * xf[m]
            want[2][k] += h[p] * dyf[m]
    assert touched[:ell_size].sum() == (idx >= 0).sum()
    np.testing.assert_array_equal(da[ell_size:], given[0], err_msg="backup entries' da is read, not written")
    assert np.isnan(da[:ell_size][~touched[:ell_size]].astype(np.float32)).all(), "padding is not written"
    if not gated:
        assert np.isnan(db[:ell_size].astype(np.float32)).all(), "db is not written by the ReLU FFN"
    checks = [(outs[0], want[0], "dw_up"), (outs[2], want[2], "dw_downT")]
    checks += [(outs[1], want[1], "dw_gate")] if gated else []
    for got, ref, name in checks:
        err = np.abs(f64(got) - ref)
        assert (err <= ulp * np.abs(ref) + 1e-5 * np.abs(ref).max()).all(), (name, float(err.max()))
    if not gated:
        assert np.isnan(outs[1].astype(np.float32)).all()  # dw_gate is not written


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), bfloat16], ids=str)
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("D", [5, 300])
def test_backup_wgrad_exact_redoes_only_the_non_finite_sums(train_lib, dtype, gated, D):
    """twellpy_train_backup_wgrad_exact against its numpy twin: the GEMM sums of
    the backup rows with an Inf in x and a NaN in dy; finite elements keep their
    bits, the others are summed over the active entries only."""
    from twellpy.backends import cpu_train

    rng = np.random.default_rng(D * 3 + gated)
    R, H, M = 4, 6, 9
    rows = np.array([0, 3, 4, 8], np.int32)
    g = np.where(rng.random((R, H)) < 0.5, np.abs(rng.standard_normal((R, H))) + 0.1, 0).astype(dtype)
    g[1, 2] = np.nan  # a NaN g is an entry
    u = (np.where(g != 0, rng.standard_normal((R, H)), 0) if gated else np.zeros((R, H))).astype(dtype)
    on = g != 0
    da = np.where(on, rng.standard_normal((R, H)), 0).astype(dtype)
    db = np.where(on, rng.standard_normal((R, H)), 0).astype(dtype) if gated else da
    x = rng.standard_normal((M, D)).astype(dtype)
    dy = rng.standard_normal((M, D)).astype(dtype)
    x[3, D - 1] = np.inf
    dy[8, 0] = np.nan
    # the GEMM sums (zeros of inactive neurons included), in float32
    h = cpu_train._h_values(g.astype(np.float32), u.astype(np.float32) if gated else None, gated, dtype)
    h = np.where(on, h, 0).astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        base = [da.astype(np.float32).T @ x[rows].astype(np.float32),
                db.astype(np.float32).T @ x[rows].astype(np.float32),
                h.T @ dy[rows].astype(np.float32)]
    assert all((~np.isfinite(b)).any() for b in base[::2])
    want = [b.copy() for b in base]
    cpu_train.backup_wgrad_exact((want[0], want[1] if gated else None, want[2]), g, u if gated else None, da,
                                 db if gated else None, x, dy, rows, gated)
    got = [b.copy() for b in base]
    getattr(train_lib, f"wgrad_exact_{_suffix(dtype, gated)}")(
        _ptr(got[0]), _ptr(got[1]), _ptr(got[2]), _ptr(g), _ptr(u), _ptr(da), _ptr(db), _ptr(x), _ptr(dy),
        _ptr(rows), R, H, D)
    redone = 0
    for i in ([0, 1, 2] if gated else [0, 2]):
        fin = np.isfinite(base[i])
        np.testing.assert_array_equal(got[i][fin].view(np.uint32), base[i][fin].view(np.uint32))
        np.testing.assert_array_equal(np.isnan(got[i]), np.isnan(want[i]))
        np.testing.assert_array_equal(np.isinf(got[i]), np.isinf(want[i]))
        ok = np.isfinite(want[i])
        np.testing.assert_allclose(got[i][ok], want[i][ok], rtol=1e-5, atol=1e-6)
        redone += int(np.isfinite(want[i]).sum() - fin.sum())
    assert redone > 0, "some non-finite GEMM sums must become finite"
    if not gated:
        np.testing.assert_array_equal(got[1].view(np.uint32), base[1].view(np.uint32))  # dw_gate untouched


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), bfloat16], ids=str)
def test_scatter_rows_matches_numpy_twin(train_lib, dtype):
    from twellpy.backends import cpu_train

    rng = np.random.default_rng(5)
    M, R, D = 40, 6, 77
    rows = np.sort(rng.choice(M, R, replace=False)).astype(np.int32)
    src = rng.standard_normal((R, D)).astype(np.float32)
    for grid in (1, 3):
        dst = np.full((M, D), np.nan, np.float32).astype(dtype)
        want = dst.copy()
        getattr(train_lib, f"scatter_{_suffix(dtype)}")(_ptr(src), _ptr(rows), _ptr(dst), R, D, grid)
        cpu_train.put_rows_from_acc(want, rows, src)
        np.testing.assert_array_equal(_bits(dst), _bits(want))


@pytest.mark.parametrize("width,name", [(2, "u16"), (4, "u32"), (8, "u64")])
@pytest.mark.parametrize("shape", [(70, 100), (1, 33), (33, 1), (64, 64), (5, 200)])
def test_tiled_transpose_is_exact(train_lib, width, name, shape):
    rng = np.random.default_rng(sum(shape) + width)
    utype = {2: np.uint16, 4: np.uint32, 8: np.uint64}[width]
    a = rng.integers(0, np.iinfo(utype).max, size=shape, dtype=utype)
    rows, cols = shape
    full = (-(-cols // 32), -(-rows // 32))
    for grid in (full, (1, 1), (2, 1)):   # fewer blocks than tiles: the grid-stride loops
        out = np.zeros((cols, rows), utype) + utype(0x5A5A5A5A5A5A5A5A & np.iinfo(utype).max)
        getattr(train_lib, f"transpose_{name}")(_ptr(a), _ptr(out), ctypes.c_longlong(rows),
                                                 ctypes.c_longlong(cols), grid[0], grid[1])
        np.testing.assert_array_equal(out, a.T)


@pytest.mark.parametrize("shape", [(2, 2), (70, 100), (64, 64), (66, 130), (2, 300), (300, 2), (128, 62)])
def test_pairwise_transpose_is_exact(train_lib, shape):
    """twellpy_train_transpose_pairs (16-bit elements moved as 32-bit words, 64 x 64
    tiles; even shapes): the transpose's bits, partial tiles and grid strides included,
    and nothing written outside the output."""
    rng = np.random.default_rng(sum(shape))
    a = rng.integers(0, 0xFFFF, size=shape, dtype=np.uint16)
    rows, cols = shape
    full = (-(-cols // 64), -(-rows // 64))
    for grid in (full, (1, 1), (2, 3)):
        out = np.full((cols * rows + 8,), 0x5A5A, np.uint16)  # 8 guard elements past the end
        train_lib.transpose_pairs(_ptr(a), _ptr(out), ctypes.c_longlong(rows), ctypes.c_longlong(cols),
                                  grid[0], grid[1])
        np.testing.assert_array_equal(out[:-8].reshape(cols, rows), a.T)
        assert (out[-8:] == 0x5A5A).all()


@pytest.mark.parametrize("M, K, N, rpb", [(1, 4, 40, 1), (37, 9, 70, 4), (100, 40, 300, 16)])
def test_transpose_count_gives_block_counts_and_column_totals(train_lib, M, K, N, rpb):
    """twellpy_train_tr_count: entries per (row block, column) and per column (the totals
    the host scans into the transpose's indptr), from slot rows (padding -1 and columns
    out of [0, N) skipped) and dense backup rows (their non-zeros). One warp a row
    block, so the grid (nb blocks) leaves warps past the last row block idle."""
    rng = np.random.default_rng(M * K + N)
    idx = np.full((M, K), -1, np.int32)
    for r in range(M):
        n = int(rng.integers(0, K + 1))
        idx[r, :n] = rng.choice(N, size=n, replace=False)
    if K > 1:
        idx[0, -1] = N + 3  # out of range: skipped like padding
    R = max(1, M // 5)
    row_map = np.full(M, -1, np.int32)
    row_map[rng.choice(M, size=R, replace=False)] = np.arange(R, dtype=np.int32)
    backup = np.where(rng.random((R, N)) < 0.3, rng.standard_normal((R, N)), 0).astype(np.float32)
    nb = -(-M // rpb)
    want = np.zeros((nb, N), np.int64)
    for r in range(M):
        cols = np.flatnonzero(backup[row_map[r]]) if row_map[r] >= 0 else idx[r][(idx[r] >= 0) & (idx[r] < N)]
        want[r // rpb, cols] += 1
    counts = np.zeros((nb, N), np.int32)
    col_tot = np.zeros(N + 4, np.int32)  # 4 guard counters past the end
    train_lib.tr_count_f32(_ptr(idx), _ptr(row_map), _ptr(backup), ctypes.c_longlong(M), K, N, rpb, nb,
                           _ptr(counts), _ptr(col_tot), nb)
    np.testing.assert_array_equal(counts, want)
    np.testing.assert_array_equal(col_tot[:N], want.sum(axis=0))
    assert not col_tot[N:].any()


# ---------------------------------------------------------------------------
# the fused FFN's split mode: ffn_sparse.cu (SPLIT) + spmm_resident.cu
# ---------------------------------------------------------------------------
_FFN_HARNESS = r"""
#include "emu.h"
#include "kernel_source.cuh"
#include "resident_source.cuh"

extern "C" {
typedef __nv_bfloat16 bf16;
#define FFN(NAME, T, SPLIT)                                                                            \
void NAME(const T* x, const T* g, const T* w_up, const T* w_downT, T* y, const int* list_idx,          \
          float* list_val, const int* row_count, int capr, int* heavy, unsigned long long* counters,     \
          int M, int D, int H, int heavy_limit, int grid, int threads, int long_rows) {                  \
    emu::launch(twellpy_ffn_sparse<T, 1, 8, true, false, SPLIT>, dim3(grid), dim3(threads), 0, x,        \
                (long long)D, g, (long long)H, w_up, w_downT, y, (long long)D, (T*)nullptr, 0LL, list_idx, \
                list_val, row_count, capr, heavy, counters, M, D, H, heavy_limit, long_rows);             \
}
FFN(ffn_bf16_fused, bf16, false)
FFN(ffn_bf16_split, bf16, true)
FFN(ffn_f32_fused, float, false)
FFN(ffn_f32_split, float, true)
#define RES_LISTS(NAME, T, LPR)                                                                        \
void NAME(const int* row_count, int stride, int row_cap, const int* cols, const float* vals, const T* B,  \
          T* out, int M, int N, int K, int rows_per_block, int gx, int gy, long long smem) {             \
    emu::launch(twellpy_spmm_resident<T, float, LPR, true>, dim3(gx, gy), dim3(RES_THREADS), (size_t)smem, \
                (const long long*)nullptr, row_count, stride, row_cap, cols, vals, B, out, M, N, K,      \
                rows_per_block, (const float*)nullptr, (const T*)nullptr);                               \
}
RES_LISTS(res_lists_bf16_1, bf16, 1)
RES_LISTS(res_lists_bf16_2, bf16, 2)
RES_LISTS(res_lists_bf16_4, bf16, 4)
RES_LISTS(res_lists_f32_1, float, 1)
RES_LISTS(res_lists_f32_2, float, 2)
RES_LISTS(res_lists_f32_4, float, 4)
#define LIST_DOWN(NAME, T, KB)                                                                         \
void NAME(const int* list_idx, const float* list_val, const int* row_count, int capr, int row_cap,       \
          const T* w_downT, T* y, int M, int D, int grid, int threads) {                                \
    emu::launch(twellpy_ffn_list_down<T, 1, KB>, dim3(grid), dim3(threads), 0, list_idx, list_val,       \
                row_count, capr, row_cap, w_downT, y, (long long)D, M, D);                              \
}
LIST_DOWN(list_down_bf16_kb8, bf16, 8)
LIST_DOWN(list_down_bf16_kb3, bf16, 3)
LIST_DOWN(list_down_f32_kb8, float, 8)
LIST_DOWN(list_down_f32_kb3, float, 3)
#define LONG(NAME, T, GATED)                                                                           \
void long_##NAME(const T* x, T* g, const T* w_up, const T* w_downT, T* y, const int* row_count, int capr, \
                 unsigned* mask, T* h_out, unsigned* state, int* list, int M, int D, int H, int blocks,     \
                 int split) {                                                                         \
    const int HW = (H + 31) / 32;                                                                     \
    const int n_scan = (M + LONG_SCAN - 1) / LONG_SCAN;                                               \
    for (int phase = split ? 1 : 0; phase <= (split ? 3 : 0); ++phase) {                              \
        dim3 grid(phase == 1 ? n_scan : blocks), block(LONG_THREADS);                                 \
        if (h_out)                                                                                    \
            emu::launch(twellpy_ffn_long<T, GATED, true>, grid, block, 0, x, (long long)D, g, (long long)H, w_up, \
                        w_downT, y, (long long)D, row_count, capr, mask, (long long)HW, h_out, (long long)H, \
                        state, list, phase, M, D, H);                                                  \
        else                                                                                          \
            emu::launch(twellpy_ffn_long<T, GATED, false>, grid, block, 0, x, (long long)D, g, (long long)H, \
                        w_up, w_downT, y, (long long)D, row_count, capr, mask, (long long)HW, h_out, 0LL,   \
                        state, list, phase, M, D, H);                                                  \
    }                                                                                                 \
}
LONG(bf16, bf16, true)
LONG(bf16_relu, bf16, false)
LONG(f32, float, true)
}
"""
# LONG_WARPS 4 (production 8): 128 emulated threads a block, and a mask of more than
# 128 words (H > 4096, the wide-shape test) is read in two rounds, as at W1 with 8 warps
# past H = 8192; LONG_SCAN_ROUNDS 1 (production 4): scan items of 128 rows, so M = 300
# is three scan items and the list is appended to by several
_FFN_DEFINES = {"RES_THREADS": 64, "RES_STAGE": 64, "COMPACT_WARPS": 2, "LONG_WARPS": 4, "LONG_SCAN_ROUNDS": 1}


@pytest.fixture(scope="module")
def ffn_lib(tmp_path_factory):
    harness = _FFN_HARNESS.replace('#include "resident_source.cuh"',
                                   _emulation_source("spmm_resident.cu").replace('#include "common.cuh"', "")
                                   + _emulation_source("ffn_long.cu").replace('#include "common.cuh"', ""))
    return _build(tmp_path_factory, "ffn_sparse.cu", harness, _FFN_DEFINES)


def _run_sparse_step(lib, sfx, split, x, g, w_up, w_downT, idx, val, count, capr, heavy_limit, threads,
                     long_rows=False, second="resident"):
    """The fused sparse kernel through the harness on fresh poisoned outputs (13 blocks);
    split: its up-only form, then the down projection from the row lists (rows up to
    min(capr, heavy_limit)) by the resident kernel (``second="resident"``) or by
    twellpy_ffn_list_down's gathers (``"kb8"``, ``"kb3"``: its neurons per batch). The
    lists' values are a copy of ``val`` (h goes over the served rows' gate values in split
    mode). Returns y, heavy, counters, those values, and the resident plan's row chunks
    (None when fused or gathered)."""
    (M, D), H = x.shape, g.shape[1]
    y = np.full((M, D), np.nan, np.float32).astype(x.dtype)
    heavy = np.full(M, -1, np.int32)
    counters = np.zeros(2, np.uint64)
    lists_val = val.copy()
    getattr(lib, f"ffn_{sfx}_{'split' if split else 'fused'}")(
        _ptr(x), _ptr(g), _ptr(w_up), _ptr(w_downT), _ptr(y), _ptr(idx), _ptr(lists_val), _ptr(count), capr,
        _ptr(heavy), _ptr(counters), M, D, H, heavy_limit, 13, threads, int(long_rows))
    n_chunks = None
    if split and second != "resident":
        getattr(lib, f"list_down_{sfx}_{second}")(_ptr(idx), _ptr(lists_val), _ptr(count), capr,
                                                 min(capr, heavy_limit), _ptr(w_downT), _ptr(y), M, D, 7, threads)
    elif split:
        lpr, smem, n_slices, n_chunks, rows = resident_layout(M, H, D, x.dtype.itemsize, 5, 64 * 1024,
                                                              _FFN_DEFINES["RES_THREADS"],
                                                              _FFN_DEFINES["RES_STAGE"], 16)
        getattr(lib, f"res_lists_{sfx}_{lpr}")(
            _ptr(count), capr, min(capr, heavy_limit), _ptr(idx), _ptr(lists_val), _ptr(w_downT), _ptr(y), M, H, D,
            rows, n_slices, n_chunks, ctypes.c_longlong(smem))
    return y, heavy, counters, lists_val, n_chunks


def _sparse_step_inputs(rng, dtype, M=300, D=64, H=600):
    """x (M, D) and the float32 gate weights of the sparse-step tests: about 10 active
    neurons a row (column 0 of x is 1 and carries the threshold), row 7 firing none."""
    x = rng.standard_normal((M, D)).astype(dtype)
    w_gate = (rng.standard_normal((H, D)) / 8).astype(np.float32)
    w_gate[:, 0] -= 2.1
    x[:, 0] = 1
    x[7, :] = 0
    return x, w_gate


def _row_lists(g, capr):
    """What twellpy_ffn_rowpack writes: the active neurons (> 0 or NaN) of each
    row in column order with their gate values, for rows of at most capr."""
    M, H = g.shape
    gf = g.astype(np.float32)
    active = ~(gf <= 0)
    count = active.sum(axis=1).astype(np.int32)
    idx = np.full((M, capr), -77, np.int32)                  # poison beyond the count
    val = np.full((M, capr), np.nan, np.float32)
    for r in range(M):
        if count[r] <= capr:
            cols = np.flatnonzero(active[r])
            idx[r, :cols.size], val[r, :cols.size] = cols, gf[r, cols]
    return idx, val, count


@pytest.mark.parametrize("dtype", [bfloat16, np.dtype(np.float32)], ids=str)
@pytest.mark.parametrize("heavy_limit", [0x7FFFFFFF, 20], ids=["every-row-here", "hand-off-over-20"])
@pytest.mark.parametrize("second", ["resident", "kb8", "kb3"])
def test_ffn_split_mode_gives_the_fused_bits(ffn_lib, dtype, heavy_limit, second):
    """Split mode (the fused kernel's up projection writes h over the list values,
    then the resident kernel, or twellpy_ffn_list_down's gathers in the two-pass
    step, adds the down projection from the lists) writes the same y bits as the
    fused kernel, for list rows, rows too long for their list (scanned and
    computed whole), empty rows and, with the hand-off, rows left to the host
    (untouched by both). The kernels spell the down projection's fma, so the
    emulation (which does not contract a * b + c) sees the GPU's bits; the
    gathers' batch size (8 or 3 neurons, the last batch part-full) changes
    nothing."""
    rng = np.random.default_rng(19)
    D, H, capr = 64, 600, 16
    x, w_gate = _sparse_step_inputs(rng, dtype)              # row 7: no active neuron
    g = (x.astype(np.float32) @ w_gate.T).astype(dtype)
    g[11, :300] = np.abs(g[11, :300].astype(np.float32)) + 0.25   # row 11: 300+ active, over capr
    g[12, :18] = 1.0                                         # row 12: just over capr
    w_up = (rng.standard_normal((H, D)) / 8).astype(dtype)
    w_downT = (rng.standard_normal((H, D)) / 8).astype(dtype)
    idx, val, count = _row_lists(g, capr)
    assert count[7] == 0 and count[11] > capr and count[12] > capr and 5 < np.median(count) <= capr
    sfx = "bf16" if dtype == bfloat16 else "f32"
    threads = 128 if dtype == bfloat16 else 64               # NV = 1: threads * 16 / itemsize >= D

    def run(split):
        y, heavy, counters, lists_val, n_chunks = _run_sparse_step(ffn_lib, sfx, split, x, g, w_up, w_downT, idx,
                                                                   val, count, capr, heavy_limit, threads,
                                                                   second=second)
        if split:
            # h replaced the gate values of the served rows' lists, nothing else
            unserved = ~(count <= min(capr, heavy_limit))
            np.testing.assert_array_equal(lists_val[unserved].view(np.uint32), val[unserved].view(np.uint32))
            assert n_chunks > 1 if second == "resident" else n_chunks is None
        return y, heavy, counters

    y_fused, heavy_f, counters_f = run(False)
    y_split, heavy_s, counters_s = run(True)
    np.testing.assert_array_equal(heavy_s, heavy_f)
    np.testing.assert_array_equal(counters_s, counters_f)
    bits = np.uint16 if dtype == bfloat16 else np.uint32
    np.testing.assert_array_equal(y_split.view(bits), y_fused.view(bits))
    handed = heavy_f == 1
    assert handed.sum() == (count > heavy_limit).sum()
    assert np.isnan(y_split[handed].astype(np.float32)).all(), "rows handed to the host stay untouched"
    ok = ~handed
    assert not np.isnan(y_split[ok].astype(np.float32)).any()
    gf = g.astype(np.float64)
    h = np.where(gf > 0, gf, 0) * (x.astype(np.float64) @ w_up.astype(np.float64).T)
    ref = h @ w_downT.astype(np.float64)
    err = np.linalg.norm(y_split[ok].astype(np.float64) - ref[ok]) / np.linalg.norm(ref[ok])
    assert err < (1e-2 if dtype == bfloat16 else 1e-5), err
    assert not y_split[7].astype(np.float32).any()


def _run_long(lib, sfx, x, g, w_up, w_downT, y, count, capr, mask, h_out, M, D, H, blocks):
    """twellpy_ffn_long through the harness, one launch of ``blocks`` persistent blocks;
    its state must be zero again afterwards. The three-launch form (scan, up, down) runs
    on copies and must give the same bits in y, g (h in place), the mask and h_out, and
    leave its state zero too."""
    copies = [a.copy() if a is not None else None for a in (g, y, mask, h_out)]
    for split, (gg, yy, mm, hh) in ((False, (g, y, mask, h_out)), (True, copies)):
        state = np.zeros(8, np.uint32)
        long_list = np.full(M, -1, np.int32)
        getattr(lib, f"long_{sfx}")(_ptr(x), _ptr(gg), _ptr(w_up), _ptr(w_downT), _ptr(yy), _ptr(count), capr,
                                    _ptr(mm), None if hh is None else _ptr(hh), _ptr(state), _ptr(long_list), M, D,
                                    H, blocks, int(split))
        np.testing.assert_array_equal(state, 0, err_msg="the last block zeroes the state for the next launch")
        found = long_list[long_list >= 0]
        np.testing.assert_array_equal(np.sort(found), np.flatnonzero(count > capr), err_msg="the list of long rows")
    g2, y2, mask2, h2 = copies
    for one, two in ((g, g2), (y, y2), (mask, mask2), (h_out, h2)):
        if one is not None:
            np.testing.assert_array_equal(two.view(np.uint8), one.view(np.uint8), err_msg="three launches, other bits")


def test_long_row_launch_constants_match_the_kernel():
    """The host's block size and scan-item rows (cuda_ffn) are the kernel's LONG_THREADS
    and LONG_SCAN at its default defines: phase 1's grid is ceil(M / LONG_SCAN) blocks, so
    a mismatch would leave rows unscanned. Read from the source, no GPU needed."""
    from twellpy.backends import cuda_ffn

    src = (Path(__file__).resolve().parent.parent / "raw_kernels" / "ffn_long.cu").read_text()
    define = {m.group(1): int(m.group(2)) for m in re.finditer(r"^#define (LONG_\w+) (\d+)$", src, re.M)}
    assert cuda_ffn._LONG_THREADS == 32 * define["LONG_WARPS"]
    assert cuda_ffn._LONG_SCAN == cuda_ffn._LONG_THREADS * define["LONG_SCAN_ROUNDS"]


# three of the twelve combinations: every dtype, mode and grid shape once (each case
# emulates the sparse kernel three times, 30-60 s on the 2-core CI machine)
@pytest.mark.parametrize("dtype, split, blocks", [(bfloat16, False, 2), (bfloat16, True, 1),
                                                  (np.dtype(np.float32), False, 5)], ids=["bf16-fused-2", "bf16-split-1",
                                                                                          "f32-fused-5"])
def test_long_rows_spread_over_blocks(ffn_lib, dtype, split, blocks):
    """With long_rows the sparse kernel leaves rows over capr to ffn_long.cu: y of every
    other row keeps the serial path's bits, the long rows (just over capr, hundreds, every
    neuron, a NaN gate, a row whose h is 0 at an active neuron) match a float64 reference
    of the FFN with h rounded to the dtype, the counters are the serial path's, and a
    second run gives the same bits. Rows in three scan items, persistent grids of 1, 2 and
    5 blocks (one block doing every item, and blocks drawing only the closing ticket)."""
    rng = np.random.default_rng(29)
    M, D, H, capr = 300, 64, 600, 16
    x, w_gate = _sparse_step_inputs(rng, dtype)
    g = (x.astype(np.float32) @ w_gate.T).astype(dtype)
    g[11, :300] = np.abs(g[11, :300].astype(np.float32)) + 0.25   # 300+ active
    g[12, :18] = 1.0                                              # just over capr
    g[150] = np.abs(g[150].astype(np.float32)) + 0.5              # every neuron (second chunk)
    g[299, 40:90] = 2.0                                           # last row, third chunk
    g[299, 45] = np.nan                                           # NaN gate: active, NaN h
    g[290, :40] = 1.0
    w_up = (rng.standard_normal((H, D)) / 8).astype(dtype)
    w_up[5] = 0                                                   # h = 0 at an active neuron
    w_downT = (rng.standard_normal((H, D)) / 8).astype(dtype)
    idx, val, count = _row_lists(g, capr)
    long_rows = np.flatnonzero(count > capr)
    assert set(long_rows) >= {11, 12, 150, 290, 299} and count[150] == H
    sfx = "bf16" if dtype == bfloat16 else "f32"
    threads = 128 if dtype == bfloat16 else 64

    def run(long):
        gg = g.copy()
        y, heavy, counters, _, _ = _run_sparse_step(ffn_lib, sfx, split, x, gg, w_up, w_downT, idx, val, count, capr,
                                                    0x7FFFFFFF, threads, long_rows=long)
        mask = np.full((M, (H + 31) // 32), 0xDEADBEEF, np.uint32)
        if long:
            assert np.isnan(y[long_rows].astype(np.float32)).all(), "the sparse kernel left the long rows alone"
            _run_long(ffn_lib, sfx, x, gg, w_up, w_downT, y, count, capr, mask, None, M, D, H, blocks)
        return y, heavy, counters, gg, mask

    y_serial, heavy_0, counters_0, _, _ = run(False)
    y_long, heavy_1, counters_1, g_after, mask = run(True)
    bits = np.uint16 if dtype == bfloat16 else np.uint32
    np.testing.assert_array_equal(counters_1, counters_0)
    np.testing.assert_array_equal(heavy_1, np.zeros(M, np.int32))
    short = count <= capr
    np.testing.assert_array_equal(y_long[short].view(bits), y_serial[short].view(bits))
    np.testing.assert_array_equal(run(True)[0].view(bits), y_long.view(bits))
    # the mask holds each long row's active bits; other rows are untouched
    active = ~(g.astype(np.float32) <= 0)
    for r in range(M):
        if r in long_rows:
            word_bits = np.zeros(mask.shape[1] * 32, bool)
            word_bits[:H] = active[r]
            want = np.packbits(word_bits.reshape(-1, 32)[:, ::-1], axis=1, bitorder="big").view(">u4").ravel()
            np.testing.assert_array_equal(mask[r], want.astype(np.uint32))
        else:
            assert (mask[r] == 0xDEADBEEF).all()
    # h over the active entries of the long rows only
    gf, xf = g.astype(np.float64), x.astype(np.float64)
    h = np.where(active, gf * (xf @ w_up.astype(np.float64).T), 0.0)
    h_rounded = h.astype(np.float32).astype(dtype).astype(np.float64)
    changed = g_after.view(bits) != g.view(bits)
    assert not changed[short].any()
    np.testing.assert_allclose(g_after[long_rows].astype(np.float64)[active[long_rows]],
                               h_rounded[long_rows][active[long_rows]], rtol=1e-2 if dtype == bfloat16 else 1e-5,
                               atol=1e-3 if dtype == bfloat16 else 1e-6)
    assert np.isnan(g_after[299, 45].astype(np.float32)) and np.isnan(y_long[299].astype(np.float32)).all()
    ok = [r for r in long_rows if r != 299]
    ref = h_rounded[ok] @ w_downT.astype(np.float64)
    err = np.linalg.norm(y_long[ok].astype(np.float64) - ref) / np.linalg.norm(ref)
    assert err < (1e-2 if dtype == bfloat16 else 1e-5), err
    # against the serial path's long rows (h in fp32 there): within the dtype's rounding
    err_serial = (np.linalg.norm(y_long[ok].astype(np.float64) - y_serial[ok].astype(np.float64))
                  / np.linalg.norm(y_serial[ok].astype(np.float64)))
    assert err_serial < (2e-2 if dtype == bfloat16 else 1e-5), err_serial


def test_long_rows_kernel_writes_h_and_the_plain_relu_ffn(ffn_lib):
    """WRITE_H: h_out gets h at the long rows' active entries only; the plain ReLU FFN
    (GATED = false) keeps h = g in place and writes it to h_out; y of the long rows
    from that h, other rows untouched."""
    rng = np.random.default_rng(31)
    M, D, H, capr = 140, 64, 200, 8
    x = rng.standard_normal((M, D)).astype(bfloat16)
    g = (rng.standard_normal((M, H)) - 1.5).astype(bfloat16)
    g[3] = np.abs(g[3].astype(np.float32)) + 0.1                  # every neuron
    g[130, :30] = 1.0                                             # second chunk
    w_up = (rng.standard_normal((H, D)) / 8).astype(bfloat16)
    w_downT = (rng.standard_normal((H, D)) / 8).astype(bfloat16)
    _, _, count = _row_lists(g, capr)
    long_rows = np.flatnonzero(count > capr)
    assert {3, 130} <= set(long_rows)
    active = ~(g.astype(np.float32) <= 0)
    for gated in (True, False):
        gg = g.copy()
        mask = np.zeros((M, (H + 31) // 32), np.uint32)
        h_out = np.full((M, H), np.nan, np.float32).astype(bfloat16)
        y = np.full((M, D), np.nan, np.float32).astype(bfloat16)
        _run_long(ffn_lib, "bf16" if gated else "bf16_relu", x, gg, w_up, w_downT, y, count, capr, mask, h_out,
                  M, D, H, 1)
        h_ref = np.where(active, gg.astype(np.float64), 0.0)
        ref = h_ref[long_rows] @ w_downT.astype(np.float64)
        err = np.linalg.norm(y[long_rows].astype(np.float64) - ref) / np.linalg.norm(ref)
        assert err < 1e-2, err
        assert np.isnan(np.delete(y, long_rows, axis=0).astype(np.float32)).all()
        sel = np.zeros((M, H), bool)
        sel[long_rows] = active[long_rows]
        np.testing.assert_array_equal(h_out.view(np.uint16)[sel], gg.view(np.uint16)[sel])
        assert np.isnan(h_out[~sel].astype(np.float32)).all()
        if not gated:
            np.testing.assert_array_equal(gg.view(np.uint16), g.view(np.uint16))



@pytest.mark.parametrize("sfx, D, H", [("bf16", 72, 4648), ("bf16_relu", 72, 4648), ("bf16", 264, 200),
                                        ("f32", 12, 4200)], ids=["bf16-H4648", "relu-H4648", "bf16-D264", "f32-H4200"])
def test_long_rows_wide_shapes(ffn_lib, sfx, D, H):
    """The long-row kernel alone at shapes the other tests do not reach: H > 32 *
    LONG_THREADS (the down work builds a row's column list in more than one
    round of mask words, as at W1's H = 5632), H % 32 != 0 (partial last mask word), a
    last y slice of fewer than LONG_GROUP vectors (D = 72 in bf16: DV = 9) and more than
    32 vectors per up dot product (D = 264: DV = 33). y and the mask against float64
    with h rounded to the dtype; rows not over capr untouched."""
    dtype = np.dtype(np.float32) if sfx == "f32" else bfloat16
    gated = sfx != "bf16_relu"
    rng = np.random.default_rng(37)
    M, capr = 3, 16
    x = rng.standard_normal((M, D)).astype(dtype)
    g = rng.standard_normal((M, H)).astype(dtype)
    g[1] = np.abs(g[1].astype(np.float32)) + 0.1                 # every neuron
    w_up = (rng.standard_normal((H, D)) / 8).astype(dtype)
    w_downT = (rng.standard_normal((H, D)) / 8).astype(dtype)
    active = ~(g.astype(np.float32) <= 0)
    count = active.sum(axis=1).astype(np.int32)
    count[0] = capr                                              # row 0: a list row, left alone
    gg = g.copy()
    mask = np.full((M, (H + 31) // 32), 0xDEADBEEF, np.uint32)
    y = np.full((M, D), np.nan, np.float32).astype(dtype)
    _run_long(ffn_lib, sfx, x, gg, w_up, w_downT, y, count, capr, mask, None, M, D, H, 1)
    assert np.isnan(y[0].astype(np.float32)).all() and (mask[0] == 0xDEADBEEF).all()
    bits = np.uint16 if dtype == bfloat16 else np.uint32
    np.testing.assert_array_equal(gg[0].view(bits), g[0].view(bits))
    np.testing.assert_array_equal(gg[~active].view(bits), g[~active].view(bits))
    gf = g.astype(np.float64)
    h = np.where(active, gf * (x.astype(np.float64) @ w_up.astype(np.float64).T) if gated else gf, 0.0)
    h = h.astype(np.float32).astype(dtype).astype(np.float64)
    tol = 1e-2 if dtype == bfloat16 else 1e-5
    for r in (1, 2):
        word_bits = np.zeros(mask.shape[1] * 32, bool)
        word_bits[:H] = active[r]
        want = np.packbits(word_bits.reshape(-1, 32)[:, ::-1], axis=1, bitorder="big").view(">u4").ravel()
        np.testing.assert_array_equal(mask[r], want.astype(np.uint32))
        ref = h[r] @ w_downT.astype(np.float64)
        err = np.linalg.norm(y[r].astype(np.float64) - ref) / np.linalg.norm(ref)
        assert err < tol, (r, err)


_PACK_HARNESS = r"""
#include "emu.h"
#include "kernel_source.cuh"

extern "C" {
void rowpack_bf16(const __nv_bfloat16* g, long long ldg, int M, int H, int capr, int* idx, float* val, int* count,
                  unsigned long long* total) {
    emu::launch(twellpy_ffn_rowpack<__nv_bfloat16>, dim3((M + 7) / 8), dim3(256), 0, g, ldg, M, H, capr, idx, val,
                count, total);
}
void rowpack_f16(const __half* g, long long ldg, int M, int H, int capr, int* idx, float* val, int* count,
                 unsigned long long* total) {
    emu::launch(twellpy_ffn_rowpack<__half>, dim3((M + 7) / 8), dim3(256), 0, g, ldg, M, H, capr, idx, val,
                count, total);
}
void active_bits_bf16(const uint4* raw, unsigned* bits, long long n) {
    for (long long k = 0; k < n; ++k) bits[k] = relu_active_bits<__nv_bfloat16>(raw[k]);
}
void active_bits_f16(const uint4* raw, unsigned* bits, long long n) {
    for (long long k = 0; k < n; ++k) bits[k] = relu_active_bits<__half>(raw[k]);
}
// the element-wise steps of the dense path, on a grid too small to cover n in one pass
#define ELEMENTWISE(NAME, T)                                                                          \
void gate_mul_##NAME(const T* g, const T* u, T* h, long long n) {                                     \
    emu::launch(twellpy_ffn_gate_mul<T>, dim3(3), dim3(64), 0, g, u, h, n);                           \
}                                                                                                     \
void relu_##NAME(const T* g, T* h, long long n) { emu::launch(twellpy_ffn_relu<T>, dim3(3), dim3(64), 0, g, h, n); }
ELEMENTWISE(bf16, __nv_bfloat16)
ELEMENTWISE(f16, __half)
ELEMENTWISE(f32, float)
ELEMENTWISE(f64, double)
}
"""


@pytest.mark.parametrize("words", [1, 0], ids=["word-test", "value-test"])
def test_rowpack_matches_the_lists_the_split_test_assumes(tmp_path_factory, words):
    """The real twellpy_ffn_rowpack (ffn_pack.cu) writes exactly the row lists that
    test_ffn_split_mode_gives_the_fused_bits builds in numpy (column order, gate
    values as float, true counts; NaN is active), so the emulated chain row pack ->
    split -> resident matches what the plan runs."""
    lib = _build(tmp_path_factory, "ffn_pack.cu", _PACK_HARNESS, {"FFN_ROWPACK_WORDS": words})
    rng = np.random.default_rng(23)
    M, H, capr = 37, 600, 16
    g = (rng.standard_normal((M, H)) - 2.0).astype(bfloat16)
    g[3, :40] = 1.0                                  # over capr
    g[5, 7] = np.nan                                 # NaN is an active entry
    g[6] = -0.0                                      # nothing active
    idx = np.full((M, capr), -77, np.int32)
    val = np.full((M, capr), np.nan, np.float32)
    count = np.full(M, -1, np.int32)
    total = np.zeros(1, np.uint64)
    lib.rowpack_bf16(_ptr(g), ctypes.c_longlong(H), M, H, capr, _ptr(idx), _ptr(val), _ptr(count), _ptr(total))
    want_idx, want_val, want_count = _row_lists(g, capr)
    np.testing.assert_array_equal(count, want_count)
    assert int(total[0]) == int(want_count.sum())
    for r in range(M):
        k = min(int(want_count[r]), capr)
        if want_count[r] <= capr:
            np.testing.assert_array_equal(idx[r, :k], want_idx[r, :k])
            np.testing.assert_array_equal(val[r, :k].view(np.uint32), want_val[r, :k].view(np.uint32))
    assert count[3] > capr and count[6] == 0 and 7 in idx[5, :count[5]]


def _relu_active_on_gpu(z):
    """relu_active as the GPU computes it (-ftz: float conversion, then setp.gtu.ftz.f32,
    which flushes a float denormal to zero): NaN, or a positive value that is not a float
    denormal (bfloat16 denormals are float denormals; half denormals are normal floats)."""
    f = z.astype(np.float32)
    return np.isnan(f) | (f >= np.finfo(np.float32).tiny) if z.dtype == bfloat16 else np.isnan(f) | (f > 0)


@pytest.mark.parametrize("dtype", [bfloat16, np.dtype(np.float16)], ids=str)
def test_rowpack_activity_of_every_16bit_pattern(tmp_path_factory, dtype):
    """twellpy_ffn_rowpack's word test (FFN_ROWPACK_WORDS=1) marks the values the
    value-by-value test marks on the GPU, for each of the 65536 bit patterns at each
    vector position; and the row pack lists them (column order, gate values, true
    counts) on rows made of every pattern. (The value test itself runs here without
    -ftz, so it would keep bfloat16 denormals: the GPU test compares the two.)"""
    lib = _build(tmp_path_factory, "ffn_pack.cu", _PACK_HARNESS, {"FFN_ROWPACK_WORDS": 1})
    z = _every_16bit_pattern(dtype, 5)
    n = z.shape[0]
    bits = np.full(n, 0xDEADBEEF, np.uint32)
    getattr(lib, f"active_bits_{_suffix(dtype)}")(_ptr(z), _ptr(bits), ctypes.c_longlong(n))
    want = (_relu_active_on_gpu(z) << np.arange(8, dtype=np.uint32)).sum(axis=1, dtype=np.uint32)
    np.testing.assert_array_equal(bits, want)
    M, H, capr = 64, 1024, 1024                               # 65536 patterns, one per entry
    g = np.ascontiguousarray(z[:, 0].reshape(8, -1)[0].reshape(M, H))
    idx = np.full((M, capr), -77, np.int32)
    val = np.full((M, capr), np.nan, np.float32)
    count = np.full(M, -1, np.int32)
    total = np.zeros(1, np.uint64)
    getattr(lib, f"rowpack_{_suffix(dtype)}")(_ptr(g), ctypes.c_longlong(H), M, H, capr, _ptr(idx), _ptr(val),
                                               _ptr(count), _ptr(total))
    on = _relu_active_on_gpu(g)
    np.testing.assert_array_equal(count, on.sum(axis=1))
    assert int(total[0]) == int(on.sum())
    for r in range(M):
        cols = np.flatnonzero(on[r])
        np.testing.assert_array_equal(idx[r, :cols.size], cols)
        np.testing.assert_array_equal(val[r, :cols.size], g[r, cols].astype(np.float32))  # NaN payloads aside
        assert (idx[r, cols.size:] == -77).all()


@pytest.mark.parametrize("dtype", [bfloat16, np.float16, np.float32, np.float64])
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_dense_path_elementwise_kernels_vector_and_scalar_loops(tmp_path_factory, dtype, offset):
    """twellpy_ffn_gate_mul and twellpy_ffn_relu give relu(g) * u and relu(g) element by
    element, rounded once, whether their 16-byte loop runs (aligned, offset 0) or only
    the scalar one (offset 1, 3 elements: misaligned), with a tail that is not a whole
    vector, NaN kept, -0.0 and negative values to +0.0, in place (h is u / h is g) too."""
    lib = _build(tmp_path_factory, "ffn_pack.cu", _PACK_HARNESS, {})
    name = {bfloat16: "bf16", np.dtype(np.float16): "f16", np.dtype(np.float32): "f32",
            np.dtype(np.float64): "f64"}[np.dtype(dtype)]
    rng = np.random.default_rng(5 + offset)
    n = 64 * 3 * 16 + 13  # more than the grid's threads times a vector: grid-stride and a tail
    g_all = rng.standard_normal(n + offset).astype(dtype)
    u_all = rng.standard_normal(n + offset).astype(dtype)
    g, u = g_all[offset:], u_all[offset:]
    g[[5, 40, 77]] = np.array([np.nan, -0.0, np.inf]).astype(dtype)
    g[n - 2] = np.nan  # in the tail
    gf, uf = g.astype(np.float64), u.astype(np.float64)
    acc = np.float64 if np.dtype(dtype) == np.float64 else np.float32
    want_mul = np.where(gf <= 0, 0.0, gf.astype(acc) * uf.astype(acc)).astype(acc).astype(dtype)
    want_relu = np.where(gf <= 0, 0.0, gf).astype(dtype)

    def bits(a):
        return a.view(np.uint16 if a.itemsize == 2 else (np.uint32 if a.itemsize == 4 else np.uint64))

    h_all = np.full(n + offset, np.nan, dtype)
    h = h_all[offset:]
    getattr(lib, f"gate_mul_{name}")(_ptr(g), _ptr(u), _ptr(h), ctypes.c_longlong(n))
    np.testing.assert_array_equal(bits(h), bits(want_mul))
    u_in_place = u.copy()
    getattr(lib, f"gate_mul_{name}")(_ptr(g), _ptr(u_in_place), _ptr(u_in_place), ctypes.c_longlong(n))
    np.testing.assert_array_equal(bits(u_in_place), bits(want_mul))
    h[:] = np.nan
    getattr(lib, f"relu_{name}")(_ptr(g), _ptr(h), ctypes.c_longlong(n))
    np.testing.assert_array_equal(bits(h), bits(want_relu))
    g_in_place = g.copy()
    getattr(lib, f"relu_{name}")(_ptr(g_in_place), _ptr(g_in_place), ctypes.c_longlong(n))
    np.testing.assert_array_equal(bits(g_in_place), bits(want_relu))
    assert np.isnan(h[5]) and bits(h[40:41])[0] == 0 and np.isinf(h[77])


# ---------------------------------------------------------------------------
# the split training backward: train_ffn.cu (DX = 0) + spmm_resident.cu (LISTS, DUAL)
# ---------------------------------------------------------------------------
_BWD_HARNESS = r"""
#include "emu.h"
#include "kernel_source.cuh"
#include "resident_source.cuh"

extern "C" {
typedef __nv_bfloat16 bf16;
#define BWD(NAME, T)                                                                                   \
void NAME(int gated, int with_dx, const T* dy, const T* w_downT, const T* w_a, const T* w_b, const int* idx, \
          const int* nnz, const T* gval, const T* uval, T* da, T* db, T* dx, long long M, int W, int D,     \
          double l1s, int vec) {                                                                      \
    dim3 grid((unsigned)((M + TW_WARPS - 1) / TW_WARPS)), block(32 * TW_WARPS);                         \
    if (gated && with_dx)                                                                             \
        emu::launch(twellpy_train_bwd<T, 1, 1>, grid, block, 0, dy, w_downT, w_a, w_b, idx, nnz, gval, uval, \
                    da, db, dx, M, W, D, l1s, vec);                                                    \
    else if (gated)                                                                                   \
        emu::launch(twellpy_train_bwd<T, 1, 0>, grid, block, 0, dy, w_downT, w_a, w_b, idx, nnz, gval, uval, \
                    da, db, dx, M, W, D, l1s, vec);                                                    \
    else if (with_dx)                                                                                 \
        emu::launch(twellpy_train_bwd<T, 0, 1>, grid, block, 0, dy, w_downT, w_a, w_b, idx, nnz, gval, uval, \
                    da, db, dx, M, W, D, l1s, vec);                                                    \
    else                                                                                              \
        emu::launch(twellpy_train_bwd<T, 0, 0>, grid, block, 0, dy, w_downT, w_a, w_b, idx, nnz, gval, uval, \
                    da, db, dx, M, W, D, l1s, vec);                                                    \
}
BWD(bwd_f32, float)
BWD(bwd_bf16, bf16)
#define ELL_DX(NAME, T)                                                                                \
void NAME(int gated, const T* w_a, const T* w_b, const int* idx, const int* nnz, const T* da, const T* db, T* dx, \
          long long M, int W, int D, int vec, const int* skip) {                                      \
    dim3 grid((unsigned)((M + TW_WARPS - 1) / TW_WARPS)), block(32 * TW_WARPS);                         \
    if (gated)                                                                                        \
        emu::launch(twellpy_train_ell_dx<T, 1>, grid, block, 0, w_a, w_b, idx, nnz, da, db, dx, M, W, D, vec, \
                    skip);                                                                            \
    else                                                                                              \
        emu::launch(twellpy_train_ell_dx<T, 0>, grid, block, 0, w_a, w_b, idx, nnz, da, db, dx, M, W, D, vec, \
                    skip);                                                                            \
}
ELL_DX(ell_dx_f32, float)
ELL_DX(ell_dx_bf16, bf16)
#define RES_DX(NAME, T, LPR)                                                                           \
void NAME(int dual, const int* nnz, int W, const int* idx, const T* da, const T* db, const T* w_a, const T* w_b, \
          T* dx, int M, int H, int D, int rows, int gx, int gy, long long smem) {                      \
    if (dual)                                                                                         \
        emu::launch(twellpy_spmm_resident<T, T, LPR, true, true>, dim3(gx, gy), dim3(RES_THREADS), (size_t)smem, \
                    (const long long*)nullptr, nnz, W, W, idx, da, w_a, dx, M, H, D, rows, db, w_b);    \
    else                                                                                              \
        emu::launch(twellpy_spmm_resident<T, T, LPR, true, false>, dim3(gx, gy), dim3(RES_THREADS), (size_t)smem, \
                    (const long long*)nullptr, nnz, W, W, idx, da, w_a, dx, M, H, D, rows, (const T*)nullptr, \
                    (const T*)nullptr);                                                                \
}
RES_DX(res_dx_f32_1, float, 1)
RES_DX(res_dx_f32_2, float, 2)
RES_DX(res_dx_f32_4, float, 4)
RES_DX(res_dx_bf16_1, bf16, 1)
RES_DX(res_dx_bf16_2, bf16, 2)
RES_DX(res_dx_bf16_4, bf16, 4)
}
"""
_BWD_DEFINES = {"RES_THREADS": 64, "RES_STAGE": 64, "COMPACT_WARPS": 2, "TW_WARPS": 2}


@pytest.fixture(scope="module")
def bwd_lib(tmp_path_factory):
    harness = _BWD_HARNESS.replace('#include "resident_source.cuh"',
                                   _emulation_source("spmm_resident.cu").replace('#include "common.cuh"', ""))
    return _build(tmp_path_factory, "train_ffn.cu", harness, _BWD_DEFINES)


@pytest.mark.parametrize("dtype", [bfloat16, np.dtype(np.float32)], ids=str)
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("vec", [2, 1, 0])
def test_split_training_backward_gives_the_fused_bits(bwd_lib, dtype, gated, vec):
    """The backward split (the fused kernel without its dx product, then
    twellpy_spmm_resident with the du and dg slices of w_up and w_gate) writes the
    same du, dg and dx bits as the fused kernel, on ELL rows of every length from
    0 (backup rows, whose dx is 0) to W, with both of the fused kernel's dx paths."""
    rng = np.random.default_rng(29 + vec)
    M, W, H, D = 150, 12, 300, 64
    nnz = rng.integers(0, W + 1, M).astype(np.int32)
    nnz[[0, 7, M - 1]] = 0
    nnz[3] = W
    idx = np.full((M, W), -1, np.int32)
    for r in range(M):
        idx[r, :nnz[r]] = np.sort(rng.choice(H, nnz[r], replace=False))
    gval = np.zeros((M, W), np.float32)
    uval = np.zeros((M, W), np.float32)
    for r in range(M):
        gval[r, :nnz[r]] = rng.random(nnz[r]) + 0.1
        uval[r, :nnz[r]] = rng.standard_normal(nnz[r])
    gval, uval = gval.astype(dtype), uval.astype(dtype)
    dy = rng.standard_normal((M, D)).astype(dtype)
    w_downT, w_a, w_b = ((rng.standard_normal((H, D)) / 8).astype(dtype) for _ in range(3))
    sfx = "bf16" if dtype == bfloat16 else "f32"

    def run(split):
        da = np.full((M, W), np.nan, np.float32).astype(dtype)
        db = np.full((M, W), np.nan, np.float32).astype(dtype)
        dx = np.full((M, D), np.nan, np.float32).astype(dtype)
        getattr(bwd_lib, f"bwd_{sfx}")(int(gated), int(not split), _ptr(dy), _ptr(w_downT), _ptr(w_a), _ptr(w_b),
                                      _ptr(idx), _ptr(nnz), _ptr(gval), _ptr(uval), _ptr(da), _ptr(db), _ptr(dx),
                                      ctypes.c_longlong(M), W, D, ctypes.c_double(0.01), vec)
        if split:
            assert np.isnan(dx.astype(np.float32)).all(), "the split kernel must leave dx alone"
            plan = resident_layout(M, H, D, np.dtype(dtype).itemsize, 5, 64 * 1024, _BWD_DEFINES["RES_THREADS"],
                                   _BWD_DEFINES["RES_STAGE"], 16, dual=gated)
            lpr, smem, n_slices, n_chunks, rows = plan
            getattr(bwd_lib, f"res_dx_{sfx}_{lpr}")(int(gated), _ptr(nnz), W, _ptr(idx), _ptr(da), _ptr(db),
                                                   _ptr(w_a), _ptr(w_b), _ptr(dx), M, H, D, rows, n_slices,
                                                   n_chunks, ctypes.c_longlong(smem))
        return da, db, dx

    fused, split = run(False), run(True)
    bits = np.uint16 if dtype == bfloat16 else np.uint32
    for name, a, b in zip(("da", "db", "dx"), fused, split):
        if name == "db" and not gated:
            continue
        np.testing.assert_array_equal(b.view(bits), a.view(bits), err_msg=name)
    dx = split[2].astype(np.float64)
    assert not np.isnan(dx).any() and not dx[[0, 7, M - 1]].any()
    # and it is the product it claims to be
    da, db = (a.astype(np.float64) for a in split[:2])
    want = np.zeros((M, D))
    for r in range(M):
        for s in range(nnz[r]):
            want[r] += da[r, s] * w_a[idx[r, s]].astype(np.float64)
            if gated:
                want[r] += db[r, s] * w_b[idx[r, s]].astype(np.float64)
    assert np.linalg.norm(dx - want) <= (1e-5 if dtype == np.float32 else 1e-2) * np.linalg.norm(want)



@pytest.mark.parametrize("dtype", [bfloat16, np.dtype(np.float32)], ids=str)
@pytest.mark.parametrize("l1", [0.0, 0.01])
def test_training_backward_l1_term_matches_numpy_twin_on_nan_h(bwd_lib, dtype, l1):
    """With l1 = 0 the ELL backward adds no L1 term at all, as the backup-row kernel and
    the numpy twin do: a slot whose h is NaN (g = Inf, u = 0, e.g. an fp16 overflow next to
    a zero-initialised w_up) keeps a finite dg = dh * u instead of 0 * sign(NaN) = NaN."""
    from twellpy.backends import cpu_train

    M, W, H, D = 3, 4, 16, 32
    rng = np.random.default_rng(5)
    nnz = np.array([2, 4, 0], np.int32)
    idx = np.array([[1, 5, -1, -1], [0, 2, 9, 15], [-1] * 4], np.int32)
    gval = np.zeros((M, W), np.float32)
    uval = np.zeros((M, W), np.float32)
    gval[0, :2], uval[0, :2] = [np.inf, 0.5], [0.0, -1.0]     # slot (0, 0): h = Inf * 0 = NaN
    gval[1], uval[1] = [1.0, 2.0, 0.25, 3.0], [1.0, -2.0, 0.5, 0.0]
    gval, uval = gval.astype(dtype), uval.astype(dtype)
    dy = rng.standard_normal((M, D)).astype(dtype)
    w_downT, w_a, w_b = ((rng.standard_normal((H, D)) / 8).astype(dtype) for _ in range(3))
    sfx = "bf16" if dtype == bfloat16 else "f32"
    da = np.full((M, W), np.nan, np.float32).astype(dtype)
    db = np.full((M, W), np.nan, np.float32).astype(dtype)
    dx = np.full((M, D), np.nan, np.float32).astype(dtype)
    getattr(bwd_lib, f"bwd_{sfx}")(1, 1, _ptr(dy), _ptr(w_downT), _ptr(w_a), _ptr(w_b), _ptr(idx), _ptr(nnz),
                                  _ptr(gval), _ptr(uval), _ptr(da), _ptr(db), _ptr(dx), ctypes.c_longlong(M), W, D,
                                  ctypes.c_double(l1), 1)
    want_da, want_db = np.zeros_like(da), np.zeros_like(db)
    cpu_train.ffn_backward_ell(dy, w_downT, w_a, w_b, idx, nnz, gval, uval, l1, True, want_da, want_db)
    for name, got, want in (("da", da, want_da), ("db", db, want_db)):
        got, want = got.astype(np.float64), want.astype(np.float64)
        on = idx >= 0
        np.testing.assert_array_equal(np.isnan(got[on]), np.isnan(want[on]), err_msg=name)
        ok = on & np.isfinite(want)
        np.testing.assert_allclose(got[ok], want[ok], rtol=2e-2 if dtype == bfloat16 else 1e-5, atol=1e-6,
                                   err_msg=name)
    assert (db[0, 0] == 0) == (l1 == 0.0)   # the NaN h: finite dg only without the L1 term

_FWD_HARNESS = r"""
#include "emu.h"
#include "kernel_source.cuh"
#include "resident_source.cuh"

extern "C" {
typedef __nv_bfloat16 bf16;
#define FWD(NAME, T)                                                                                   \
void NAME(int gated, int with_y, const T* x, const T* w_up, const T* w_downT, const int* idx, const int* nnz, \
          const T* gval, T* uval, T* y, typename twellpy::accum<T>::type* habs, long long M, int W, int D, int vec) { \
    dim3 grid((unsigned)((M + TW_WARPS - 1) / TW_WARPS)), block(32 * TW_WARPS);                         \
    if (gated && with_y)                                                                              \
        emu::launch(twellpy_train_fwd<T, 1, 1>, grid, block, 0, x, w_up, w_downT, idx, nnz, gval, uval, y, habs, \
                    M, W, D, vec);                                                                     \
    else if (gated)                                                                                   \
        emu::launch(twellpy_train_fwd<T, 1, 0>, grid, block, 0, x, w_up, w_downT, idx, nnz, gval, uval, y, habs, \
                    M, W, D, vec);                                                                     \
    else if (with_y)                                                                                  \
        emu::launch(twellpy_train_fwd<T, 0, 1>, grid, block, 0, x, w_up, w_downT, idx, nnz, gval, uval, y, habs, \
                    M, W, D, vec);                                                                     \
    else                                                                                              \
        emu::launch(twellpy_train_fwd<T, 0, 0>, grid, block, 0, x, w_up, w_downT, idx, nnz, gval, uval, y, habs, \
                    M, W, D, vec);                                                                     \
}
FWD(fwd_f32, float)
FWD(fwd_bf16, bf16)
#define ELL_Y(NAME, T)                                                                                 \
void NAME(int gated, const T* w_downT, const int* idx, const int* nnz, const T* gval, const T* uval, T* y, \
          long long M, int W, int D, int vec) {                                                       \
    dim3 grid((unsigned)((M + TW_WARPS - 1) / TW_WARPS)), block(32 * TW_WARPS);                         \
    if (gated)                                                                                        \
        emu::launch(twellpy_train_ell_y<T, 1>, grid, block, 0, w_downT, idx, nnz, gval, uval, y, M, W, D, vec); \
    else                                                                                              \
        emu::launch(twellpy_train_ell_y<T, 0>, grid, block, 0, w_downT, idx, nnz, gval, uval, y, M, W, D, vec); \
}
ELL_Y(ell_y_f32, float)
ELL_Y(ell_y_bf16, bf16)
#define RES_Y(NAME, T, LPR)                                                                            \
void NAME(int gated, const int* nnz, int W, const int* idx, const T* gval, const T* uval, const T* w_downT, T* y, \
          int M, int H, int D, int rows, int gx, int gy, long long smem) {                             \
    if (gated)                                                                                        \
        emu::launch(twellpy_spmm_resident<T, T, LPR, true, false, true>, dim3(gx, gy), dim3(RES_THREADS),   \
                    (size_t)smem, (const long long*)nullptr, nnz, W, W, idx, gval, w_downT, y, M, H, D, rows, \
                    uval, (const T*)nullptr);                                                          \
    else                                                                                              \
        emu::launch(twellpy_spmm_resident<T, T, LPR, true>, dim3(gx, gy), dim3(RES_THREADS), (size_t)smem,  \
                    (const long long*)nullptr, nnz, W, W, idx, gval, w_downT, y, M, H, D, rows,          \
                    (const T*)nullptr, (const T*)nullptr);                                             \
}
RES_Y(res_y_f32_1, float, 1)
RES_Y(res_y_f32_2, float, 2)
RES_Y(res_y_f32_4, float, 4)
RES_Y(res_y_bf16_1, bf16, 1)
RES_Y(res_y_bf16_2, bf16, 2)
RES_Y(res_y_bf16_4, bf16, 4)
}
"""


@pytest.fixture(scope="module")
def fwd_lib(tmp_path_factory):
    harness = _FWD_HARNESS.replace('#include "resident_source.cuh"',
                                   _emulation_source("spmm_resident.cu").replace('#include "common.cuh"', ""))
    return _build(tmp_path_factory, "train_ffn.cu", harness, _BWD_DEFINES)


@pytest.mark.parametrize("dtype", [bfloat16, np.dtype(np.float32)], ids=str)
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("vec", [2, 1, 0])
def test_split_training_forward_gives_the_fused_bits(fwd_lib, dtype, gated, vec):
    """The forward split (the fused kernel without its y product, then
    twellpy_spmm_resident forming h = g * u rounded to T while staging, PROD)
    writes the same u, |h| sums and y bits as the fused kernel, on ELL rows of
    every length from 0 (backup rows: y 0) to W, with both y paths."""
    rng = np.random.default_rng(41 + vec)
    M, W, H, D = 150, 12, 300, 64
    nnz = rng.integers(0, W + 1, M).astype(np.int32)
    nnz[[0, 7, M - 1]] = 0
    nnz[3] = W
    idx = np.full((M, W), -1, np.int32)
    gval = np.zeros((M, W), np.float32)
    for r in range(M):
        idx[r, :nnz[r]] = np.sort(rng.choice(H, nnz[r], replace=False))
        gval[r, :nnz[r]] = rng.random(nnz[r]) + 0.1
    gval = gval.astype(dtype)
    x = rng.standard_normal((M, D)).astype(dtype)
    w_up, w_downT = ((rng.standard_normal((H, D)) / 8).astype(dtype) for _ in range(2))
    sfx = "bf16" if dtype == bfloat16 else "f32"

    def run(split):
        uval = np.full((M, W), np.nan, np.float32).astype(dtype)
        y = np.full((M, D), np.nan, np.float32).astype(dtype)
        habs = np.full(M, np.nan, np.float32)
        getattr(fwd_lib, f"fwd_{sfx}")(int(gated), int(not split), _ptr(x), _ptr(w_up), _ptr(w_downT), _ptr(idx),
                                      _ptr(nnz), _ptr(gval), _ptr(uval), _ptr(y), _ptr(habs), ctypes.c_longlong(M),
                                      W, D, vec)
        if split:
            assert np.isnan(y.astype(np.float32)).all(), "the split kernel must leave y alone"
            plan = resident_layout(M, H, D, np.dtype(dtype).itemsize, 5, 64 * 1024, _BWD_DEFINES["RES_THREADS"],
                                   _BWD_DEFINES["RES_STAGE"], 16)
            lpr, smem, n_slices, n_chunks, rows = plan
            getattr(fwd_lib, f"res_y_{sfx}_{lpr}")(int(gated), _ptr(nnz), W, _ptr(idx), _ptr(gval), _ptr(uval),
                                                  _ptr(w_downT), _ptr(y), M, H, D, rows, n_slices, n_chunks,
                                                  ctypes.c_longlong(smem))
        return uval, habs, y

    fused, split = run(False), run(True)
    bits = np.uint16 if dtype == bfloat16 else np.uint32
    if gated:
        np.testing.assert_array_equal(split[0].view(bits), fused[0].view(bits), err_msg="u")
    np.testing.assert_array_equal(split[1].view(np.uint32), fused[1].view(np.uint32), err_msg="|h| sums")
    np.testing.assert_array_equal(split[2].view(bits), fused[2].view(bits), err_msg="y")
    y = split[2].astype(np.float64)
    assert not np.isnan(y).any() and not y[[0, 7, M - 1]].any()


# The row-keeping loops of the ELL forward and backward (vec = 2: the x / dy row read once
# into registers or shared memory, TW_SLOT_BATCH dot products gathered together, the y / dx
# slot metadata broadcast by shuffles) against the vec = 1 loops: the same bits. Variants:
# the defaults (the row in shared memory, one slot at a time), the row in shared memory
# with an odd slot batch (3, so batches end part-full), and the row in registers with
# batches of 2, and the loops compiled out (TW_ROW_LOOPS=0, what the launcher compiles
# when they are off: a vec = 2 launch then runs the vec = 1 loops).
ROW_VARIANTS = [{}, {"TW_XSRC_SMEM": 1, "TW_SLOT_BATCH": 3}, {"TW_XSRC_SMEM": 0, "TW_SLOT_BATCH": 2},
                {"TW_ROW_LOOPS": 0, "TW_XSRC_SMEM": 0}]


@pytest.fixture(scope="module", params=ROW_VARIANTS, ids=["default", "smem-b3", "regs-b2", "loops-off"])
def row_libs(request, tmp_path_factory):
    res = _emulation_source("spmm_resident.cu").replace('#include "common.cuh"', "")
    defines = {**_BWD_DEFINES, **request.param}
    return (_build(tmp_path_factory, "train_ffn.cu", _FWD_HARNESS.replace('#include "resident_source.cuh"', res),
                   defines),
            _build(tmp_path_factory, "train_ffn.cu", _BWD_HARNESS.replace('#include "resident_source.cuh"', res),
                   defines))


@pytest.mark.parametrize("dtype, D", [(bfloat16, 2048), (bfloat16, 200), (bfloat16, 64), (np.dtype(np.float32), 1024),
                                      (np.dtype(np.float32), 36)], ids=lambda v: str(v))
@pytest.mark.parametrize("gated", [True, False])
def test_training_row_loops_give_the_vector_loop_bits(row_libs, dtype, D, gated):
    """vec = 2 and vec = 1, in one pass or two (the second by twellpy_train_ell_y / _ell_dx),
    write the same u, |h| sums, y, du, dg and dx bits, on rows of
    0 to W slots with W past 32 (the shuffled metadata comes 32 slots at a time), D from
    one partial vector round (lanes without columns) to the whole TW_XREG vectors a lane."""
    from twellpy.backends import cuda_train

    fwd_lib, bwd_lib = row_libs
    assert D <= 32 * (16 // np.dtype(dtype).itemsize) * cuda_train.ROW_XREG
    rng = np.random.default_rng(D + 7 * gated)
    M, W, H = 20, 40, 96
    nnz = rng.integers(0, W + 1, M).astype(np.int32)
    nnz[[0, M - 1]] = 0
    nnz[[1, 5]] = W
    nnz[2] = 33
    idx = np.full((M, W), -1, np.int32)
    gval = np.zeros((M, W), np.float32)
    for r in range(M):
        idx[r, :nnz[r]] = np.sort(rng.choice(H, nnz[r], replace=False))
        gval[r, :nnz[r]] = rng.random(nnz[r]) + 0.1
    gval = gval.astype(dtype)
    x, dy = (rng.standard_normal((M, D)).astype(dtype) for _ in range(2))
    w_up, w_downT, w_gate = ((rng.standard_normal((H, D)) / 8).astype(dtype) for _ in range(3))
    sfx = "bf16" if dtype == bfloat16 else "f32"
    bits = np.uint16 if dtype == bfloat16 else np.uint32

    def run(vec, two_pass=False):
        uval = np.full((M, W), np.nan, np.float32).astype(dtype)
        y = np.full((M, D), np.nan, np.float32).astype(dtype)
        habs = np.full(M, np.nan, np.float32)
        getattr(fwd_lib, f"fwd_{sfx}")(int(gated), int(not two_pass), _ptr(x), _ptr(w_up), _ptr(w_downT), _ptr(idx),
                                      _ptr(nnz), _ptr(gval), _ptr(uval), _ptr(y), _ptr(habs), ctypes.c_longlong(M),
                                      W, D, vec)
        u_in = uval if gated else gval
        if two_pass:
            assert np.isnan(y.astype(np.float32)).all(), "the first pass leaves y alone"
            getattr(fwd_lib, f"ell_y_{sfx}")(int(gated), _ptr(w_downT), _ptr(idx), _ptr(nnz), _ptr(gval), _ptr(u_in),
                                            _ptr(y), ctypes.c_longlong(M), W, D, vec)
        da, db = (np.full((M, W), np.nan, np.float32).astype(dtype) for _ in range(2))
        dx = np.full((M, D), np.nan, np.float32).astype(dtype)
        getattr(bwd_lib, f"bwd_{sfx}")(int(gated), int(not two_pass), _ptr(dy), _ptr(w_downT), _ptr(w_up),
                                      _ptr(w_gate), _ptr(idx), _ptr(nnz), _ptr(gval), _ptr(u_in), _ptr(da), _ptr(db),
                                      _ptr(dx), ctypes.c_longlong(M), W, D, ctypes.c_double(0.01), vec)
        if two_pass:
            assert np.isnan(dx.astype(np.float32)).all(), "the first pass leaves dx alone"
            getattr(bwd_lib, f"ell_dx_{sfx}")(int(gated), _ptr(w_up), _ptr(w_gate), _ptr(idx), _ptr(nnz), _ptr(da),
                                             _ptr(db), _ptr(dx), ctypes.c_longlong(M), W, D, vec, None)
        return {"u": uval, "|h|": habs, "y": y, "du": da, "dg": db, "dx": dx}

    old = run(1)
    for label, new in (("vec 2", run(2)), ("two-pass vec 2", run(2, True)), ("two-pass vec 1", run(1, True))):
        for name in new:
            if name in ("u", "dg") and not gated:
                continue
            view = np.uint32 if name == "|h|" else bits
            np.testing.assert_array_equal(new[name].view(view), old[name].view(view), err_msg=f"{label}: {name}")
    for name in ("y", "dx"):
        assert not np.isnan(new[name].astype(np.float32)).any(), name
        assert not new[name][[0, M - 1]].astype(np.float32).any(), name + ": backup rows stay 0"
    # ell_dx with a skip map (the by-neuron backward's row map): rows with skip >= 0 keep
    # what the backup rows' step wrote; the others get the same bits as without it, with
    # vector or scalar loads (its launcher decides vec from its own arrays' alignment)
    skip = np.full(M, -1, np.int32)
    skip[[3, 7, M - 1]] = [0, 1, 2]
    for vec in (2, 1, 0):
        dx_s = np.full((M, D), 7.0, np.float32).astype(dtype)
        getattr(bwd_lib, f"ell_dx_{sfx}")(int(gated), _ptr(w_up), _ptr(w_gate), _ptr(idx), _ptr(nnz),
                                         _ptr(new["du"]), _ptr(new["dg"]), _ptr(dx_s), ctypes.c_longlong(M), W, D,
                                         vec, _ptr(skip))
        assert (dx_s[skip >= 0].astype(np.float32) == 7.0).all(), "skipped rows are left alone"
        np.testing.assert_array_equal(dx_s[skip < 0].view(bits), new["dx"][skip < 0].view(bits))
    # and y is the product it claims to be (h = g * u rounded to the storage type)
    g64 = gval.astype(np.float64)
    h = (g64 * new["u"].astype(np.float64)).astype(dtype).astype(np.float64) if gated else g64
    want = np.zeros((M, D))
    for r in range(M):
        for s_ in range(nnz[r]):
            want[r] += h[r, s_] * w_downT[idx[r, s_]].astype(np.float64)
    tol = 1e-5 if dtype == np.float32 else 1e-2
    assert np.linalg.norm(new["y"].astype(np.float64) - want) <= tol * np.linalg.norm(want)


# ---------------------------------------------------------------------------
# construct.cu: the one-pass dense -> TwELL build, every loop variant
# ---------------------------------------------------------------------------
_CONSTRUCT_HARNESS = r"""
#include "emu.h"
#include "kernel_source.cuh"

extern "C" {
#define TO_TWELL(NAME, T, VEC)                                                                        \
void NAME(const T* x, T* values, int* indices, int* counts, int* row_max, int* flag, int M, int N,    \
          int tile, int slots, int n_tiles, int tpw, int n_groups) {                                  \
    const long long warps = (long long)M * n_groups;                                                  \
    emu::launch(twellpy_dense_to_twell<T, VEC>, dim3((unsigned)((warps + CONSTRUCT_WARPS - 1) / CONSTRUCT_WARPS)), \
                dim3(32 * CONSTRUCT_WARPS), 0, x, values, indices, counts, row_max, flag, M, N, tile, slots, \
                n_tiles, tpw, n_groups);                                                              \
}
TO_TWELL(to_twell_f32_1, float, 1)
TO_TWELL(to_twell_f32_4, float, 4)
TO_TWELL(to_twell_bf16_1, __nv_bfloat16, 1)
TO_TWELL(to_twell_bf16_8, __nv_bfloat16, 8)
TO_TWELL(to_twell_f16_8, __half, 8)
}
"""

# (loads in flight per lane, prefetch the next group, two-ballot prefix, cp.async
# ring depth): the default (2, 0, 1, 4) and the variants benchmarks/kernels.py sweeps
# on the device (the ring serves the 16-byte vector cases; scalar ones take the loop)
CONSTRUCT_VARIANTS = [(2, 0, 1, 4), (2, 0, 0, 0), (2, 1, 1, 0), (3, 1, 0, 0), (1, 0, 1, 0), (4, 1, 1, 0),
                      (2, 0, 1, 2), (2, 0, 0, 3), (2, 0, 1, 8)]


@pytest.fixture(scope="module", params=CONSTRUCT_VARIANTS, ids=lambda v: "u{}p{}f{}a{}".format(*v))
def construct_lib(request, tmp_path_factory):
    unroll, prefetch, fast, depth = request.param
    return _build(tmp_path_factory, "construct.cu", _CONSTRUCT_HARNESS,
                  {"CONSTRUCT_WARPS": 2, "CONSTRUCT_UNROLL": unroll, "CONSTRUCT_PREFETCH": prefetch,
                   "CONSTRUCT_FAST_PREFIX": fast, "CONSTRUCT_ASYNC_DEPTH": depth})


def _emulated_twell(lib, x, tile, slots, tpw, vec):
    m, n = x.shape
    n_tiles = -(-n // tile)
    n_groups = -(-n_tiles // tpw)
    values = np.full((m, n_tiles, slots), np.nan, np.float32).astype(x.dtype)   # poisoned
    indices = np.full((m, n_tiles, slots), -0x5A5A5A5A, np.int32)
    counts = np.full((m, n_tiles), -9, np.int32)
    row_max = np.zeros(m, np.int32) if n_groups > 1 else np.full(m, -9, np.int32)
    flag = np.zeros(1, np.int32)
    name = {np.dtype(np.float32): "f32", bfloat16: "bf16", np.dtype(np.float16): "f16"}[np.dtype(x.dtype)]
    fn = getattr(lib, f"to_twell_{name}_{vec}")
    fn(_ptr(x), _ptr(values), _ptr(indices), _ptr(counts), _ptr(row_max), _ptr(flag),
       m, n, tile, slots, n_tiles, tpw, n_groups)
    return values, indices, counts, row_max, bool(flag[0] == 0)


def _construct_input(rng, dtype, m, n):
    x = random_sparse(rng, m, n, 12).astype(dtype)
    if m > 3:
        x[1] = 0                                   # an empty row
        x[2] = rng.standard_normal(n).astype(dtype)  # a full row: every tile over capacity
        x[2, ::7] = 0
        x[3, : min(n, 70)] = 1.5                   # one crowded tile, neighbours in one lane's vector
        x[0, 0] = -0.0                             # negative zero is zero
    return np.ascontiguousarray(x)


_TO_TWELL_TYPES = [(np.dtype(np.float32), 1), (np.dtype(np.float32), 4), (bfloat16, 1), (bfloat16, 8),
                   (np.dtype(np.float16), 8)]
_TO_TWELL_SHAPES = [
    (9, 1000, 256, 8, 32),     # N not a multiple of the tile, one warp per row
    (7, 1024, 64, 4, 3),       # rows split over warps (row_max by atomicMax)
    (5, 600, 512, 16, 1),      # several chunks per tile
    (1, 264, 8, 2, 5),         # M = 1, tiles narrower than a chunk
    (4, 1001, 256, 8, 32),     # N odd: the scalar path only
]


# the launcher takes the vector path only when tile and N are multiples of VEC
@pytest.mark.parametrize("dtype,vec,m,n,tile,slots,tpw", [
    pytest.param(dt, vec, *shape, id=f"{dt}-{vec}-{'-'.join(map(str, shape))}")
    for dt, vec in _TO_TWELL_TYPES for shape in _TO_TWELL_SHAPES
    if vec == 1 or (shape[2] % vec == 0 and shape[1] % vec == 0)])
def test_dense_to_twell_every_variant_matches_numpy(construct_lib, dtype, vec, m, n, tile, slots, tpw):
    rng = np.random.default_rng(m * 1000 + n + tile)
    x = _construct_input(rng, dtype, m, n)
    *got, finite = _emulated_twell(construct_lib, x, tile, slots, tpw, vec)
    want = cpu.dense_to_twell(x, tile, slots)
    for g, w, name in zip(got, want, ("values", "indices", "counts", "row_max")):
        assert g.shape == w.shape, name
        assert np.array_equal(_bits(g), _bits(np.asarray(w))), name
    assert finite


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_dense_to_twell_flags_nonfinite_in_every_variant(construct_lib, bad):
    rng = np.random.default_rng(5)
    x = _construct_input(rng, bfloat16, 6, 768)
    x[4, 700] = bad                                # past the row's first unroll group
    *got, finite = _emulated_twell(construct_lib, x, 256, 8, 32, 8)
    assert not finite
    want = cpu.dense_to_twell(x, 256, 8)
    for g, w, name in zip(got, want, ("values", "indices", "counts", "row_max")):
        assert np.array_equal(_bits(g), _bits(np.asarray(w))), name


@pytest.mark.parametrize("threads", [32, 96])
@pytest.mark.parametrize("M,W,kind", [(1, 3, "random"), (95, 30, "random"), (96, 30, "random"), (97, 30, "random"),
                                      (500, 30, "random"), (2000, 30, "random"), (300, 1000, "none wide"),
                                      (200, 0, "all wide")])
@pytest.mark.parametrize("room", ["exact", "more", "fewer"])
def test_row_maps_kernel_matches_numpy_twin(train_lib, threads, M, W, kind, room):
    """Rounds of blockDim rows with a carry: counts straddling rounds, a
    partial last round, no wide row and every row wide. With room for more
    backup rows than are wide (the speculative forward's capacity) the unused
    slots are -1 (one of them past a round's 32 x 96 rows: the tail loop
    strides); with room for fewer, the wide rows past it map to -1."""
    from twellpy.backends import cpu_train

    rng = np.random.default_rng(M + W + threads)
    counts = rng.poisson(30, M).astype(np.int32)
    counts[rng.random(M) < 0.05] = 500                      # heavy tokens
    wide = int(np.count_nonzero(counts > W))
    R = {"exact": wide, "more": wide + 3 * threads + 5, "fewer": wide // 2}[room]
    want = cpu_train.row_maps(counts, W, R, capacity=room != "exact")
    maps = np.full(M + R + 3, -0x3C3C3C3C, np.int32)        # poisoned; 3 guard words past the end
    train_lib.row_maps(_ptr(counts), _ptr(maps), M, W, R, threads)
    np.testing.assert_array_equal(maps[:M + R], want)
    assert (maps[M + R:] == -0x3C3C3C3C).all()
    assert (maps[M + min(R, wide):M + R] == -1).all()
    if room == "fewer":
        assert int((maps[:M] >= 0).sum()) == R
    if kind == "none wide":
        assert wide == 0
    if kind == "all wide":
        assert wide == M


@pytest.mark.parametrize("chunk", [1, 95, 96, 700])
@pytest.mark.parametrize("room", ["exact", "more", "fewer"])
def test_row_maps_kernel_in_row_chunks_gives_one_launchs_maps(train_lib, chunk, room):
    """Launches over consecutive row chunks with a running count (the forward that packs
    its gate output a chunk at a time) give the maps of one launch over every row;
    the running count ends at the number of wide rows."""
    from twellpy.backends import cpu_train

    # one-row chunks launch once a row: fewer rows keep the emulation quick (36 s at 2000)
    M, W, threads = 240 if chunk == 1 else 2000, 30, 96
    rng = np.random.default_rng(chunk)
    counts = rng.poisson(30, M).astype(np.int32)
    counts[rng.random(M) < 0.05] = 500
    wide = int(np.count_nonzero(counts > W))
    R = {"exact": wide, "more": wide + 40, "fewer": wide // 2}[room]
    want = cpu_train.row_maps(counts, W, R, capacity=room != "exact")
    maps = np.full(M + R + 3, -0x3C3C3C3C, np.int32)
    running = np.zeros(1, np.int32)
    for a in range(0, M, chunk):
        b = min(M, a + chunk)
        train_lib.row_maps_rows(_ptr(counts), _ptr(maps), M, W, R, ctypes.c_longlong(a), ctypes.c_longlong(b - a),
                                _ptr(running), int(b == M), threads)
    np.testing.assert_array_equal(maps[:M + R], want)
    assert (maps[M + R:] == -0x3C3C3C3C).all()
    assert int(running[0]) == wide


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), bfloat16], ids=str)
@pytest.mark.parametrize("M,H,W", [(13, 1000, 6), (5, 2048, 40), (1, 264, 3), (9, 999, 5)])
def test_relu_to_hybrid_matches_numpy_twin(train_lib, dtype, M, H, W):
    """The gate output straight into a Hybrid: ELL rows (vector loads in groups,
    or scalar when H is not a multiple of the vector), backup rows whole, and
    per-neuron counts, equal to cpu_train.relu_to_hybrid bit for bit."""
    from twellpy.backends import cpu_train

    rng = np.random.default_rng(M * H + W)
    z = (rng.standard_normal((M, H)) - 2.2).astype(np.float32)   # about 1% positive
    z[0, :3] = [np.nan, -0.0, 1e-40]                              # NaN and a denormal count, -0.0 not
    if M > 2:
        z[2] = np.abs(z[2]) + 0.5                                 # a row that fires everything
    z = z.astype(dtype)
    counts = cpu_train.relu_count(z)
    R = int(np.count_nonzero(counts > W))
    row_map = cpu_train.row_maps(counts, W, R)[:M]
    want = cpu_train.relu_to_hybrid(z, row_map, W, R)
    vec = int(H % (16 // z.dtype.itemsize) == 0)
    vals = np.full(M * W + R * H, np.nan, np.float32).astype(dtype)   # poisoned
    ell_idx = np.full((M, W), -0x5A5A5A5A, np.int32)
    ell_nnz = np.full(M, -9, np.int32)
    neuron_counts = np.zeros(H, np.int32)
    ell_val, backup = cpu_train.split_combined(vals, M, W, R, H)
    vec_store = int(vec and (M * W * z.dtype.itemsize) % 16 == 0)
    getattr(train_lib, f"relu_to_hybrid_{_suffix(dtype)}")(
        _ptr(z), M, H, vec, vec_store, _ptr(row_map), W, _ptr(ell_val), _ptr(ell_idx), _ptr(ell_nnz),
        _ptr(backup), _ptr(neuron_counts))
    for got, w, name in zip((vals, ell_idx, ell_nnz, neuron_counts), want, ("vals", "ell_idx", "ell_nnz", "neuron_counts")):
        np.testing.assert_array_equal(_bits(got) if got.dtype.kind == "f" or got.dtype == bfloat16 else got,
                                      _bits(w) if w.dtype.kind == "f" or w.dtype == bfloat16 else w, err_msg=name)


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), bfloat16], ids=str)
@pytest.mark.parametrize("room", ["more", "fewer"])
@pytest.mark.parametrize("H", [512, 301])
def test_relu_to_hybrid_with_a_speculative_capacity(train_lib, dtype, room, H):
    """The speculative forward sizes the backup part before it has the counts.
    Room for more rows than are wide: the routed rows are the exact layout's
    bits and the rest of the capacity is not written. Room for fewer: the wide
    rows past it (row_map -1) keep their first W entries in the ELL part, in
    bounds (the forward then sees the overflow in the counts and runs again).
    H = 301: the scalar (ballot) loop, H = 512: the vector loop."""
    from twellpy.backends import cpu_train

    M, W = 40, 4
    rng = np.random.default_rng(7 if room == "more" else 8)
    z = (rng.standard_normal((M, H)) - 2.2).astype(np.float32)    # about 1% positive: 5 a row
    z[::3] = np.abs(z[::3]) - 1.0                                  # every third row about 16% positive
    z = z.astype(dtype)
    counts = cpu_train.relu_count(z)
    wide = int(np.count_nonzero(counts > W))
    cap = wide + 5 if room == "more" else wide // 2
    row_map = cpu_train.row_maps(counts, W, cap, capacity=True)[:M]
    want = cpu_train.relu_to_hybrid(z, row_map, W, cap)
    guard = 64
    vals = np.full(M * W + cap * H + guard, np.nan, np.float32).astype(dtype)   # poisoned, guard words past the end
    ell_idx = np.full(M * W + guard, -0x5A5A5A5A, np.int32)
    ell_nnz = np.full(M + guard, -9, np.int32)
    neuron_counts = np.zeros(H, np.int32)
    ell_val, backup = cpu_train.split_combined(vals, M, W, cap, H)
    vec = int(H % (16 // z.dtype.itemsize) == 0)
    getattr(train_lib, f"relu_to_hybrid_{_suffix(dtype)}")(
        _ptr(z), M, H, vec, 0, _ptr(row_map), W, _ptr(ell_val), _ptr(ell_idx), _ptr(ell_nnz),
        _ptr(backup), _ptr(neuron_counts))
    routed = min(wide, cap)
    n = M * W + routed * H
    np.testing.assert_array_equal(_bits(vals[:n]), _bits(want[0][:n]))
    assert np.isnan(vals[n:].astype(np.float32)).all(), "nothing past the routed rows is written"
    np.testing.assert_array_equal(ell_idx[:M * W].reshape(M, W), want[1])
    np.testing.assert_array_equal(ell_nnz[:M], want[2])
    assert (ell_idx[M * W:] == -0x5A5A5A5A).all() and (ell_nnz[M:] == -9).all()
    # the kernel counts every active entry as it reads z (the CPU twin counts what it
    # stored: the same numbers unless a row overflowed, whose result is discarded)
    zf = z.astype(np.float32)
    np.testing.assert_array_equal(neuron_counts, ((zf > 0) | np.isnan(zf)).sum(axis=0))
    if room == "more":
        np.testing.assert_array_equal(neuron_counts, want[3])
    if room == "fewer":
        over = np.flatnonzero((counts > W) & (row_map < 0))
        assert over.size == wide - cap > 0
        for r in over:   # the first W active columns, in order
            np.testing.assert_array_equal(ell_idx[r * W:(r + 1) * W], np.flatnonzero(z[r].astype(np.float32) > 0)[:W])
        assert (ell_nnz[over] == W).all()


# ---------------------------------------------------------------------------
# the emulation itself: a full-mask warp operation after a lane has returned
# (undefined on a GPU) must stop the run, not pass quietly
# ---------------------------------------------------------------------------
_DIVERGENT_HARNESS = r"""
#include "emu.h"
#include "kernel_source.cuh"

__global__ void lanes_leave_then_shuffle(int* out) {
    if (threadIdx.x % 32 >= 16) return;              // half of each warp leaves
    for (int i = 0; i < 1000000 && emu::warp().gone.load() < 16; ++i) std::this_thread::yield();
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 1);
}
__global__ void all_lanes_shuffle(int* out) {
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 1);
}
extern "C" {
void divergent(int* out) { emu::launch(lanes_leave_then_shuffle, dim3(1), dim3(32), 0, out); }
void converged(int* out) { emu::launch(all_lanes_shuffle, dim3(1), dim3(32), 0, out); }
}
"""


@pytest.mark.parametrize("entry,ok", [("converged", True), ("divergent", False)])
def test_emulation_stops_a_full_mask_shuffle_after_lanes_returned(tmp_path_factory, entry, ok):
    import sys

    lib = _build(tmp_path_factory, "check.cu", _DIVERGENT_HARNESS, {})
    code = ("import ctypes, numpy as np, sys; lib = ctypes.CDLL(sys.argv[1]); out = np.zeros(32, np.int32); "
            f"lib.{entry}(ctypes.c_void_p(out.ctypes.data)); "
            "assert (out == (np.arange(32) ^ 1)).all(), out")
    r = subprocess.run([sys.executable, "-c", code, lib._name], capture_output=True, text=True, timeout=120)
    if ok:
        assert r.returncode == 0, r.stderr[-2000:]
    else:
        assert r.returncode != 0
        assert "__shfl_xor_sync with a full mask" in r.stderr and "a lane has returned" in r.stderr, r.stderr[-2000:]


# ---------------------------------------------------------------------------
# spmm.cu: twellpy_twell_spmm_rows, the row-block kernel behind TwELL @ W
# (a block-wide prefix of the tile counts lists each row's entries in shared
# memory, in rounds when a row holds more than the list)
# ---------------------------------------------------------------------------
_SPMM_ROWS_HARNESS = r"""
#include "emu.h"
#include "kernel_source.cuh"

extern "C" {
#define ROWS(NAME, T, VEC, NV, KB)                                                                    \
void NAME(const T* v, const int* i, const int* c, const T* B, T* out, int M, int n_tiles, int slots,  \
          int N, int K, int gx, int gy) {                                                             \
    emu::launch(twellpy_twell_spmm_rows<T, VEC, NV, KB>, dim3(gx, gy), dim3(SPMM_ROWS_THREADS), 0,     \
                v, i, c, B, out, M, n_tiles, slots, N, K);                                            \
}
ROWS(rows_f32_1, float, 1, 2, 2)
ROWS(rows_f32_4, float, 4, 1, 4)
ROWS(rows_bf16_8, __nv_bfloat16, 8, 2, 2)
ROWS(rows_bf16_1, __nv_bfloat16, 1, 1, 3)
}
"""


@pytest.fixture(scope="module")
def rows_lib(tmp_path_factory):
    # 64 threads (two warps in the block prefix) and a 64-entry list: long rows run in rounds
    return _build(tmp_path_factory, "spmm.cu", _SPMM_ROWS_HARNESS,
                  {"SPMM_ROWS_THREADS": 64, "SPMM_ROWS_LIST": 64, "SPMM_ROWS_MIN_BLOCKS": 1})


@pytest.mark.parametrize("name,dtype,vec,nv", [("rows_f32_1", np.dtype(np.float32), 1, 2),
                                               ("rows_f32_4", np.dtype(np.float32), 4, 1),
                                               ("rows_bf16_8", bfloat16, 8, 2),
                                               ("rows_bf16_1", bfloat16, 1, 1)])
@pytest.mark.parametrize("k_cols", [8, 136, 1032])
def test_twell_spmm_rows_matches_sequential_fma(rows_lib, name, dtype, vec, nv, k_cols):
    """Rows of more entries than the list (rounds), more tiles than threads,
    empty rows, out-of-range and padding indices skipped, counts clamped, K not
    a multiple of a block's columns: the kernel's bits are an fp32 fma over
    the entries in (tile, slot) order."""
    rng = np.random.default_rng(k_cols + vec)
    m, n, tile, slots = 23, 5000, 64, 8                    # 79 tiles: more than the 64 threads
    x = random_sparse(rng, m, n, 20)
    x[2] = np.where(rng.random(n) < 0.1, rng.standard_normal(n), 0)   # ~500 entries, capped per tile
    x[[0, m - 1]] = 0.0
    x = x.astype(dtype)
    vals, idx, counts, _ = cpu.dense_to_twell(x, tile, slots)
    vals, idx, counts = (np.ascontiguousarray(a) for a in (vals, idx, counts))
    idx[5, 3, 0] = n + 7                                   # out of range: skipped (listed as -1)
    counts[6, 1] = slots + 5                               # clamped to the slots
    counts[7, 2] = -3                                      # clamped to 0
    b = (rng.standard_normal((n, k_cols)) / 4).astype(dtype)
    cbw = 64 * vec * nv
    gy = -(-k_cols // cbw)
    out = np.full((m, k_cols), np.nan, np.float32).astype(dtype)   # poisoned
    getattr(rows_lib, name)(_ptr(vals), _ptr(idx), _ptr(counts), _ptr(b), _ptr(out), m, counts.shape[1],
                            slots, n, k_cols, 5, gy)       # 5 row blocks: rows r, r + 5, ...
    want = np.zeros((m, k_cols), np.float64)
    bf = b.astype(np.float32).astype(np.float64)
    for r in range(m):
        acc = np.zeros(k_cols, np.float32)
        for t in range(counts.shape[1]):
            for s in range(min(max(int(counts[r, t]), 0), slots)):
                j = int(idx[r, t, s])
                if 0 <= j < n:
                    acc = (np.float64(np.float32(vals[r, t, s])) * bf[j] + acc).astype(np.float32)
        want[r] = acc
    got = out.astype(np.float64)
    assert not np.isnan(got).any(), "an output element was never written"
    if dtype == np.float32:
        assert np.array_equal(got, want)                   # float64 product + add, rounded: the fma here
    else:
        assert np.array_equal(got, want.astype(np.float32).astype(dtype).astype(np.float64))


# ---------------------------------------------------------------------------
# check.cu: twellpy_count_nonfinite, the NaN/Inf count of every checked call
# ---------------------------------------------------------------------------
_CHECK_HARNESS = r"""
#include "emu.h"
#include "kernel_source.cuh"

extern "C" {
#define COUNT(NAME, U)                                                                                \
void NAME(const U* data, long long n, unsigned long long exp_mask, int aligned, unsigned long long* count, \
          int grid) {                                                                                 \
    emu::launch(twellpy_count_nonfinite<U>, dim3(grid), dim3(CHECK_BLOCK), 0, data, n, exp_mask, aligned, count); \
}
COUNT(count_u16, unsigned short)
COUNT(count_u32, unsigned int)
COUNT(count_u64, unsigned long long)
void ledger(const unsigned long long* count, unsigned long long* seq, unsigned long long* ring, int ring_size) {
    emu::launch(twellpy_nonfinite_ledger, dim3(1), dim3(32), 0, count, seq, ring, ring_size);
}
}
"""


@pytest.fixture(scope="module")
def check_lib(tmp_path_factory):
    return _build(tmp_path_factory, "check.cu", _CHECK_HARNESS, {"CHECK_BLOCK": 64})


@pytest.mark.parametrize("dtype", [bfloat16, np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)],
                         ids=str)
@pytest.mark.parametrize("n,offset", [(1000, 0), (1001, 1), (7, 0), (0, 0), (4099, 3)])
def test_count_nonfinite_counts_every_nan_and_inf(check_lib, dtype, n, offset):
    """Vector bulk plus scalar tail, aligned and misaligned starts, any grid:
    the count equals numpy's, for NaN payloads, +-Inf, and finite extremes."""
    lib = check_lib
    rng = np.random.default_rng(n + offset)
    base = rng.standard_normal(n + offset + 8).astype(np.float32).astype(dtype)
    x = base[offset:offset + n]
    if n:
        spots = rng.choice(n, size=min(n, 9), replace=False)
        fill = np.array([np.nan, np.inf, -np.inf, -np.nan, np.nan, np.inf, 1e4, -1e4, 0.0], np.float64)
        x[spots] = fill[:spots.size].astype(dtype)
        x[0] = np.finfo(np.float16).max if dtype == np.float16 else x[0]   # largest finite: not counted
    width = np.dtype(dtype).itemsize
    utype = {2: np.uint16, 4: np.uint32, 8: np.uint64}[width]
    exp_mask = {2: 0x7C00 if dtype == np.float16 else 0x7F80, 4: 0x7F800000, 8: 0x7FF0000000000000}[width]
    bits = x.view(utype)
    aligned = int(bits.ctypes.data % 16 == 0)
    want = int(np.count_nonzero(~np.isfinite(x.astype(np.float64))))
    for grid in (1, 3):
        count = np.zeros(1, np.uint64)
        getattr(lib, f"count_u{8 * width}")(_ptr(bits), ctypes.c_longlong(n), ctypes.c_ulonglong(exp_mask),
                                            aligned, _ptr(count), grid)
        assert int(count[0]) == want, (grid, aligned)


def test_nonfinite_ledger_stamps_each_call_into_its_ring_slot(check_lib):
    """Each launch stores (seq mod 2**24) << 40 | min(count, 2**40 - 1) into slot
    seq % R and advances seq: the host's NonfiniteLedger decodes exactly this."""
    from twellpy.backends.cuda import NonfiniteLedger

    R = 5
    ring = np.full(R, np.uint64(2**64 - 1))
    seq = np.zeros(1, np.uint64)
    counts = [0, 3, 2**41, 0, 7, 1, 0]  # 2**41 saturates; call 5 overwrites slot 0
    for call, n in enumerate(counts):
        count = np.array([n], np.uint64)
        check_lib.ledger(_ptr(count), _ptr(seq), _ptr(ring), R)
        assert int(seq[0]) == call + 1
        word = int(ring[call % R])
        assert word >> NonfiniteLedger._COUNT_BITS == call
        assert word & ((1 << NonfiniteLedger._COUNT_BITS) - 1) == min(n, 2**40 - 1)
    assert int(ring[2]) >> 40 == 2 and int(ring[4]) >> 40 == 4  # untouched since
    seq[0] = 2**24 + 3  # the stamp wraps with the sequence number
    check_lib.ledger(_ptr(np.array([9], np.uint64)), _ptr(seq), _ptr(ring), R)
    assert int(ring[(2**24 + 3) % R]) == (3 << 40) | 9


# ---------------------------------------------------------------------------
# transpose.cu: the deterministic counting-sort transpose behind A.T on the GPU
# (column histograms per row chunk, the cursor scan, the in-order fill)
# ---------------------------------------------------------------------------
_TRANSPOSE_HARNESS = r"""
#include "emu.h"
#include "kernel_source.cuh"

extern "C" {
void tr_count(const int* idx, int* chunk_counts, long long M, int K, int n_cols, int chunk_rows, int grid) {
    emu::launch(twellpy_transpose_count, dim3(grid), dim3(TRANSPOSE_BLOCK), 0, idx, chunk_counts, M, K, n_cols,
                chunk_rows);
}
void tr_scan(const int* counts, const int* indptr, int nb, int N, int* cursor) {
    emu::launch(twellpy_transpose_scan<4>, dim3((N + 31) / 32), dim3(32 * 4), 0, counts, indptr, nb, N, cursor);
}
void tr_fill_f32(const float* v, const int* idx, int* cursor, int* out_col, float* out_data, int M, int K,
                 int n_cols, int chunk_rows, int n_chunks) {
    emu::launch(twellpy_transpose_fill<float>, dim3(n_chunks), dim3(TRANSPOSE_BLOCK), 0, v, idx, cursor, out_col,
                out_data, M, K, n_cols, chunk_rows);
}
void tr_fill_bf16(const __nv_bfloat16* v, const int* idx, int* cursor, int* out_col, __nv_bfloat16* out_data,
                  int M, int K, int n_cols, int chunk_rows, int n_chunks) {
    emu::launch(twellpy_transpose_fill<__nv_bfloat16>, dim3(n_chunks), dim3(TRANSPOSE_BLOCK), 0, v, idx, cursor,
                out_col, out_data, M, K, n_cols, chunk_rows);
}
}
"""


@pytest.fixture(scope="module")
def transpose_lib(tmp_path_factory):
    return _build(tmp_path_factory, "transpose.cu", _TRANSPOSE_HARNESS, {"TRANSPOSE_BLOCK": 64})


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), bfloat16], ids=str)
@pytest.mark.parametrize("m,n,chunk_rows", [(40, 300, 7), (9, 50, 9), (1, 5, 1), (70, 3, 16)])
def test_counting_sort_transpose_matches_scipy(transpose_lib, dtype, m, n, chunk_rows):
    """Chunk histograms, the cursor scan over more chunks than scan segments,
    and the in-order fill give scipy's CSR of the transpose: rows ascending
    inside each output row, values bit for bit; padding and out-of-range
    indices skipped."""
    import scipy.sparse as sp

    import twellpy as tw

    lib = transpose_lib
    rng = np.random.default_rng(m * n + chunk_rows)
    x = random_sparse(rng, m, n, 6).astype(dtype)
    if m > 3:
        x[2] = rng.standard_normal(n).astype(dtype)         # a full row
    E = tw.ELL.from_dense(x)
    vals, idx = np.ascontiguousarray(E.values), np.ascontiguousarray(E.indices)
    k = idx.shape[1]
    if m * k:
        idx.reshape(-1)[rng.integers(m * k)] = n + 3        # an out-of-range index is skipped
    n_chunks = -(-m // chunk_rows)
    counts = np.zeros((n_chunks, n), np.int32)
    lib.tr_count(_ptr(idx), _ptr(counts), m, k, n, chunk_rows, 3)
    indptr = np.concatenate([[0], np.cumsum(counts.sum(axis=0))]).astype(np.int32)
    cursor = np.full((n_chunks, n), -7, np.int32)
    lib.tr_scan(_ptr(counts), _ptr(indptr), n_chunks, n, _ptr(cursor))
    nnz = int(indptr[-1])
    out_col = np.full(max(nnz, 1), -9, np.int32)
    out_data = np.full(max(nnz, 1), np.nan, np.float32).astype(dtype)
    fill = lib.tr_fill_f32 if dtype == np.float32 else lib.tr_fill_bf16
    fill(_ptr(vals), _ptr(idx), _ptr(cursor), _ptr(out_col), _ptr(out_data), m, k, n, chunk_rows, n_chunks)
    keep = (idx >= 0) & (idx < n)
    rows = np.repeat(np.arange(m), k).reshape(m, k)[keep]
    ref = sp.csr_array((np.arange(rows.size), (idx[keep], rows)), shape=(n, m))
    ref.sort_indices()
    np.testing.assert_array_equal(indptr, ref.indptr)
    np.testing.assert_array_equal(out_col[:nnz], ref.indices)
    np.testing.assert_array_equal(_bits(out_data[:nnz]), _bits(vals[keep][ref.data]))


# ---------------------------------------------------------------------------
# the decode kernels (ffn_decode.cu): the whole FFN of a few rows in two launches
# ---------------------------------------------------------------------------
_DECODE_HARNESS = r"""
#include "emu.h"
#include "kernel_source.cuh"

typedef __nv_bfloat16 bf16;
#define DECODE_PAIR(T, SUF, G, MR)                                                                          \
void decode_##SUF##_##G##_##MR(const T* x, long long ldx, const T* wg, const T* wu, const T* wdT,         \
                               twellpy::accum<T>::type* h, T* h_out, long long ldh, unsigned short* flags, \
                               int* blk, unsigned long long* counters, int check_x, T* y, int M, int D,     \
                               int H) {                                                                     \
    const int nblk = (H + DECODE_WARPS * DECODE_NPW - 1) / (DECODE_WARPS * DECODE_NPW);                    \
    const int dv = D / (16 / (int)sizeof(T));                                                               \
    const int groups = (M + MR - 1) / MR;                                                                   \
    const int rows = M < MR ? M : MR;                                                                       \
    emu::launch(twellpy_ffn_decode_gate<T, G, MR>, dim3(groups, nblk), dim3(DECODE_THREADS),               \
                (size_t)rows * D * sizeof(T), x, ldx, wg, wu, h, h_out, ldh, flags, blk, counters, check_x, \
                M, D, H);                                                                                   \
    emu::launch(twellpy_ffn_decode_down<T, MR>, dim3((dv + 31) / 32, groups), dim3(DECODE_THREADS), 0, h,  \
                flags, wdT, y, (long long)D, blk, groups * nblk, counters, M, D, H);                      \
}
extern "C" {
DECODE_PAIR(float, f32, true, 1)
DECODE_PAIR(float, f32, false, 1)
DECODE_PAIR(float, f32, true, 2)
DECODE_PAIR(float, f32, true, 4)
DECODE_PAIR(float, f32, false, 8)
DECODE_PAIR(bf16, bf16, true, 1)
DECODE_PAIR(bf16, bf16, true, 8)
DECODE_PAIR(bf16, bf16, false, 4)
DECODE_PAIR(bf16, bf16, true, 16)
DECODE_PAIR(float, f32, false, 16)
}
"""
# two warps a block, so that several gate blocks and several windows of the active
# list (8 row masks a thread: 512 neurons a window) occur at test sizes; the production
# sizes (8 warps, 2 neurons a warp, 2048-neuron windows) are built once too
_DECODE_DEFINES = {"DECODE_WARPS": 2, "DECODE_NPW": 2}


@pytest.fixture(scope="module")
def decode_lib(tmp_path_factory):
    lib = _build(tmp_path_factory, "ffn_decode.cu", _DECODE_HARNESS, _DECODE_DEFINES)
    lib.defines = _DECODE_DEFINES
    return lib


@pytest.fixture(scope="module")
def decode_lib_default(tmp_path_factory):
    from twellpy.backends import cuda_ffn

    lib = _build(tmp_path_factory, "ffn_decode.cu", _DECODE_HARNESS, {})
    lib.defines = {"DECODE_WARPS": cuda_ffn._DECODE_THREADS // 32,
                   "DECODE_NPW": cuda_ffn._DECODE_NEURONS_PER_BLOCK * 32 // cuda_ffn._DECODE_THREADS}
    return lib


def test_decode_launch_constants_match_the_kernel_defaults():
    from twellpy.backends import cuda_ffn

    src = reg.read_source("ffn_decode.cu")
    warps = int(re.search(r"#define DECODE_WARPS (\d+)", src).group(1))
    npw = int(re.search(r"#define DECODE_NPW (\d+)", src).group(1))
    assert cuda_ffn._DECODE_THREADS == 32 * warps
    assert cuda_ffn._DECODE_NEURONS_PER_BLOCK == warps * npw


def _decode_run(lib, x, wg, wu, wd, *, gated, mr, check_x=True, h_out=False):
    """Run the emulated decode pair (row groups of ``mr`` rows when M > mr); returns
    (y, h, flags (groups, Hp), counters, h_out or None)."""
    dt = x.dtype
    M, D = x.shape
    H = wd.shape[1]
    acc = np.float32
    suffix = {np.dtype(np.float32): "f32", bfloat16: "bf16"}[dt]
    fn = getattr(lib, f"decode_{suffix}_{'true' if gated else 'false'}_{mr}")
    wdT = np.ascontiguousarray(wd.T)
    groups = -(-M // mr)
    h = np.full((max(16, groups * mr), H), np.nan, acc)     # poisoned scratch
    flags = np.zeros((groups, -(-H // 8) * 8), np.uint16)   # padding zero, as the plan allocates it
    flags[:, :H] = 0xABCD                                    # poisoned
    per_block = lib.defines["DECODE_WARPS"] * lib.defines["DECODE_NPW"]
    blk = np.full(groups * -(-H // per_block), -5, np.int32)
    counters = np.full(4, 0xDEAD, np.uint64)
    y = np.full((M, D), np.nan, np.float32).astype(dt)
    ho = np.full((M, H), np.nan, np.float32).astype(dt) if h_out else None
    fn(_ptr(x), ctypes.c_longlong(D), _ptr(wg), _ptr(wu), _ptr(wdT), _ptr(h), None if ho is None else _ptr(ho),
       ctypes.c_longlong(H), _ptr(flags), _ptr(blk), _ptr(counters), int(check_x), _ptr(y), M, D, H)
    return y, h, flags, counters, ho


def _decode_reference(x, wg, wu, wd, gated):
    """float64 FFN with the kernel's gate rounding (g to the value dtype); each row sums
    over its active neurons only (an inactive neuron adds nothing, not even 0 * NaN)."""
    x64, wg64, wd64 = x.astype(np.float64), wg.astype(np.float64), wd.astype(np.float64)
    g = (x64 @ wg64.T).astype(np.float32).astype(x.dtype).astype(np.float64)
    act = ~(g <= 0)
    with np.errstate(invalid="ignore"):
        h = np.where(act, g * (x64 @ wu.astype(np.float64).T) if gated else g, 0.0)
        y = np.stack([wd64[:, a] @ h[m, a] for m, a in enumerate(act)])
    return y, h, act


def _row_masks(act):
    return (act.astype(np.int64) << np.arange(act.shape[0])[:, None]).sum(axis=0).astype(np.uint16)


@pytest.mark.parametrize("dtype, gated, mr, M", [
    (np.dtype(np.float32), True, 1, 1), (np.dtype(np.float32), False, 1, 1), (np.dtype(np.float32), True, 4, 3),
    (np.dtype(np.float32), False, 8, 8), (bfloat16, True, 1, 1), (bfloat16, True, 8, 5), (bfloat16, False, 4, 4),
    (np.dtype(np.float32), True, 2, 2), (bfloat16, True, 16, 11),
], ids=["f32-gated-M1", "f32-relu-M1", "f32-gated-M3", "f32-relu-M8", "bf16-gated-M1", "bf16-gated-M5",
        "bf16-relu-M4", "f32-gated-M2", "bf16-gated-M11"])
def test_decode_kernels_match_float64(decode_lib, dtype, gated, mr, M):
    rng = np.random.default_rng(mr * 10 + M)
    D = 320 if dtype == bfloat16 else 160   # 40 vectors: a second, partly idle block of y columns
    H = 1102                                  # 3 windows of 512 neurons; mask padding; a part-filled gate block
    x = (rng.standard_normal((M, D)) / np.sqrt(D)).astype(dtype)
    wg = rng.standard_normal((H, D)).astype(dtype)         # about half the neurons fire in a row
    wu = rng.standard_normal((H, D)).astype(dtype)
    wd = (rng.standard_normal((D, H)) / np.sqrt(H)).astype(dtype)
    x[:, 0] = 1.0
    wg[:, 0] = 0.05                           # column 0 of x biases every neuron alike
    if M >= 3:
        x[1] = 0.0                            # an empty row: g = 0 everywhere, nothing active
        x[2, 0] = 60.0                        # a row firing nearly every neuron
    y, h, flags, counters, ho = _decode_run(decode_lib, x, wg, wu, wd, gated=gated, mr=mr, h_out=True)
    ref, h_ref, act = _decode_reference(x, wg, wu, wd, gated)
    tol = 1e-5 if dtype == np.float32 else 1e-2
    err = np.linalg.norm(y.astype(np.float64) - ref) / np.linalg.norm(ref)
    assert err <= tol, err
    np.testing.assert_allclose(h[:M], h_ref, rtol=tol, atol=tol * np.abs(h_ref).max())
    assert np.array_equal(ho.astype(np.float32), h[:M].astype(dtype).astype(np.float32))  # every entry written
    assert np.array_equal(flags[0, :H], _row_masks(act))
    assert not flags[0, H:].any()
    assert int(counters[0]) == int(act.sum()) and int(counters[1]) == 0 and int(counters[3]) == 0
    if M >= 3:
        assert not y[1].astype(np.float32).any()            # the empty row is exactly zero
        assert act[2].sum() > 0.95 * H
    y2, *_ = _decode_run(decode_lib, x, wg, wu, wd, gated=gated, mr=mr)
    assert np.array_equal(y.view(np.uint8), y2.view(np.uint8))  # same bits every run


def test_decode_kernels_count_and_propagate_nan_and_inf(decode_lib):
    rng = np.random.default_rng(5)
    M, D, H = 3, 320, 136
    x = (rng.standard_normal((M, D)) / 16).astype(bfloat16)
    wg = rng.standard_normal((H, D)).astype(bfloat16)
    wu = rng.standard_normal((H, D)).astype(bfloat16)
    wd = rng.standard_normal((D, H)).astype(bfloat16)
    x[1, 5] = np.nan
    x[2, 7] = np.inf
    x[2, 9] = -np.inf
    y, _, _, counters, _ = _decode_run(decode_lib, x, wg, wu, wd, gated=True, mr=8)
    assert int(counters[3]) == 3                            # block 0 counted x's NaN/Inf
    ref, _, _ = _decode_reference(x[:1], wg, wu, wd, True)
    assert np.linalg.norm(y[0].astype(np.float64) - ref[0]) <= 1e-2 * np.linalg.norm(ref[0])
    assert np.isnan(y[1].astype(np.float32)).all()          # NaN makes every neuron active: IEEE
    assert not np.isfinite(y[2].astype(np.float32)).all()
    _, _, _, counters, _ = _decode_run(decode_lib, x, wg, wu, wd, gated=True, mr=8, check_x=False)
    assert int(counters[3]) == 0xDEAD                       # not asked: the word is left alone


def test_decode_kernels_at_production_sizes(decode_lib_default):
    # 8 warps, 2 neurons a warp, 2048-neuron windows: three windows at H = 4200, and y's
    # 40 vectors in two blocks of 32 lanes (the second block mostly idle)
    rng = np.random.default_rng(12)
    M, D, H = 2, 160, 4200
    x = (rng.standard_normal((M, D)) / np.sqrt(D)).astype(np.float32)
    wg = rng.standard_normal((H, D)).astype(np.float32)
    wu = rng.standard_normal((H, D)).astype(np.float32)
    wd = (rng.standard_normal((D, H)) / np.sqrt(H)).astype(np.float32)
    y, h, flags, counters, _ = _decode_run(decode_lib_default, x, wg, wu, wd, gated=True, mr=2)
    ref, h_ref, act = _decode_reference(x, wg, wu, wd, True)
    assert np.linalg.norm(y - ref) <= 1e-5 * np.linalg.norm(ref)
    assert np.array_equal(flags[0, :H], _row_masks(act)) and int(counters[0]) == int(act.sum())


@pytest.mark.parametrize("dtype, gated, M", [(bfloat16, True, 37), (np.dtype(np.float32), False, 33)],
                         ids=["bf16-gated-M37", "f32-relu-M33"])
def test_decode_kernels_in_row_groups(decode_lib, dtype, gated, M):
    # more than 16 rows: groups of 16 (a grid dimension of both kernels), the last one
    # part-filled (5 rows; 1 row); an empty row and a row firing nearly everything in a
    # later group; a NaN and an Inf in the last group, counted with the first group's
    # none in one total by block (0, 0)
    rng = np.random.default_rng(M)
    D, H = (320 if dtype == bfloat16 else 160), 150  # 38 neuron blocks a group: the emulator is slow
    x = (rng.standard_normal((M, D)) / np.sqrt(D)).astype(dtype)
    wg = rng.standard_normal((H, D)).astype(dtype)
    wu = rng.standard_normal((H, D)).astype(dtype)
    wd = (rng.standard_normal((D, H)) / np.sqrt(H)).astype(dtype)
    x[:, 0] = 1.0
    wg[:, 0] = 0.05
    x[17] = 0.0                                  # group 1: an empty row
    x[20, 0] = 60.0                              # group 1: nearly every neuron
    y, h, flags, counters, ho = _decode_run(decode_lib, x, wg, wu, wd, gated=gated, mr=16, h_out=True)
    ref, h_ref, act = _decode_reference(x, wg, wu, wd, gated)
    tol = 1e-5 if dtype == np.float32 else 1e-2
    assert np.linalg.norm(y.astype(np.float64) - ref) <= tol * np.linalg.norm(ref)
    for m in range(M):                           # every row, each group on its own
        assert np.linalg.norm(y[m].astype(np.float64) - ref[m]) <= tol * np.linalg.norm(ref[m]) + 1e-30, m
    np.testing.assert_allclose(h[:M], h_ref, rtol=tol, atol=tol * np.abs(h_ref).max())
    assert np.array_equal(ho.astype(np.float32), h[:M].astype(dtype).astype(np.float32))
    for g in range(flags.shape[0]):
        assert np.array_equal(flags[g, :H], _row_masks(act[16 * g:16 * g + 16])), g
        assert not flags[g, H:].any()
    assert int(counters[0]) == int(act.sum()) and int(counters[3]) == 0
    assert not y[17].astype(np.float32).any() and act[20].sum() > 0.95 * H
    x[M - 1, 3], x[M - 1, 4] = np.nan, np.inf
    y, _, _, counters, _ = _decode_run(decode_lib, x, wg, wu, wd, gated=gated, mr=16)
    assert int(counters[3]) == 2
    assert np.isnan(y[M - 1].astype(np.float32)).all()
    assert np.linalg.norm(y[:M - 1].astype(np.float64) - ref[:M - 1]) <= tol * np.linalg.norm(ref[:M - 1])


def test_decode_inactive_neurons_add_nothing_active_ones_add_even_zero(decode_lib):
    # a neuron active in row 0 only, with NaN up weights: row 0 gets NaN, row 1 nothing;
    # a neuron active in row 1 only, with zero up weights (h = 0) and a NaN down column:
    # row 1 gets 0 * NaN = NaN (as the general path's list adds every listed neuron), row 0 nothing
    rng = np.random.default_rng(13)
    M, D, H = 2, 160, 300
    x = (rng.standard_normal((M, D)) / np.sqrt(D)).astype(np.float32)
    x[:, 0] = 1.0
    wg = rng.standard_normal((H, D)).astype(np.float32)
    wu = rng.standard_normal((H, D)).astype(np.float32)
    wd = (rng.standard_normal((D, H)) / np.sqrt(H)).astype(np.float32)
    x[0, 1], x[1, 1] = 1.0, -1.0
    wg[5, :] = 0.0
    wg[5, 1] = 1.0                                   # neuron 5: active in row 0 only
    wg[7, :] = 0.0
    wg[7, 1] = -1.0                                  # neuron 7: active in row 1 only
    wu[5, 3] = np.nan
    wu[7, :] = 0.0
    wd[:, 7] = np.nan
    y, h, flags, _, _ = _decode_run(decode_lib, x, wg, wu, wd, gated=True, mr=2)
    assert flags[0, 5] == 1 and flags[0, 7] == 2
    assert np.isnan(y[0]).all() and np.isnan(y[1]).all()
    wd[:, 7] = 1.0                                   # only the NaN up row now: row 1 is exact
    y, *_ = _decode_run(decode_lib, x, wg, wu, wd, gated=True, mr=2)
    ref, _, _ = _decode_reference(x[1:], wg, wu, wd, True)
    assert np.isnan(y[0]).all() and np.linalg.norm(y[1] - ref[0]) <= 1e-5 * np.linalg.norm(ref[0])
    wu[5, 3] = 1.0
    wd[:, 7] = np.nan                                # only the NaN down column: row 0 is exact
    y, *_ = _decode_run(decode_lib, x, wg, wu, wd, gated=True, mr=2)
    ref, _, _ = _decode_reference(x[:1], wg, wu, wd, True)
    assert np.isnan(y[1]).all() and np.linalg.norm(y[0] - ref[0]) <= 1e-5 * np.linalg.norm(ref[0])


def _relu_on_reference(z):
    """relu(z) != 0 as the kernels decide it, from numpy's own float semantics (no
    flush to zero): strictly positive, denormals included, or NaN."""
    f = z.astype(np.float32)
    return (f > 0) | np.isnan(f)


def _every_16bit_pattern(dtype, seed):
    """Vectors of eight 16-bit values in which each of the 65536 bit patterns sits once at
    each of the eight positions, beside random patterns."""
    rng = np.random.default_rng(seed)
    pats = np.arange(1 << 16, dtype=np.uint16)
    v = rng.integers(0, 1 << 16, size=(8 << 16, 8), dtype=np.uint16)
    for i in range(8):
        v[i << 16:(i + 1) << 16, i] = rng.permutation(pats)
    return np.ascontiguousarray(v).view(dtype)


@pytest.mark.parametrize("dtype", [bfloat16, np.dtype(np.float16), np.dtype(np.float32)], ids=str)
def test_relu_on_bits_on_every_bit_pattern(train_lib, dtype):
    """relu_on_bits (with TW_PACK_WORDS = 1, the second library: 16-bit types two values
    a 32-bit word; the default's value-by-value test otherwise) marks exactly the values
    relu keeps, for every 16-bit pattern at every position of a vector: NaNs of either
    sign, denormals, both zeros, infinities. float32 gets random patterns with the same
    special values."""
    if dtype.itemsize == 2:
        z = _every_16bit_pattern(dtype, 7)
    else:
        rng = np.random.default_rng(8)
        z = rng.integers(0, 1 << 32, size=(1 << 16, 4), dtype=np.uint32)
        z[:, 0] = rng.choice(np.array([0, 0x80000000, 1, 0x80000001, 0x7f800000, 0xff800000, 0x7f800001,
                                       0xffc00000, 0x7fffffff, 0x00800000], np.uint32), 1 << 16)
        z = z.view(np.float32)
    n = z.shape[0]
    bits = np.full(n, 0xDEADBEEF, np.uint32)
    getattr(train_lib, f"relu_bits_{_suffix(dtype)}")(_ptr(z), _ptr(bits), ctypes.c_longlong(n))
    want = (_relu_on_reference(z) << np.arange(z.shape[1], dtype=np.uint32)).sum(axis=1, dtype=np.uint32)
    np.testing.assert_array_equal(bits, want)


@pytest.mark.parametrize("dtype", [bfloat16, np.dtype(np.float16), np.dtype(np.float32)], ids=str)
@pytest.mark.parametrize("H", [512, 1000, 264, 999])
def test_relu_count_and_csr_pack_match_numpy(train_lib, dtype, H):
    """relu_count and relu_pack (the CSR of relu(z), columns ascending) on rows of every
    kind: sparse (the warp scan's one- and two-ballot shortcuts), a row that fires every
    column and rows of several actives in one vector (the full scan), empty rows, and
    rows of special bit patterns; the vector loops (H a multiple of the vector) and the
    scalar ones. Poisoned outputs; bits against numpy."""
    rng = np.random.default_rng(H)
    M = 37
    z = (rng.standard_normal((M, H)) - 2.5).astype(np.float32)    # under 1% positive
    z[1] = np.abs(z[1]) + 0.5                                      # every column
    z[2] = -1.0                                                    # none
    z[3, 8:16] = 2.0                                               # a whole vector of actives
    z[4, :6] = [np.nan, -0.0, 1e-40, -1e-40, np.inf, -np.inf]
    z[5::4, 1::3] = 0.25                                           # two or three actives per vector
    z = z.astype(dtype)
    if dtype.itemsize == 2:                                        # rows 6.. of random 16-bit patterns
        pats = _every_16bit_pattern(dtype, H)[:, 0]
        rows = z[6:6 + (pats.size + H - 1) // H].reshape(-1)[:min(pats.size, (M - 6) * H)]
        rows[:] = pats[:rows.size]
    vec = int(H % (16 // z.dtype.itemsize) == 0)
    on = _relu_on_reference(z)
    counts = np.full(M, -5, np.int32)
    getattr(train_lib, f"relu_count_{_suffix(dtype)}")(_ptr(z), ctypes.c_longlong(M), H, vec, _ptr(counts))
    np.testing.assert_array_equal(counts, on.sum(axis=1))
    indptr = np.zeros(M + 1, np.int64)
    np.cumsum(on.sum(axis=1), out=indptr[1:])
    nnz = int(indptr[-1])
    col = np.full(nnz + 2, -0x3C3C3C3C, np.int32)                 # 2 guard slots past the end
    val = np.full(nnz + 2, np.nan, np.float32).astype(dtype)
    getattr(train_lib, f"relu_pack_{_suffix(dtype)}")(_ptr(z), ctypes.c_longlong(M), H, vec, _ptr(indptr),
                                                        _ptr(col), _ptr(val))
    r, c = np.nonzero(on)
    np.testing.assert_array_equal(col[:nnz], c)
    np.testing.assert_array_equal(_bits(val[:nnz]), _bits(z[r, c]))
    assert (col[nnz:] == -0x3C3C3C3C).all() and np.isnan(val[nnz:].astype(np.float32)).all()


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), bfloat16], ids=str)
@pytest.mark.parametrize("M,H", [(13, 1000), (40, 512), (1, 264), (9, 999)])
def test_relu_count_pack_gives_relu_to_hybrids_bits(train_lib, dtype, M, H):
    """relu_to_hybrid's modes 1 and 2 (count and pack in one read of z, then the backup
    rows once row_maps has placed them: the speculative forward's COUNT_PACK) write the
    bits of relu_count + relu_to_hybrid (mode 0): ELL values and indices, counts,
    neuron counts, backup rows, with room for more backup rows than are wide (not
    written); NaN and a denormal count as active, -0.0 not; the vector and the scalar
    loops."""
    from twellpy.backends import cpu_train

    rng = np.random.default_rng(M * H + 1)
    z = (rng.standard_normal((M, H)) - 2.2).astype(np.float32)
    z[0, :3] = [np.nan, -0.0, 1e-40]
    z[::3] = np.abs(z[::3]) - 1.0                                 # every third row wide
    z = z.astype(dtype)
    counts = cpu_train.relu_count(z)
    W = int(np.sort(counts)[(M - 1) // 2]) if M > 1 else 3       # narrow rows and wide ones
    wide = int(np.count_nonzero(counts > W))
    cap = wide + 3
    maps = cpu_train.row_maps(counts, W, cap, capacity=True)
    row_map = maps[:M]
    want = cpu_train.relu_to_hybrid(z, row_map, W, cap)
    vec = int(H % (16 // z.dtype.itemsize) == 0)
    vals = np.full(M * W + cap * H, np.nan, np.float32).astype(dtype)   # poisoned
    ell_idx = np.full((M, W), -0x5A5A5A5A, np.int32)
    ell_nnz = np.full(M, -9, np.int32)
    token_counts = np.full(M, -7, np.int32)
    neuron_counts = np.zeros(H, np.int32)
    ell_val, backup = cpu_train.split_combined(vals, M, W, cap, H)
    fn = getattr(train_lib, f"relu_count_pack_{_suffix(dtype)}")
    fn(_ptr(z), M, H, vec, 0, None, W, _ptr(ell_val), _ptr(ell_idx), _ptr(ell_nnz), _ptr(backup),
       _ptr(neuron_counts), _ptr(token_counts), 1)
    np.testing.assert_array_equal(token_counts, counts)
    assert np.isnan(backup.astype(np.float32)).all(), "mode 1 writes no backup row"
    fn(_ptr(z), M, H, vec, 0, _ptr(row_map), W, _ptr(ell_val), _ptr(ell_idx), _ptr(ell_nnz), _ptr(backup),
       _ptr(neuron_counts), _ptr(token_counts), 2)
    n = M * W + wide * H
    np.testing.assert_array_equal(_bits(vals[:n]), _bits(want[0][:n]))
    assert np.isnan(vals[n:].astype(np.float32)).all(), "nothing past the routed rows is written"
    np.testing.assert_array_equal(ell_idx, want[1])
    np.testing.assert_array_equal(ell_nnz, want[2])
    np.testing.assert_array_equal(neuron_counts, want[3])    # mode 2 counts nothing again
    assert wide >= 1 and ((counts <= W).any() or M == 1)
    # the CPU twins of the pair give the same
    got = cpu_train.relu_count_pack(z, W, cap)
    cpu_train.backup_rows_from_z(z, row_map, got[0], W, cap)
    np.testing.assert_array_equal(_bits(got[0][:n]), _bits(want[0][:n]))
    for a, b in zip(got[1:4], want[1:4]):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(got[4], counts)
