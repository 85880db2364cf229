// convert.cu -- slot lists -> dense / CSR, and value casts.
//
// "Slot lists" are the flattened (M, K) values/indices of ELL (K = W) or
// TwELL (K = n_tiles * S): index -1 marks padding and is skipped.
#include "common.cuh"

#ifndef CONVERT_WARPS
#define CONVERT_WARPS 8          // warps per block (warp-per-row kernels)
#endif
#ifndef CONVERT_BLOCK
#define CONVERT_BLOCK 256        // threads per block (element-wise kernels)
#endif

using namespace twellpy;

// ---------------------------------------------------------------------------
// twellpy_slots_to_dense<T>: scatter slot entries into a zero-filled dense array.
//   values   (M, K)        T      slot values
//   indices  (M, K)        int32  column, -1 = skip (columns outside [0, n_cols) are skipped too)
//   out      (M, n_cols)   T      in/out: zero-filled by the caller
// One thread per slot, grid-stride over M*K; grid.x = min(ceil(M*K/CONVERT_BLOCK), 2^20).
// Columns are unique within a row, so no two threads write the same element.
// ---------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(CONVERT_BLOCK)
twellpy_slots_to_dense(const T* __restrict__ values, const int* __restrict__ indices, T* __restrict__ out,
                       long long M, int K, int n_cols) {
    const long long total = M * K;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int col = indices[i];
        if (col >= 0 && col < n_cols) {
            const long long row = i / K;
            out[row * n_cols + col] = values[i];
        }
    }
}

// ---------------------------------------------------------------------------
// twellpy_slots_to_csr<T>: slot lists -> CSR, entries taken in slot order.
//   values      (M, K)     T      slot values
//   indices     (M, K)     int32  column, -1 = padding
//   indptr      (M+1,)     int64  row pointers (exclusive prefix sum of the row counts)
//   out_col     (nnz,)     int32  out
//   out_data    (nnz,)     T      out
//   bad         (1,)       int32  in/out: rows whose number of valid slots differs from
//                                 indptr[row+1] - indptr[row] (extra entries are not written)
// One warp per row; grid.x = ceil(M / warps per block). Positions are ballot prefix counts.
// ---------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(CONVERT_WARPS * 32)
twellpy_slots_to_csr(const T* __restrict__ values, const int* __restrict__ indices,
                     const long long* __restrict__ indptr, int* __restrict__ out_col,
                     T* __restrict__ out_data, int* __restrict__ bad, int M, int K) {
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= M) return;
    const long long dst0 = indptr[row];
    const long long want = indptr[row + 1] - dst0;
    const long long base = row * (long long)K;
    const unsigned lt = lanes_below(lane);
    long long run = 0;
    for (int s0 = 0; s0 < K; s0 += 32) {
        const int s = s0 + lane;
        const int col = s < K ? indices[base + s] : -1;
        const bool valid = col >= 0;
        const unsigned m = __ballot_sync(FULL_MASK, valid);
        const long long pos = run + __popc(m & lt);
        if (valid && pos < want) {
            out_col[dst0 + pos] = col;
            out_data[dst0 + pos] = values[base + s];
        }
        run += __popc(m);
    }
    if (lane == 0 && run != want) atomicAdd(bad, 1);
}

// ---------------------------------------------------------------------------
// Value conversion with one rounding step (fp64 -> 16-bit rounds directly).
// CuPy compiles with -ftz=true, which makes the compiler flush fp32
// subnormals in float <-> double conversions; those two are done exactly here
// (subnormals handled with double arithmetic, which -ftz does not touch).
// ---------------------------------------------------------------------------
__device__ __forceinline__ double f32_to_f64_exact(float v) {
    const unsigned bits = __float_as_uint(v);
    if ((bits & 0x7f800000u) == 0u && (bits & 0x007fffffu) != 0u) {
        const double mag = (double)(bits & 0x007fffffu) * 0x1p-149;  // exact
        return (bits & 0x80000000u) ? -mag : mag;
    }
    return (double)v;
}

__device__ __forceinline__ float f64_to_f32_exact(double v) {
    const double a = fabs(v);
    if (a < 0x1p-126 && a != 0.0) {
        // fp32 subnormal (or zero, or the smallest normal after rounding):
        // the magnitude in units of 2^-149, rounded half to even, is the bit pattern.
        const unsigned m = (unsigned)rint(a * 0x1p149);
        return __uint_as_float((signbit(v) ? 0x80000000u : 0u) | m);
    }
    return (float)v;
}

template <typename D, typename S> struct caster {
    static __device__ __forceinline__ D apply(S v) { return from_float<D>(to_float<S>(v)); }
};
template <typename S> struct caster<double, S> {
    static __device__ __forceinline__ double apply(S v) { return f32_to_f64_exact(to_float<S>(v)); }
};
template <> struct caster<double, double> {
    static __device__ __forceinline__ double apply(double v) { return v; }
};
template <> struct caster<__half, double> {
    static __device__ __forceinline__ __half apply(double v) { return __double2half(v); }
};
template <> struct caster<__nv_bfloat16, double> {
    static __device__ __forceinline__ __nv_bfloat16 apply(double v) { return __double2bfloat16(v); }
};
template <> struct caster<float, double> {
    static __device__ __forceinline__ float apply(double v) { return f64_to_f32_exact(v); }
};

// ---------------------------------------------------------------------------
// twellpy_cast<S, D>: element-wise dtype conversion (round to nearest even).
//   src   (n,)   S
//   dst   (n,)   D   out
// Grid-stride; grid.x = min(ceil(n / CONVERT_BLOCK), 2^20).
// ---------------------------------------------------------------------------
template <typename S, typename D>
__global__ void __launch_bounds__(CONVERT_BLOCK)
twellpy_cast(const S* __restrict__ src, D* __restrict__ dst, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        dst[i] = caster<D, S>::apply(src[i]);
    }
}
