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
//   * the warp copies the next entries of each of its rows into its own
//     shared-memory stage (each row its own slots), and every lane then runs
//     over its row's slots; rounds repeat until the warp's longest row is done;
//   * accumulation in fp32 (fp64 for fp64) registers, entries summed in their
//     stored order with fma: the same operations in the same order as the
//     gather kernels, so the result has the same bits.
//
// A is given as rows of (column, value) entries: compacted in CSR order
// (indptr (M+1) int64; twellpy_twell_row_totals + a prefix sum +
// twellpy_twell_compact build that from TwELL without a host synchronisation),
// or as per-row lists of fixed capacity (the fused FFN's split mode, whose h
// overwrites the gate values of its row lists: V = float). Entries whose column
// is outside [0, N) are skipped (the gather kernels skip them too).
#include "common.cuh"

#ifndef RES_THREADS
#define RES_THREADS 512          // threads per block, exactly (one block per SM: shared memory bound)
#endif
#ifndef RES_STAGE
#define RES_STAGE 256            // entries of A staged per warp and round (a multiple of 32)
#endif
#ifndef COMPACT_WARPS
#define COMPACT_WARPS 8          // warps per block of the TwELL compaction kernels
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
// twellpy_spmm_resident<T, V, LPR, LISTS>: out = A @ B, B[:, slice] resident in shared memory.
//   LISTS = false (compacted rows, CSR order):
//     indptr    (M+1,)     int64  row r's entries are [indptr[r], indptr[r+1])
//   LISTS = true (the fused FFN's per-row lists, split mode):
//     row_count (M,)       int32  row r's entries are [r * stride, r * stride + row_count[r]);
//                                 rows with row_count outside [0, row_cap] are not stored at all
//                                 (the fused kernel computed them whole, or the host does)
//   cols      (entries)  int32  column of A = row of B; entries outside [0, N) are skipped
//   vals      (entries)  V      values of A (T, or the accumulator type)
//   B         (N, K)     T      dense, C order, 16-byte aligned, K % VEC == 0 (VEC = 16 / sizeof(T))
//   out       (M, K)     T      out: rows [chunk * rows_per_block, ...) x the slice's columns
//   vals2, B2                   DUAL only (else null): a second value per entry and a second dense
//                               operand of B's shape: out = A @ B + A2 @ B2, the two products of
//                               each entry added in that order (the training backward's
//                               dx = du @ w_up + dg @ w_gate)
//   vals2                       PROD only (B2 null): an entry's value is vals * vals2 rounded to T,
//                               as the gated training forward's h = g * u (V = T)
// grid = (ceil(K / (LPR * VEC)), ceil(M / rows_per_block)), block = RES_THREADS.
// Dynamic shared memory (bytes): NB * N * LPR * 16 + (RES_THREADS / 32) * 32 * 12
// + (RES_THREADS / 32) * (RES_STAGE + 32) * (4 + NB * sizeof(acc)), NB = 2 with DUAL else 1,
// acc = double for double data, float otherwise; the launcher raises the block's limit to it.
//
// Each of a warp's RPW rows owns SLOTS = RES_STAGE / RPW consecutive stage entries
// (padded to SLOTS + 1, so the rows' entries fall in different banks); the warp
// refills every row's slots together, SLOTS entries of each row per round, for as
// many rounds as its longest row needs, so every lane works in every round.
// ---------------------------------------------------------------------------
template <typename T, typename V, int LPR, bool LISTS, bool DUAL = false, bool PROD = false>
__global__ void __launch_bounds__(RES_THREADS, 1)
twellpy_spmm_resident(const long long* __restrict__ indptr, const int* __restrict__ row_count, int stride,
                      int row_cap, const int* __restrict__ cols, const V* __restrict__ vals,
                      const T* __restrict__ B, T* __restrict__ out, int M, int N, int K, int rows_per_block,
                      const V* __restrict__ vals2, const T* __restrict__ B2) {
    typedef typename accum<T>::type A;
    constexpr int VEC = 16 / (int)sizeof(T);
    constexpr int RPW = 32 / LPR;               // rows per warp pass
    constexpr int SLOTS = RES_STAGE / RPW;      // stage entries per row and round
    constexpr int ROW_STRIDE = SLOTS + 1;       // padded: rows start in different banks
    constexpr int STAGE = RPW * ROW_STRIDE;     // <= RES_STAGE + 32
    constexpr int NWARPS = RES_THREADS / 32;
    static_assert(LPR == 1 || LPR == 2 || LPR == 4, "LPR must be 1, 2 or 4");
    static_assert(SLOTS >= 1 && RES_STAGE % RPW == 0, "RES_STAGE must be a multiple of the rows per warp");
    static_assert(!(DUAL && PROD), "DUAL and PROD both use vals2");

    extern __shared__ uint4 smem[];
    constexpr int NB = DUAL ? 2 : 1;
    uint4* s_B = smem;                                                      // N * LPR vectors
    uint4* s_B2 = s_B + (long long)N * LPR;                                 // DUAL: N * LPR more
    long long* s_start = reinterpret_cast<long long*>(s_B + (long long)NB * N * LPR);   // NWARPS * 32
    int* s_len = reinterpret_cast<int*>(s_start + NWARPS * 32);                   // NWARPS * 32
    int* s_col = s_len + NWARPS * 32;                                            // NWARPS * (RES_STAGE + 32)
    A* s_val = reinterpret_cast<A*>(s_col + NWARPS * (RES_STAGE + 32));          // 16-byte aligned (see plan)
    A* s_val2 = s_val + NWARPS * (RES_STAGE + 32);                               // DUAL only

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const long long col0 = (long long)blockIdx.x * (LPR * VEC);  // first column of this slice

    // 1) the slice of B, zero beyond column K (never stored: see the final store)
    const int n_vec = N * LPR;
    for (int i = tid; i < n_vec; i += RES_THREADS) {
        const int n = i / LPR, p = i - n * LPR;
        const long long c = col0 + p * VEC;
        uint4 v = make_uint4(0u, 0u, 0u, 0u), v2 = v;
        if (c < K) {
            v = __ldg(reinterpret_cast<const uint4*>(B + (long long)n * K + c));
            if (DUAL) v2 = __ldg(reinterpret_cast<const uint4*>(B2 + (long long)n * K + c));
        }
        s_B[i] = v;
        if (DUAL) s_B2[i] = v2;
    }
    __syncthreads();  // the only block-wide barrier: from here on every warp works alone

    // 2) rows of this chunk, RPW per warp at a time
    const long long r_begin = (long long)blockIdx.y * rows_per_block;
    const long long r_end = min((long long)M, r_begin + rows_per_block);
    long long* w_start = s_start + warp * 32;
    int* w_len = s_len + warp * 32;
    int* w_col = s_col + warp * (RES_STAGE + 32);
    A* w_val = s_val + warp * (RES_STAGE + 32);
    A* w_val2 = s_val2 + warp * (RES_STAGE + 32);
    const int sub = lane / LPR, part = lane - sub * LPR;
    for (long long g0 = r_begin + (long long)warp * RPW; g0 < r_end; g0 += (long long)NWARPS * RPW) {
        const long long row = g0 + sub;
        // this lane's row: first entry and length (-1: not stored; no entries)
        long long start = 0;
        int len = -1;
        if (row < r_end) {
            if (LISTS) {
                const int cnt = row_count[row];
                if (cnt >= 0 && cnt <= row_cap) {
                    start = row * (long long)stride;
                    len = cnt;
                }
            } else {
                start = indptr[row];
                len = (int)(indptr[row + 1] - start);
            }
        }
        if (part == 0) {
            w_start[sub] = start;
            w_len[sub] = len;
        }
        const int longest = warp_max(len);   // the same in every lane
        __syncwarp();                        // w_start / w_len visible to the warp
        A acc[VEC];
#pragma unroll
        for (int k = 0; k < VEC; ++k) acc[k] = A(0);
        for (int off = 0; off < longest; off += SLOTS) {   // uniform loop
            // stage SLOTS entries of every row: entry e of the round is slot e % SLOTS of row e / SLOTS
#pragma unroll
            for (int i = 0; i < RES_STAGE / 32; ++i) {
                const int e = i * 32 + lane;
                const int j = e / SLOTS, s = e - j * SLOTS;
                if (off + s < w_len[j]) {
                    const long long src = w_start[j] + off + s;
                    const int c = cols[src];
                    w_col[j * ROW_STRIDE + s] = (c >= 0 && c < N) ? c : -1;
                    if (PROD)   // h = g * u rounded to T, then widened (the training forward's h)
                        w_val[j * ROW_STRIDE + s] =
                            to_acc<A, T>(from_acc<T, A>(to_acc<A, V>(vals[src]) * to_acc<A, V>(vals2[src])));
                    else
                        w_val[j * ROW_STRIDE + s] = to_acc<A, V>(vals[src]);
                    if (DUAL) w_val2[j * ROW_STRIDE + s] = to_acc<A, V>(vals2[src]);
                }
            }
            __syncwarp();  // the stage is visible to the whole warp
            const int n_mine = min(SLOTS, len - off);   // <= 0 for rows already done or not stored
            for (int s = 0; s < n_mine; ++s) {           // this lane's row, in stored order
                const int c = w_col[sub * ROW_STRIDE + s];
                if (c < 0) continue;
                const A v = w_val[sub * ROW_STRIDE + s];
                const uint4 wv = s_B[c * LPR + part];
                const T* we = reinterpret_cast<const T*>(&wv);
#pragma unroll
                for (int k = 0; k < VEC; ++k) acc[k] = fma(v, to_acc<A, T>(we[k]), acc[k]);
                if (DUAL) {
                    const A v2 = w_val2[sub * ROW_STRIDE + s];
                    const uint4 wv2 = s_B2[c * LPR + part];
                    const T* we2 = reinterpret_cast<const T*>(&wv2);
#pragma unroll
                    for (int k = 0; k < VEC; ++k) acc[k] = fma(v2, to_acc<A, T>(we2[k]), acc[k]);
                }
            }
            __syncwarp();  // every lane is done with the stage before it is refilled
        }
        const long long c = col0 + part * VEC;
        if (len >= 0 && c < K) {   // K % VEC == 0: the whole vector is inside the row
            vec_t<T, VEC> o;
#pragma unroll
            for (int k = 0; k < VEC; ++k) o.v[k] = from_acc<T, A>(acc[k]);
            store_vec<T, VEC>(out + row * (long long)K + c, o);
        }
        __syncwarp();  // w_start / w_len are rewritten by the next pass
    }
}
