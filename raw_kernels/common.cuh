// common.cuh -- helpers shared by every twellpy kernel.
//
// Included by each .cu file; compiles on its own under NVRTC (no host headers).
// CuPy compiles with -ftz=true, so "is this value non-zero" is always decided
// on the bit pattern (twellpy_nonzero), never with a float compare: a
// denormal is a non-zero and must be kept, NaN is a non-zero and must be kept.
#pragma once
#include <cuda_fp16.h>
#include <cuda_bf16.h>

namespace twellpy {

// ---- conversions to/from the fp32 (or fp64) accumulator --------------------
template <typename T> __device__ __forceinline__ float to_float(T v);
template <> __device__ __forceinline__ float to_float<float>(float v) { return v; }
template <> __device__ __forceinline__ float to_float<double>(double v) { return (float)v; }
template <> __device__ __forceinline__ float to_float<__half>(__half v) { return __half2float(v); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_float(float v);
template <> __device__ __forceinline__ float from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ double from_float<double>(float v) { return (double)v; }
template <> __device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// Accumulator type: double for double data, float otherwise.
template <typename T> struct accum { typedef float type; };
template <> struct accum<double> { typedef double type; };

template <typename A, typename T> __device__ __forceinline__ A to_acc(T v) { return (A)to_float<T>(v); }
template <> __device__ __forceinline__ double to_acc<double, double>(double v) { return v; }
template <typename T, typename A> __device__ __forceinline__ T from_acc(A v) { return from_float<T>((float)v); }
template <> __device__ __forceinline__ double from_acc<double, double>(double v) { return v; }

// ---- bit-exact non-zero test (independent of -ftz) -------------------------
__device__ __forceinline__ bool nonzero(float v) { return (__float_as_uint(v) & 0x7fffffffu) != 0u; }
__device__ __forceinline__ bool nonzero(double v) { return (__double_as_longlong(v) & 0x7fffffffffffffffll) != 0ll; }
__device__ __forceinline__ bool nonzero(__half v) { return (__half_as_ushort(v) & 0x7fffu) != 0u; }
__device__ __forceinline__ bool nonzero(__nv_bfloat16 v) { return (__bfloat16_as_ushort(v) & 0x7fffu) != 0u; }

// ReLU "active" test: strictly positive, or NaN (IEEE: relu(NaN) = NaN is kept).
__device__ __forceinline__ bool relu_active(float v) { return !(v <= 0.0f); }

// ReLU activity of the eight 16-bit values of a 16-byte vector, as bits (bit i: value i),
// two values a 32-bit word. A value counts when its sign is clear and its magnitude is at
// least LEAST, or when it is NaN (magnitude past INF, the type's infinity). Within each half,
// magnitude + (0x8000 - LEAST) carries into the half's top bit iff magnitude >= LEAST, and
// magnitude + (0x7fff - INF) iff magnitude > INF; neither sum carries out of its half. The
// four words' top bits are gathered by a byte permute and a multiply (bits 7, 15, 23, 31 ->
// 28..31: no two partial products meet). About 23 instructions a vector, against three or
// more a value for a test value by value.
template <unsigned INF, unsigned LEAST>
__device__ __forceinline__ unsigned relu_halves(unsigned w) {
    const unsigned m = w & 0x7fff7fffu;
    const unsigned big = m + (0x8000u - LEAST) * 0x00010001u;
    const unsigned nan = m + (0x7fffu - INF) * 0x00010001u;
    return ((big & ~w) | nan) & 0x80008000u;
}
template <unsigned INF, unsigned LEAST>
__device__ __forceinline__ unsigned relu_bits16(const uint4& raw) {
    const unsigned lo = __byte_perm(relu_halves<INF, LEAST>(raw.x), relu_halves<INF, LEAST>(raw.y), 0x7531u);
    const unsigned hi = __byte_perm(relu_halves<INF, LEAST>(raw.z), relu_halves<INF, LEAST>(raw.w), 0x7531u);
    return ((lo * 0x00204081u) >> 28) | (((hi * 0x00204081u) >> 28) << 4);
}
constexpr unsigned BF16_INF = 0x7f80u, HALF_INF = 0x7c00u;

template <typename T> __device__ __forceinline__ T zero_value() { return from_float<T>(0.0f); }
template <> __device__ __forceinline__ double zero_value<double>() { return 0.0; }

}  // namespace twellpy

// ---- vector loads and warp helpers (used by the container kernels) ---------
namespace twellpy {

constexpr unsigned FULL_MASK = 0xffffffffu;

// VEC consecutive values loaded/stored as one access. With VEC * sizeof(T) ==
// 16 this is a 16-byte vector access: the caller guarantees 16-byte alignment
// (launchers pick VEC = 1 otherwise).
template <typename T, int VEC> struct alignas(sizeof(T) * VEC) vec_t { T v[VEC]; };

template <typename T, int VEC>
__device__ __forceinline__ vec_t<T, VEC> load_vec(const T* __restrict__ p) {
    return *reinterpret_cast<const vec_t<T, VEC>*>(p);
}

template <typename T, int VEC>
__device__ __forceinline__ void store_vec(T* __restrict__ p, const vec_t<T, VEC>& v) {
    *reinterpret_cast<vec_t<T, VEC>*>(p) = v;
}

// Lanes below this one, as a bit mask (the "lanemask_lt" of PTX).
__device__ __forceinline__ unsigned lanes_below(int lane) { return (1u << lane) - 1u; }

__device__ __forceinline__ int warp_sum(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ int warp_max(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// Elements of T in a 16-byte vector.
template <typename T> struct vec_of { static constexpr int n = 16 / (int)sizeof(T); };

// Unpack a 16-byte vector of T into accumulator values.
template <typename T, typename A>
__device__ __forceinline__ void unpack16(const uint4& v, A* out) {
    const T* e = reinterpret_cast<const T*>(&v);
#pragma unroll
    for (int i = 0; i < vec_of<T>::n; ++i) out[i] = to_acc<A, T>(e[i]);
}

// Sum of a float/double over the warp by xor butterfly: every lane ends with the same bits
// (each step adds the same two operands in either lane), so branches on it stay warp-uniform.
template <typename A> __device__ __forceinline__ A warp_total(A v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(FULL_MASK, v, off);
    return v;
}

// Inclusive prefix sum over the warp (5 shuffles): lane i gets the sum of v
// over lanes 0..i. lane = this thread's lane (threadIdx.x & 31); every lane
// of the warp must call it (full-mask shuffles).
__device__ __forceinline__ int warp_inclusive_sum(int v, int lane) {
#pragma unroll
    for (int off = 1; off < 32; off <<= 1) {
        const int t = __shfl_up_sync(FULL_MASK, v, off);
        if (lane >= off) v += t;
    }
    return v;
}

// Exclusive warp prefix sum of small counts (cnt >= 0), and their total in `total`. With
// SHORTCUTS, one or two ballots answer the common steps of a sparse row, no lane counting
// anything or none more than one; warp_inclusive_sum's five shuffles only the rest. The
// branches are warp-uniform; every lane of the warp must call it.
template <bool SHORTCUTS>
__device__ __forceinline__ int warp_exclusive_count(int cnt, int lane, int& total) {
    if (SHORTCUTS) {
        const unsigned any = __ballot_sync(FULL_MASK, cnt != 0);
        if (any == 0u) {
            total = 0;
            return 0;
        }
        if (__ballot_sync(FULL_MASK, cnt > 1) == 0u) {
            total = __popc(any);
            return __popc(any & lanes_below(lane));
        }
    }
    const int incl = warp_inclusive_sum(cnt, lane);
    total = __shfl_sync(FULL_MASK, incl, 31);
    return incl - cnt;
}

}  // namespace twellpy
