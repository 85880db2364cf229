// spmm.cu -- sparse (slot lists / TwELL / CSR) times dense: out = A @ B.
//
// Design (gather SpMM, bound by L2 reads of B rows):
//   * one warp per (output row, column block); a column block is
//     32 * VEC * ITERS columns, lane l owns VEC consecutive columns in each of
//     ITERS strips, read from B with one VEC-wide (16-byte) load per strip;
//   * the warp reads the row's slots 32 at a time (coalesced), and appends
//     the valid (index, value) pairs to a per-warp list in shared memory
//     (positions from a ballot prefix count). When the list is nearly full it
//     is flushed: GROUP = SPMM_LOADS / ITERS entries at a time, every lane
//     issues GROUP * ITERS independent loads of B before any FMA, so that
//     SPMM_LOADS (16) loads per lane are in flight whatever the distribution
//     of entries over tiles;
//   * accumulation in fp32 registers (fp64 for fp64), one rounding at the end;
//   * entries are summed in slot order: results are bitwise reproducible.
// VEC = 16 / sizeof(T) when K % VEC == 0 and B / out are 16-byte aligned,
// else 1. ITERS is chosen by the launcher from K (the smallest of 1, 2, 4, 8
// that covers K, at most SPMM_MAX_ITERS there).
#include "common.cuh"

#ifndef SPMM_WARPS
#define SPMM_WARPS 4             // most warps per block (launch bound; launchers may use fewer)
#endif
#ifndef SPMM_LIST
#define SPMM_LIST 128            // per-warp list of pending (index, value) entries
#endif
#ifndef SPMM_LOADS
#define SPMM_LOADS 16            // B loads in flight per lane: GROUP = max(1, SPMM_LOADS / ITERS) entries at once
#endif

static_assert(SPMM_WARPS >= 1 && SPMM_WARPS <= 32, "SPMM_WARPS out of range");
static_assert(SPMM_LIST >= 64 && SPMM_LIST % 32 == 0, "SPMM_LIST must be a multiple of 32, >= 64");
static_assert(SPMM_LOADS >= 1 && SPMM_LOADS <= 64, "SPMM_LOADS out of range");

using namespace twellpy;

template <typename T, int VEC, int ITERS>
struct SpmmLane {
    typedef typename accum<T>::type A;
    static constexpr int GROUP = SPMM_LOADS / ITERS > 0 ? SPMM_LOADS / ITERS : 1;  // entries gathered together
    A acc[ITERS][VEC];
    int col0;   // first column of this lane in strip 0
    int K;      // columns of B / out
    int N;      // rows of B (entries with another index are skipped)
    int* list_idx;
    A* list_val;
    int fill;   // entries in the list (warp-uniform)

    __device__ __forceinline__ void init(int col_block, int lane, int K_, int N_, int* li, A* lv) {
        K = K_;
        N = N_;
        col0 = col_block * (32 * VEC * ITERS) + lane * VEC;
        list_idx = li;
        list_val = lv;
        fill = 0;
#pragma unroll
        for (int j = 0; j < ITERS; ++j)
#pragma unroll
            for (int k = 0; k < VEC; ++k) acc[j][k] = A(0);
    }

    // Append the lanes whose bit is set in `mask` (lane order) to the list.
    __device__ __forceinline__ void push(unsigned mask, int lane, int idx, A val) {
        if ((mask >> lane) & 1u) {
            const int pos = fill + __popc(mask & lanes_below(lane));
            list_idx[pos] = idx;
            list_val[pos] = val;
        }
        fill += __popc(mask);
        __syncwarp();
        if (fill > SPMM_LIST - 32) flush();
    }

    // acc += sum over the list of val * B[idx, this lane's columns]; empties the list.
    __device__ __forceinline__ void flush() {
        for (int j = 0; j < fill; j += GROUP) {
            int r[GROUP];
            A v[GROUP];
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                r[g] = j + g < fill ? list_idx[j + g] : -1;  // shared-memory broadcast
                v[g] = j + g < fill ? list_val[j + g] : A(0);
            }
            vec_t<T, VEC> w[GROUP][ITERS];
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                if (r[g] >= 0) {
                    const T* __restrict__ p = B_ + (long long)r[g] * K;
#pragma unroll
                    for (int it = 0; it < ITERS; ++it) {
                        const int c = col0 + it * 32 * VEC;
                        if (c < K) w[g][it] = load_vec<T, VEC>(p + c);
                    }
                }
            }
#pragma unroll
            for (int g = 0; g < GROUP; ++g) {
                if (r[g] >= 0) {
#pragma unroll
                    for (int it = 0; it < ITERS; ++it) {
                        const int c = col0 + it * 32 * VEC;
                        if (c < K) {
#pragma unroll
                            for (int k = 0; k < VEC; ++k)
                                acc[it][k] = fma(v[g], to_acc<A, T>(w[g][it].v[k]), acc[it][k]);
                        }
                    }
                }
            }
        }
        fill = 0;
        __syncwarp();  // the list may be overwritten now
    }

    // Valid-entry mask of a 32-slot chunk (index in [0, N)).
    __device__ __forceinline__ unsigned valid_mask(int idx) const {
        return __ballot_sync(FULL_MASK, idx >= 0 && idx < N);
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

    const T* __restrict__ B_;
};

// Per-warp list storage (shared memory) of the block's warps.
#define TWELLPY_SPMM_LIST_STORAGE(A)                                        \
    __shared__ int s_list_idx[SPMM_WARPS][SPMM_LIST];                        \
    __shared__ A s_list_val[SPMM_WARPS][SPMM_LIST];                          \
    const int warp_in_block = threadIdx.x >> 5

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
    TWELLPY_SPMM_LIST_STORAGE(A);
    const long long warp = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (warp >= (long long)M * n_cb) return;
    const long long row = warp / n_cb;
    const int cb = (int)(warp - row * n_cb);
    SpmmLane<T, VEC, ITERS> st;
    st.B_ = B;
    st.init(cb, lane, K, N, s_list_idx[warp_in_block], s_list_val[warp_in_block]);
    const long long crow = row * n_tiles;
    for (int t0 = 0; t0 < n_tiles; t0 += 32) {
        const int t = t0 + lane;
        const int cnt = t < n_tiles ? min(max(counts[crow + t], 0), slots) : 0;
        unsigned busy = __ballot_sync(FULL_MASK, cnt > 0);
        while (busy) {  // tiles with entries, in order
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
                st.push(st.valid_mask(idx), lane, idx, val);
            }
        }
    }
    st.flush();
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
    TWELLPY_SPMM_LIST_STORAGE(A);
    const long long warp = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (warp >= (long long)M * n_cb) return;
    const long long row = warp / n_cb;
    const int cb = (int)(warp - row * n_cb);
    SpmmLane<T, VEC, ITERS> st;
    st.B_ = B;
    st.init(cb, lane, K, N, s_list_idx[warp_in_block], s_list_val[warp_in_block]);
    const long long base = row * n_slots;
    for (int s0 = 0; s0 < n_slots; s0 += 32) {
        const int s = s0 + lane;
        int idx = -1;
        A val = A(0);
        if (s < n_slots) {
            idx = indices[base + s];
            if (idx >= 0) val = to_acc<A, T>(values[base + s]);
        }
        st.push(st.valid_mask(idx), lane, idx, val);
    }
    st.flush();
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
    TWELLPY_SPMM_LIST_STORAGE(A);
    const long long warp = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (warp >= (long long)R * n_cb) return;
    const long long row = warp / n_cb;
    const int cb = (int)(warp - row * n_cb);
    SpmmLane<T, VEC, ITERS> st;
    st.B_ = B;
    st.init(cb, lane, K, N, s_list_idx[warp_in_block], s_list_val[warp_in_block]);
    const long long start = indptr[row], end = indptr[row + 1];
    for (long long e0 = start; e0 < end; e0 += 32) {
        const long long e = e0 + lane;
        int idx = -1;
        A val = A(0);
        if (e < end) {
            idx = cols[e];
            val = to_acc<A, T>(data[e]);
        }
        st.push(st.valid_mask(idx), lane, idx, val);
    }
    st.flush();
    st.store(out, row);
}

// ===========================================================================
// Row-block gather SpMM for TwELL (the default path of twell_spmm).
//
// Why a second design: the warp-per-row kernels above keep at most
// SPMM_LOADS / ITERS entries in flight per lane and, under their launch
// bound, use enough registers to leave an SM only a dozen warps, so B rows
// are gathered from L2 at well under its bandwidth. Here a whole block owns
// (one row, one column block): its threads split the columns into NV strips
// of 16-byte vectors, the row's entries sit once in shared memory for every
// warp, and each thread keeps KB * NV independent 16-byte loads in flight,
// with the register budget fixed by SPMM_ROWS_MIN_BLOCKS blocks per SM.
// ===========================================================================
#ifndef SPMM_ROWS_THREADS
#define SPMM_ROWS_THREADS 128        // threads per block, exactly. twellpy always passes it (cuda._spmm_rows_defines,
#endif                               // the set the launch also takes its block size from); this default only
                                     // serves standalone compiles.
#ifndef SPMM_ROWS_MIN_BLOCKS
#define SPMM_ROWS_MIN_BLOCKS 8       // resident blocks per SM the register budget is sized for: 8 x 128
#endif                               // threads at 64 registers. Measured on the H200 (W1-16k h @ w_down):
                                     // 8 blocks x 4 loads in flight 0.26 ms, 3 blocks x 16 loads 0.39 ms --
                                     // more rows in flight beat more loads per thread.
#ifndef SPMM_ROWS_LIST
#define SPMM_ROWS_LIST 1024          // shared-memory list of (index, value); longer rows run in rounds
#endif

static_assert(SPMM_ROWS_THREADS % 32 == 0 && SPMM_ROWS_THREADS >= 32 && SPMM_ROWS_THREADS <= 1024,
              "SPMM_ROWS_THREADS must be a multiple of 32 in [32, 1024]");
static_assert(SPMM_ROWS_LIST >= SPMM_ROWS_THREADS && SPMM_ROWS_LIST % 32 == 0,
              "SPMM_ROWS_LIST must be a multiple of 32 and hold one entry per thread");

namespace twellpy_spmm_rows {
using namespace twellpy;

template <typename T, int VEC>
__device__ __forceinline__ vec_t<T, VEC> gather(const T* __restrict__ p) {
    return *reinterpret_cast<const vec_t<T, VEC>*>(p);
}

// Inclusive prefix sum over the block (NWARPS warps: the launch's blockDim.x
// / 32); `total` gets the block's sum. Two barriers; s_warp holds one int per
// warp. The warp count is a compile-time constant: with a run-time count the
// compiler read s_warp with vector loads past its end (found by memcheck at
// 64 threads, where s_warp has 2 entries and a 12-byte load read 3).
template <int NWARPS>
__device__ __forceinline__ int block_inclusive_sum(int v, int* s_warp, int& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    constexpr int nwarps = NWARPS;
    v = warp_inclusive_sum(v, lane);
    if (lane == 31) s_warp[warp] = v;
    __syncthreads();
    int before = 0;
    total = 0;
    for (int w = 0; w < nwarps; ++w) {
        const int t = s_warp[w];
        before += (w < warp) ? t : 0;
        total += t;
    }
    __syncthreads();  // s_warp may be rewritten by the next call
    return v + before;
}

// acc += sum over the n listed entries of val * B[idx, this thread's columns],
// KB entries at a time (every gather of a batch is issued before its FMAs).
// Entries are added in list order, so the result is bitwise reproducible.
template <typename T, int VEC, int NV, int KB>
__device__ __forceinline__ void accumulate_list(
        int n, const int* s_idx, const typename accum<T>::type* s_val,
        const T* __restrict__ B, int K, int col0,
        typename accum<T>::type (&acc)[NV][VEC]) {
    constexpr int stride = SPMM_ROWS_THREADS * VEC;  // compile time: strip offsets become immediates
    typedef typename accum<T>::type A;
    for (int b = 0; b < n; b += KB) {
        int jk[KB];
        A vk[KB];
#pragma unroll
        for (int k = 0; k < KB; ++k) {
            const int i = b + k;
            jk[k] = (i < n) ? s_idx[i] : -1;  // shared-memory broadcast
            vk[k] = (i < n) ? s_val[i] : A(0);
        }
        vec_t<T, VEC> w[KB][NV];
#pragma unroll
        for (int k = 0; k < KB; ++k) {
            const T* __restrict__ p = B + (long long)(jk[k] < 0 ? 0 : jk[k]) * K;
#pragma unroll
            for (int q = 0; q < NV; ++q) {
                const int c = col0 + q * stride;
                if (jk[k] >= 0 && c < K) {
                    w[k][q] = gather<T, VEC>(p + c);
                } else {
#pragma unroll
                    for (int e = 0; e < VEC; ++e) w[k][q].v[e] = zero_value<T>();
                }
            }
        }
#pragma unroll
        for (int k = 0; k < KB; ++k) {
            if (jk[k] < 0) continue;  // same entry in every thread: a uniform branch
#pragma unroll
            for (int q = 0; q < NV; ++q)
#pragma unroll
                for (int e = 0; e < VEC; ++e) acc[q][e] = fma(vk[k], to_acc<A, T>(w[k][q].v[e]), acc[q][e]);
        }
    }
}

}  // namespace twellpy_spmm_rows

// ---------------------------------------------------------------------------
// twellpy_twell_spmm_rows<T, VEC, NV, KB>: out = A @ B for TwELL A.
//   values   (M, n_tiles, S)   T      TwELL values
//   indices  (M, n_tiles, S)   int32  global column of A = row of B
//   counts   (M, n_tiles)      int32  stored entries per (row, tile), clamped to [0, S]
//   B        (N, K)            T      dense, C order
//   out      (M, K)            T      out (every element written)
// block = SPMM_ROWS_THREADS threads exactly (the strip stride is a compile-time
// constant); grid = (row blocks, n_cb); block (r, cb) computes rows r,
// r + gridDim.x, ... for the columns [cb * CBW, (cb + 1) * CBW),
// CBW = SPMM_ROWS_THREADS * VEC * NV. Thread t owns VEC consecutive columns in
// each of NV strips: col = cb * CBW + (q * SPMM_ROWS_THREADS + t) * VEC, q < NV.
// Per row: a block-wide prefix sum of the tile counts gives every stored slot
// its list position (tile order, then slot order); the entries are copied to
// a shared-memory list of SPMM_ROWS_LIST entries, in rounds when the row
// holds more; every thread then accumulates over the list. Slots whose index
// is outside [0, N) are skipped (listed as -1).
// VEC = 16 / sizeof(T) needs K % VEC == 0 and 16-byte aligned B / out;
// the launcher passes VEC = 1 otherwise.
// ---------------------------------------------------------------------------
template <typename T, int VEC, int NV, int KB>
__global__ void __launch_bounds__(SPMM_ROWS_THREADS, SPMM_ROWS_MIN_BLOCKS)
twellpy_twell_spmm_rows(const T* __restrict__ values, const int* __restrict__ indices,
                        const int* __restrict__ counts, const T* __restrict__ B, T* __restrict__ out,
                        int M, int n_tiles, int slots, int N, int K) {
    using namespace twellpy_spmm_rows;
    typedef typename accum<T>::type A;
    static_assert(NV >= 1 && KB >= 1, "bad tile constants");
    __shared__ int s_idx[SPMM_ROWS_LIST];
    __shared__ A s_val[SPMM_ROWS_LIST];
    __shared__ int s_warp[SPMM_ROWS_THREADS / 32];

    const int tid = threadIdx.x;
    constexpr int stride = SPMM_ROWS_THREADS * VEC;      // columns between a thread's strips
    const int col0 = blockIdx.y * stride * NV + tid * VEC;

    for (long long row = blockIdx.x; row < M; row += gridDim.x) {
        A acc[NV][VEC];
#pragma unroll
        for (int q = 0; q < NV; ++q)
#pragma unroll
            for (int e = 0; e < VEC; ++e) acc[q][e] = A(0);

        const long long crow = row * n_tiles;
        int fill = 0;  // entries in the list (the same in every thread)
        for (int t0 = 0; t0 < n_tiles; t0 += blockDim.x) {
            const int t = t0 + tid;
            const int cnt = (t < n_tiles) ? min(max(counts[crow + t], 0), slots) : 0;
            int total;
            const int incl = block_inclusive_sum<SPMM_ROWS_THREADS / 32>(cnt, s_warp, total);
            const int excl = incl - cnt;
            const long long base = (crow + t) * slots;
            // Entries [done, done + take) of this chunk of tiles go to the list
            // at fill; a full list is drained first.
            for (int done = 0; done < total;) {
                const int take = min(total - done, SPMM_ROWS_LIST - fill);
                const int lo = max(excl, done), hi = min(incl, done + take);
                for (int e = lo; e < hi; ++e) {
                    const int s = e - excl;
                    const int j = indices[base + s];
                    const int pos = fill + (e - done);
                    s_idx[pos] = (j >= 0 && j < N) ? j : -1;
                    s_val[pos] = to_acc<A, T>(values[base + s]);
                }
                fill += take;
                done += take;
                __syncthreads();  // list visible to every thread
                if (fill == SPMM_ROWS_LIST) {
                    accumulate_list<T, VEC, NV, KB>(fill, s_idx, s_val, B, K, col0, acc);
                    fill = 0;
                    __syncthreads();  // every thread is done reading before the list is rewritten
                }
            }
        }
        accumulate_list<T, VEC, NV, KB>(fill, s_idx, s_val, B, K, col0, acc);
        __syncthreads();  // the next row rewrites the list

        T* __restrict__ o = out + row * (long long)K;
#pragma unroll
        for (int q = 0; q < NV; ++q) {
            const int c = col0 + q * stride;
            if (c < K) {
                vec_t<T, VEC> w;
#pragma unroll
                for (int e = 0; e < VEC; ++e) w.v[e] = from_acc<T, A>(acc[q][e]);
                store_vec<T, VEC>(o + c, w);
            }
        }
    }
}
