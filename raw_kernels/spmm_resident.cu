// spmm_resident.cu -- sparse times dense with a column slice of B resident in shared memory.
//
// Why: the gather kernels of spmm.cu read one whole row of B from L2 for
// every stored entry of A (at W1-16k, h @ w_down moves ~2 GB through L2 for a
// 23 MB B) and run at the L2's gather ceiling. Here each block keeps
// B[:, slice] (N rows x CW columns, CW = LPR * 16 bytes) in shared memory and
// streams every row of A past it: B is read from DRAM/L2 once per (slice,
// row chunk), each entry of A once per slice, and the per-entry work reads 16
// bytes per lane from shared memory instead of L2.
//
// Layout of the work:
//   * grid = (ceil(K / CW), row chunks); block (s, c) computes out[rows of
//     chunk c, columns of slice s];
//   * a warp owns RPW = 32 / LPR consecutive rows at a time; lane l works on
//     row l / LPR and on the 16-byte column vector l % LPR of the slice;
//   * the warp's rows are consecutive, so their entries are one contiguous
//     range of the compacted A: the warp copies it (coalesced) into its own
//     shared-memory stage, RES_STAGE entries at a time, and every lane then
//     runs over its row's entries in the stage;
//   * accumulation in fp32 (fp64 for fp64) registers, entries summed in their
//     stored order with fma: the same operations in the same order as the
//     gather kernels, so the result has the same bits.
//
// A is given compacted (CSR order): indptr (M+1) int64, cols (nnz) int32,
// vals (nnz) V. twellpy_twell_row_totals + a prefix sum + twellpy_twell_compact
// build that from TwELL without a host synchronisation; the fused FFN's split
// mode (ffn_sparse.cu, SPLIT) writes its h that way (V = float). Entries whose
// column is outside [0, N) are skipped (the gather kernels skip them too).
#include "common.cuh"

#ifndef RES_THREADS
#define RES_THREADS 512          // threads per block, exactly (one block per SM: shared memory bound)
#endif
#ifndef RES_STAGE
#define RES_STAGE 256            // entries of A staged per warp at a time
#endif
#ifndef COMPACT_WARPS
#define COMPACT_WARPS 8          // warps per block of the compaction kernels
#endif

static_assert(RES_THREADS % 32 == 0 && RES_THREADS >= 32 && RES_THREADS <= 1024,
              "RES_THREADS must be a multiple of 32 in [32, 1024]");
static_assert(RES_STAGE % 32 == 0 && RES_STAGE >= 32, "RES_STAGE must be a positive multiple of 32");
static_assert(COMPACT_WARPS >= 1 && COMPACT_WARPS <= 32, "COMPACT_WARPS out of range");

using namespace twellpy;

// ---------------------------------------------------------------------------
// twellpy_twell_row_totals: stored entries per row of a TwELL matrix.
//   counts   (M, n_tiles)   int32  entries per (row, tile); clamped to [0, S] as every reader does
//   totals   (M+1,)         int64  out: totals[0] = 0, totals[r + 1] = entries of row r
//                                  (an inclusive prefix sum then turns it into indptr)
// One warp per row; grid.x = ceil(M / COMPACT_WARPS), block = 32 * COMPACT_WARPS.
// ---------------------------------------------------------------------------
__global__ void __launch_bounds__(COMPACT_WARPS * 32)
twellpy_twell_row_totals(const int* __restrict__ counts, long long* __restrict__ totals,
                         int M, int n_tiles, int slots) {
    const long long row = (long long)blockIdx.x * COMPACT_WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row == 0 && lane == 0) totals[0] = 0;
    if (row >= M) return;
    int sum = 0;  // <= n_tiles * slots, checked to fit an int32 by the launcher
    for (int t = lane; t < n_tiles; t += 32) sum += min(max(counts[row * n_tiles + t], 0), slots);
    sum = warp_sum(sum);
    if (lane == 0) totals[row + 1] = sum;
}

// ---------------------------------------------------------------------------
// twellpy_list_indptr: row starts of the compacted h of the fused FFN's split mode.
//   row_count (M,)    int32  active neurons per row (twellpy_ffn_rowpack)
//   indptr    (M+1,)  int64  out: indptr[0] = 0, indptr[r + 1] = indptr[r] + (row_count[r] <= cap ?
//                            row_count[r] : 0) (rows over cap are computed whole by the fused kernel)
// One block of 32 * COMPACT_WARPS threads; chunks of LIST_ITEMS consecutive rows
// per thread, a block prefix sum per chunk, carried in order (deterministic).
// ---------------------------------------------------------------------------
#ifndef LIST_ITEMS
#define LIST_ITEMS 8
#endif
__global__ void __launch_bounds__(COMPACT_WARPS * 32)
twellpy_list_indptr(const int* __restrict__ row_count, long long* __restrict__ indptr, int M, int cap) {
    __shared__ int s_warp[COMPACT_WARPS];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    constexpr int CHUNK = COMPACT_WARPS * 32 * LIST_ITEMS;
    long long carry = 0;
    if (tid == 0) indptr[0] = 0;
    for (long long r0 = 0; r0 < M; r0 += CHUNK) {
        const long long first = r0 + (long long)tid * LIST_ITEMS;
        int v[LIST_ITEMS];
        int mine = 0;
#pragma unroll
        for (int i = 0; i < LIST_ITEMS; ++i) {
            const int c = (first + i < M) ? row_count[first + i] : 0;
            v[i] = (c >= 0 && c <= cap) ? c : 0;
            mine += v[i];   // <= LIST_ITEMS * cap: an int
        }
        const int incl = warp_inclusive_sum(mine, lane);
        if (lane == 31) s_warp[warp] = incl;
        __syncthreads();
        long long before = 0, total = 0;
        for (int w = 0; w < COMPACT_WARPS; ++w) {
            before += (w < warp) ? s_warp[w] : 0;
            total += s_warp[w];
        }
        long long pos = carry + before + (incl - mine);
#pragma unroll
        for (int i = 0; i < LIST_ITEMS; ++i) {
            pos += v[i];
            if (first + i < M) indptr[first + i + 1] = pos;
        }
        carry += total;
        __syncthreads();  // s_warp is rewritten by the next chunk
    }
}

// ---------------------------------------------------------------------------
// twellpy_twell_compact<T>: TwELL -> compacted rows (CSR order: tile order, then slot order).
//   values   (M, n_tiles, S)   T      TwELL values
//   indices  (M, n_tiles, S)   int32  global columns
//   counts   (M, n_tiles)      int32  entries per (row, tile), clamped to [0, S]
//   indptr   (M+1,)            int64  row starts (prefix sum of twellpy_twell_row_totals)
//   cols     (nnz,)            int32  out: column, or -1 where the stored index is outside [0, N)
//   vals     (nnz,)            T      out
// One warp per row; tiles 32 at a time: lane t takes tile t0 + t, a warp prefix
// sum of the tile counts gives its first position, and the lane copies the
// tile's entries. grid.x = ceil(M / COMPACT_WARPS).
// ---------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(COMPACT_WARPS * 32)
twellpy_twell_compact(const T* __restrict__ values, const int* __restrict__ indices,
                      const int* __restrict__ counts, const long long* __restrict__ indptr,
                      int* __restrict__ cols, T* __restrict__ vals, int M, int n_tiles, int slots, int N) {
    const long long row = (long long)blockIdx.x * COMPACT_WARPS + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= M) return;  // uniform over the warp
    long long pos = indptr[row];
    for (int t0 = 0; t0 < n_tiles; t0 += 32) {
        const int t = t0 + lane;
        const int cnt = (t < n_tiles) ? min(max(counts[row * n_tiles + t], 0), slots) : 0;
        const int incl = warp_inclusive_sum(cnt, lane);
        const long long src = (row * n_tiles + t) * (long long)slots;
        const long long dst = pos + (incl - cnt);
        for (int s = 0; s < cnt; ++s) {
            const int j = indices[src + s];
            cols[dst + s] = (j >= 0 && j < N) ? j : -1;
            vals[dst + s] = values[src + s];
        }
        pos += __shfl_sync(FULL_MASK, incl, 31);
    }
}

// ---------------------------------------------------------------------------
// twellpy_spmm_resident<T, V, LPR>: out = A @ B, B[:, slice] resident in shared memory.
//   indptr    (M+1,)   int64  row starts of the compacted A
//   cols      (nnz,)   int32  column of A = row of B; entries outside [0, N) are skipped
//   vals      (nnz,)   V      values of A (T, or the accumulator type)
//   row_count (M,)     int32  optional (null: every row): rows with row_count > row_cap are
//                             not stored (the fused FFN computed them whole)
//   B         (N, K)   T      dense, C order, 16-byte aligned, K % VEC == 0 (VEC = 16 / sizeof(T))
//   out       (M, K)   T      out: rows [chunk * rows_per_block, ...) x the slice's columns
// grid = (ceil(K / (LPR * VEC)), ceil(M / rows_per_block)), block = RES_THREADS.
// Dynamic shared memory (bytes): N * LPR * 16 + (RES_THREADS / 32) * RES_STAGE * (4 + sizeof(acc)),
// acc = double for double data, float otherwise; the launcher raises the block's limit to it.
// ---------------------------------------------------------------------------
template <typename T, typename V, int LPR>
__global__ void __launch_bounds__(RES_THREADS, 1)
twellpy_spmm_resident(const long long* __restrict__ indptr, const int* __restrict__ cols,
                      const V* __restrict__ vals, const int* __restrict__ row_count, int row_cap,
                      const T* __restrict__ B, T* __restrict__ out, int M, int N, int K, int rows_per_block) {
    typedef typename accum<T>::type A;
    constexpr int VEC = 16 / (int)sizeof(T);
    constexpr int RPW = 32 / LPR;               // rows per warp pass
    constexpr int NWARPS = RES_THREADS / 32;
    static_assert(LPR == 1 || LPR == 2 || LPR == 4, "LPR must be 1, 2 or 4");

    extern __shared__ uint4 smem[];
    uint4* s_B = smem;                                                  // N * LPR vectors
    int* s_col = reinterpret_cast<int*>(s_B + (long long)N * LPR);       // NWARPS * RES_STAGE
    A* s_val = reinterpret_cast<A*>(s_col + NWARPS * RES_STAGE);         // NWARPS * RES_STAGE (16-byte aligned)

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const long long col0 = (long long)blockIdx.x * (LPR * VEC);  // first column of this slice

    // 1) the slice of B, zero beyond column K (never stored: see the final store)
    const int n_vec = N * LPR;
    for (int i = tid; i < n_vec; i += RES_THREADS) {
        const int n = i / LPR, p = i - n * LPR;
        const long long c = col0 + p * VEC;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (c < K) v = __ldg(reinterpret_cast<const uint4*>(B + (long long)n * K + c));
        s_B[i] = v;
    }
    __syncthreads();  // the only block-wide barrier: from here on every warp works alone

    // 2) rows of this chunk, RPW per warp at a time
    const long long r_begin = (long long)blockIdx.y * rows_per_block;
    const long long r_end = min((long long)M, r_begin + rows_per_block);
    int* w_col = s_col + warp * RES_STAGE;
    A* w_val = s_val + warp * RES_STAGE;
    const int sub = lane / LPR, part = lane - sub * LPR;
    for (long long g0 = r_begin + (long long)warp * RPW; g0 < r_end; g0 += (long long)NWARPS * RPW) {
        const long long g1 = min(g0 + RPW, r_end);
        const long long row = g0 + sub;
        const bool has_row = row < g1;
        const long long e_lo = indptr[g0], e_hi = indptr[g1];   // the same in every lane
        const long long my_lo = has_row ? indptr[row] : e_hi;
        const long long my_hi = has_row ? indptr[row + 1] : e_hi;
        A acc[VEC];
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc[k] = A(0);
        for (long long w0 = e_lo; w0 < e_hi; w0 += RES_STAGE) {   // uniform loop
            const int n_in = (int)min((long long)RES_STAGE, e_hi - w0);
#pragma unroll
            for (int j = 0; j < RES_STAGE / 32; ++j) {   // independent coalesced loads
                const int i = j * 32 + lane;
                if (i < n_in) {
                    const int c = cols[w0 + i];
                    w_col[i] = (c >= 0 && c < N) ? c : -1;
                    w_val[i] = to_acc<A, V>(vals[w0 + i]);
                }
            }
            __syncwarp();  // the stage is visible to the whole warp
            const int a = (int)(max(my_lo, w0) - w0);
            const int b = (int)(min(my_hi, w0 + n_in) - w0);
            for (int e = a; e < b; ++e) {   // this lane's row, in stored order
                const int c = w_col[e];
                if (c < 0) continue;
                const A v = w_val[e];
                const uint4 wv = s_B[c * LPR + part];
                const T* we = reinterpret_cast<const T*>(&wv);
#pragma unroll
                for (int k = 0; k < VEC; ++k) acc[k] = fma(v, to_acc<A, T>(we[k]), acc[k]);
            }
            __syncwarp();  // every lane is done with the stage before it is refilled
        }
        const long long c = col0 + part * VEC;
        // K % VEC == 0: the whole vector is inside the row
        if (has_row && c < K && (row_count == nullptr || row_count[row] <= row_cap)) {
            vec_t<T, VEC> o;
#pragma unroll
            for (int k = 0; k < VEC; ++k) o.v[k] = from_acc<T, A>(acc[k]);
            store_vec<T, VEC>(out + row * (long long)K + c, o);
        }
    }
}
