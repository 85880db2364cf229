// spmm.cu -- sparse (slot lists / TwELL / CSR) times dense: out = A @ B.
//
// Design (gather SpMM, bound by L2 reads of B rows):
//   * one warp per (output row, column block); a column block is
//     32 * VEC * ITERS columns, lane l owns VEC consecutive columns in each of
//     ITERS strips, read from B with one VEC-wide (16-byte) load per strip;
//   * the warp loads 32 (index, value) slots at once (one per lane), compacts
//     the valid ones with a ballot, and broadcasts them with shuffles, two at a
//     time so that 2 * ITERS independent loads are in flight per lane;
//   * accumulation in fp32 registers (fp64 for fp64), one rounding at the end;
//   * the order of the additions is fixed (slot order), so results are
//     bitwise reproducible.
// VEC = 16 / sizeof(T) when K % VEC == 0 and B / out are 16-byte aligned,
// else 1. ITERS is chosen by the launcher from K (smallest that covers K, at
// most SPMM_MAX_ITERS there).
#include "common.cuh"

#ifndef SPMM_WARPS
#define SPMM_WARPS 4             // warps per block
#endif

static_assert(SPMM_WARPS >= 1 && SPMM_WARPS <= 32, "SPMM_WARPS out of range");

using namespace twellpy;

template <typename T, int VEC, int ITERS>
struct SpmmLane {
    typedef typename accum<T>::type A;
    A acc[ITERS][VEC];
    int col0;  // first column of this lane in strip 0
    int K;     // columns of B / out

    __device__ __forceinline__ void init(int col_block, int lane, int K_) {
        K = K_;
        col0 = col_block * (32 * VEC * ITERS) + lane * VEC;
#pragma unroll
        for (int j = 0; j < ITERS; ++j)
#pragma unroll
            for (int k = 0; k < VEC; ++k) acc[j][k] = A(0);
    }

    // acc += v0 * B[r0, cols] + v1 * B[r1, cols] (loads of both rows first).
    __device__ __forceinline__ void axpy2(const T* __restrict__ B, int r0, A v0, int r1, A v1) {
        const T* __restrict__ p0 = B + (long long)r0 * K;
        const T* __restrict__ p1 = B + (long long)r1 * K;
        vec_t<T, VEC> w0[ITERS], w1[ITERS];
#pragma unroll
        for (int j = 0; j < ITERS; ++j) {
            const int c = col0 + j * 32 * VEC;
            if (c < K) {
                w0[j] = load_vec<T, VEC>(p0 + c);
                w1[j] = load_vec<T, VEC>(p1 + c);
            }
        }
#pragma unroll
        for (int j = 0; j < ITERS; ++j) {
            const int c = col0 + j * 32 * VEC;
            if (c < K) {
#pragma unroll
                for (int k = 0; k < VEC; ++k) {
                    acc[j][k] = fma(v0, to_acc<A, T>(w0[j].v[k]), acc[j][k]);
                    acc[j][k] = fma(v1, to_acc<A, T>(w1[j].v[k]), acc[j][k]);
                }
            }
        }
    }

    __device__ __forceinline__ void axpy1(const T* __restrict__ B, int r0, A v0) {
        const T* __restrict__ p0 = B + (long long)r0 * K;
#pragma unroll
        for (int j = 0; j < ITERS; ++j) {
            const int c = col0 + j * 32 * VEC;
            if (c < K) {
                const vec_t<T, VEC> w = load_vec<T, VEC>(p0 + c);
#pragma unroll
                for (int k = 0; k < VEC; ++k) acc[j][k] = fma(v0, to_acc<A, T>(w.v[k]), acc[j][k]);
            }
        }
    }

    // Consume the valid lanes (bit set in `mask`) of one 32-slot chunk, in lane order.
    __device__ __forceinline__ void consume(const T* __restrict__ B, unsigned mask, int idx, A val) {
        while (mask) {
            const int l0 = __ffs(mask) - 1;
            mask &= mask - 1u;
            const int r0 = __shfl_sync(FULL_MASK, idx, l0);
            const A v0 = __shfl_sync(FULL_MASK, val, l0);
            if (mask) {
                const int l1 = __ffs(mask) - 1;
                mask &= mask - 1u;
                const int r1 = __shfl_sync(FULL_MASK, idx, l1);
                const A v1 = __shfl_sync(FULL_MASK, val, l1);
                axpy2(B, r0, v0, r1, v1);
            } else {
                axpy1(B, r0, v0);
            }
        }
    }

    __device__ __forceinline__ void store(T* __restrict__ out, long long row) const {
        T* __restrict__ o = out + row * K;
#pragma unroll
        for (int j = 0; j < ITERS; ++j) {
            const int c = col0 + j * 32 * VEC;
            if (c < K) {
                vec_t<T, VEC> w;
#pragma unroll
                for (int k = 0; k < VEC; ++k) w.v[k] = from_acc<T, A>(acc[j][k]);
                store_vec<T, VEC>(o + c, w);
            }
        }
    }
};

// ---------------------------------------------------------------------------
// twellpy_twell_spmm<T, VEC, ITERS>: out = A @ B for TwELL A.
//   values   (M, n_tiles, S)   T      TwELL values
//   indices  (M, n_tiles, S)   int32  global column of A = row of B
//   counts   (M, n_tiles)      int32  stored entries per (row, tile); only these slots are read
//   B        (N, K)            T      dense
//   out      (M, K)            T      out (every element written)
// Warp w: row = w / n_cb, column block = w % n_cb, n_cb = ceil(K / (32*VEC*ITERS)).
// grid.x = ceil(M * n_cb / warps per block). Slots with an index outside [0, N) are skipped.
// ---------------------------------------------------------------------------
template <typename T, int VEC, int ITERS>
__global__ void __launch_bounds__(SPMM_WARPS * 32, 1)
twellpy_twell_spmm(const T* __restrict__ values, const int* __restrict__ indices,
                   const int* __restrict__ counts, const T* __restrict__ B, T* __restrict__ out,
                   int M, int n_tiles, int slots, int N, int K, int n_cb) {
    typedef typename accum<T>::type A;
    const long long warp = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (warp >= (long long)M * n_cb) return;
    const long long row = warp / n_cb;
    const int cb = (int)(warp - row * n_cb);
    SpmmLane<T, VEC, ITERS> st;
    st.init(cb, lane, K);
    const long long crow = row * n_tiles;
    for (int t0 = 0; t0 < n_tiles; t0 += 32) {
        const int t = t0 + lane;
        const int cnt = t < n_tiles ? min(max(counts[crow + t], 0), slots) : 0;
        unsigned busy = __ballot_sync(FULL_MASK, cnt > 0);
        while (busy) {
            const int src = __ffs(busy) - 1;
            busy &= busy - 1u;
            const int ct = __shfl_sync(FULL_MASK, cnt, src);
            const long long base = (crow + t0 + src) * slots;
            for (int s0 = 0; s0 < ct; s0 += 32) {
                const int s = s0 + lane;
                int idx = -1;
                A val = A(0);
                if (s < ct) {
                    idx = indices[base + s];
                    val = to_acc<A, T>(values[base + s]);
                }
                const unsigned mask = __ballot_sync(FULL_MASK, idx >= 0 && idx < N);
                st.consume(B, mask, idx, val);
            }
        }
    }
    st.store(out, row);
}

// ---------------------------------------------------------------------------
// twellpy_slots_spmm<T, VEC, ITERS>: out = A @ B for A given as slot lists.
//   values   (M, n_slots)   T      slot values (ELL, or TwELL flattened)
//   indices  (M, n_slots)   int32  column of A = row of B, -1 = padding
//   B        (N, K)         T      dense
//   out      (M, K)         T      out
// Same warp mapping as twellpy_twell_spmm; every slot is read (no counts).
// ---------------------------------------------------------------------------
template <typename T, int VEC, int ITERS>
__global__ void __launch_bounds__(SPMM_WARPS * 32, 1)
twellpy_slots_spmm(const T* __restrict__ values, const int* __restrict__ indices,
                   const T* __restrict__ B, T* __restrict__ out,
                   int M, int n_slots, int N, int K, int n_cb) {
    typedef typename accum<T>::type A;
    const long long warp = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (warp >= (long long)M * n_cb) return;
    const long long row = warp / n_cb;
    const int cb = (int)(warp - row * n_cb);
    SpmmLane<T, VEC, ITERS> st;
    st.init(cb, lane, K);
    const long long base = row * n_slots;
    for (int s0 = 0; s0 < n_slots; s0 += 32) {
        const int s = s0 + lane;
        int idx = -1;
        A val = A(0);
        if (s < n_slots) {
            idx = indices[base + s];
            if (idx >= 0) val = to_acc<A, T>(values[base + s]);
        }
        const unsigned mask = __ballot_sync(FULL_MASK, idx >= 0 && idx < N);
        st.consume(B, mask, idx, val);
    }
    st.store(out, row);
}

// ---------------------------------------------------------------------------
// twellpy_csr_spmm<T, VEC, ITERS>: out = A @ B for CSR A (used for A.T @ B
// after a deterministic transpose).
//   indptr   (R+1,)   int32  row pointers
//   cols     (nnz,)   int32  column of A = row of B
//   data     (nnz,)   T
//   B        (N, K)   T      dense
//   out      (R, K)   T      out
// Same warp mapping (R rows); entries summed in CSR order.
// ---------------------------------------------------------------------------
template <typename T, int VEC, int ITERS>
__global__ void __launch_bounds__(SPMM_WARPS * 32, 1)
twellpy_csr_spmm(const int* __restrict__ indptr, const int* __restrict__ cols,
                 const T* __restrict__ data, const T* __restrict__ B, T* __restrict__ out,
                 int R, int N, int K, int n_cb) {
    typedef typename accum<T>::type A;
    const long long warp = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (warp >= (long long)R * n_cb) return;
    const long long row = warp / n_cb;
    const int cb = (int)(warp - row * n_cb);
    SpmmLane<T, VEC, ITERS> st;
    st.init(cb, lane, K);
    const long long start = indptr[row], end = indptr[row + 1];
    for (long long e0 = start; e0 < end; e0 += 32) {
        const long long e = e0 + lane;
        int idx = -1;
        A val = A(0);
        if (e < end) {
            idx = cols[e];
            val = to_acc<A, T>(data[e]);
        }
        const unsigned mask = __ballot_sync(FULL_MASK, idx >= 0 && idx < N);
        st.consume(B, mask, idx, val);
    }
    st.store(out, row);
}
