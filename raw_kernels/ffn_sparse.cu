// ffn_sparse.cu -- fused sparse up/down projection of a ReLU (gated or plain) FFN.
//
// The dense gate GEMM has already produced g = x @ w_gate.T (gated FFN) or
// g = x @ w_up.T (plain ReLU FFN). For every token (row) this kernel
//   1. scans the row of g once and compacts the active neurons (relu_active:
//      g > 0 or NaN) into a shared-memory list in column order, with a
//      deterministic block-wide prefix count (no atomics);
//   2. for the active neurons only, computes the up-projection dot product
//      u_j = x . w_up[j] (gated FFN), h_j = g_j * u_j (or h_j = g_j), and the
//      down-projection axpy y += h_j * w_down[:, j], reading the transposed
//      down weights w_downT[j] = w_down[:, j] as one contiguous row.
// h never goes to DRAM (unless the caller asks for it through h_out).
// Accumulation is fp32 (fp64 for double data); the summation order is fixed,
// so the same input always gives the same bits.
//
// Any number of active neurons per row is exact: the shared-memory list is
// processed and refilled as often as needed. Optionally (heavy_limit <=
// FFN_LIST_CAP) rows with more active neurons are skipped and flagged in
// heavy[], and the host recomputes them with a dense sub-FFN.
//
// Work layout: one block (NWARPS = blockDim.x / 32 warps) per token at a time
// (grid-stride over rows). D is cut into 16-byte vectors; thread t owns vectors
// t, t + blockDim.x, ... (NV of them), so x and the y accumulators live in
// registers and every weight-row load is coalesced and 16 bytes wide. KB
// neurons are in flight at once (2*KB*NV independent 16-byte loads per thread:
// the up and the down rows of the batch are gathered together).
#include "common.cuh"

#ifndef FFN_MAX_WARPS
#define FFN_MAX_WARPS 8
#endif
// Resident blocks per SM the register budget is sized for (launch bound).
// 1 lets the compiler use up to 255 registers a thread; at FFN_MAX_WARPS 8 a
// value of 2 caps it at 128, 3 at 80. Measured on the H200 (W1-16k, bf16,
// 4-warp blocks, 2026-12-03): 2 gave 1.163-1.180 ms per FFN against
// 1.271-1.291 ms for 1 (4 resident blocks instead of 3 per SM).
// twellpy always passes it (cuda_ffn.DEFAULT_MIN_BLOCKS, or 1 for NV = 8: see
// cuda_ffn._default_min_blocks); this default only serves standalone compiles
// (tests/test_registry.py checks that it equals DEFAULT_MIN_BLOCKS).
#ifndef FFN_MIN_BLOCKS
#define FFN_MIN_BLOCKS 2
#endif
#ifndef FFN_LIST_CAP
#define FFN_LIST_CAP 2048
#endif
// 1: gather weight rows with an L2 evict_last cache policy (they are the hot
// set; x, g and y stream with evict-first hints). 0: plain read-only loads.
#ifndef FFN_L2_EVICT_LAST
#define FFN_L2_EVICT_LAST 0
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#undef FFN_L2_EVICT_LAST
#define FFN_L2_EVICT_LAST 0  // L2 cache policies are sm_80+: plain read-only loads there
#endif

namespace twellpy_ffn {
using namespace twellpy;

template <typename A> __device__ __forceinline__ bool active_acc(A v) { return !(v <= A(0)); }

__device__ __forceinline__ uint4 zero4() { return make_uint4(0u, 0u, 0u, 0u); }

__device__ __forceinline__ unsigned long long weight_policy() {
    unsigned long long p = 0;
#if FFN_L2_EVICT_LAST
    asm("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(p));
#endif
    return p;
}

// 16-byte read-only load of a weight row vector.
__device__ __forceinline__ uint4 load_weight(const uint4* ptr, unsigned long long policy) {
#if FFN_L2_EVICT_LAST
    uint4 r;
    asm("ld.global.nc.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(ptr), "l"(policy));
    return r;
#else
    (void)policy;
    return __ldg(ptr);
#endif
}


// Issue the 16-byte loads of the KB weight rows jk[] (row stride D; -1: none, zeros)
// that thread tid owns (vectors tid, tid + blockDim.x, ...), all before any is used.
template <typename T, int NV, int KB>
__device__ __forceinline__ void gather_rows(const T* __restrict__ w, const int (&jk)[KB], uint4 (&out)[KB][NV],
                                            int D, int DV, int tid, unsigned long long policy) {
#pragma unroll
    for (int k = 0; k < KB; ++k) {
        const uint4* wr = reinterpret_cast<const uint4*>(w + (long long)(jk[k] < 0 ? 0 : jk[k]) * D);
#pragma unroll
        for (int q = 0; q < NV; ++q) {
            const int v = q * blockDim.x + tid;
            out[k][q] = (jk[k] >= 0 && v < DV) ? load_weight(wr + v, policy) : zero4();
        }
    }
}

// acc += hk[k] * row k, k in order, one explicit fma an element: every kernel that
// adds a row's down projection spells it this way, so they all give the same bits.
template <typename T, typename A, int NV, int KB>
__device__ __forceinline__ void axpy_rows(const int (&jk)[KB], const A (&hk)[KB], const uint4 (&dv)[KB][NV],
                                          A (&acc)[NV][vec_of<T>::n]) {
#pragma unroll
    for (int k = 0; k < KB; ++k) {
        if (jk[k] < 0) continue;  // padding entries of the last batch add nothing
#pragma unroll
        for (int q = 0; q < NV; ++q) {
            A wa[vec_of<T>::n];
            unpack16<T, A>(dv[k][q], wa);
#pragma unroll
            for (int i = 0; i < vec_of<T>::n; ++i) acc[q][i] = fma(hk[k], wa[i], acc[q][i]);
        }
    }
}

// Round the thread's accumulators of one output row to T and store them (streaming).
template <typename T, typename A, int NV>
__device__ __forceinline__ void store_row(T* __restrict__ y_row, const A (&acc)[NV][vec_of<T>::n], int DV,
                                          int tid) {
    uint4* yv = reinterpret_cast<uint4*>(y_row);
#pragma unroll
    for (int q = 0; q < NV; ++q) {
        const int v = q * blockDim.x + tid;
        if (v < DV) {
            uint4 out;
            T* e = reinterpret_cast<T*>(&out);
#pragma unroll
            for (int i = 0; i < vec_of<T>::n; ++i) e[i] = twellpy::from_acc<T, A>(acc[q][i]);
            __stcs(yv + v, out);
        }
    }
}

// Up dot products and down axpys for the n listed neurons of one row.
// Every thread of the block calls it with the same n; ends with a barrier so
// the caller may rewrite the list. DOWN = false (split mode, list rows) skips
// the down projection: the row's h values go to hc_vals (the row's list
// values, whose gate values were already read) for twellpy_spmm_resident.
template <typename T, int NV, int KB, bool GATED, bool WRITE_H, bool DOWN = true>
__device__ __forceinline__ void process_list(
        int n, const int* s_idx, const typename twellpy::accum<T>::type* s_gval,
        typename twellpy::accum<T>::type (*s_red)[FFN_MAX_WARPS][KB], int& parity,
        const uint4 (&xr)[NV], typename twellpy::accum<T>::type (&acc)[NV][vec_of<T>::n],
        const T* __restrict__ w_up, const T* __restrict__ w_downT, T* __restrict__ h_row,
        int D, int DV, int tid, int lane, int warp, int nwarps,
        typename twellpy::accum<T>::type* __restrict__ hc_vals = nullptr) {
    typedef typename twellpy::accum<T>::type A;
    constexpr int VEC = vec_of<T>::n;
    const unsigned long long policy = weight_policy();
    for (int b = 0; b < n; b += KB) {
        int jk[KB];
        A hk[KB];
#pragma unroll
        for (int k = 0; k < KB; ++k) {
            const int i = b + k;
            jk[k] = (i < n) ? s_idx[i] : -1;
            hk[k] = (i < n) ? s_gval[i] : A(0);
        }
        // Issue every gather of the batch before using any of them: the down
        // rows do not depend on h, so one L2 round trip serves both.
        uint4 dv[KB][NV];
        if (DOWN) gather_rows<T, NV, KB>(w_downT, jk, dv, D, DV, tid, policy);
        if (GATED) {
            uint4 wv[KB][NV];
            gather_rows<T, NV, KB>(w_up, jk, wv, D, DV, tid, policy);
            A part[KB];
#pragma unroll
            for (int k = 0; k < KB; ++k) {
                A s = A(0);
#pragma unroll
                for (int q = 0; q < NV; ++q) {
                    A xa[VEC], wa[VEC];
                    unpack16<T, A>(xr[q], xa);
                    unpack16<T, A>(wv[k][q], wa);
#pragma unroll
                    for (int i = 0; i < VEC; ++i) s += xa[i] * wa[i];
                }
                part[k] = warp_total(s);
            }
            if (lane == 0) {
#pragma unroll
                for (int k = 0; k < KB; ++k) s_red[parity][warp][k] = part[k];
            }
            // One barrier per batch: s_red is double-buffered, so a fast warp
            // writing batch b+1 cannot clobber what a slow warp still reads for
            // batch b (it would have to pass batch b+1's barrier first).
            __syncthreads();
#pragma unroll
            for (int k = 0; k < KB; ++k) {
                A u = A(0);
                for (int w = 0; w < nwarps; ++w) u += s_red[parity][w][k];
                hk[k] = (jk[k] >= 0) ? hk[k] * u : A(0);
            }
            parity ^= 1;
        }
        if (WRITE_H && tid == 0) {
#pragma unroll
            for (int k = 0; k < KB; ++k)
                if (jk[k] >= 0) h_row[jk[k]] = twellpy::from_acc<T, A>(hk[k]);
        }
        if (!DOWN) {
            // thread k stores entry b + k (h unrounded, as the down axpy would use it)
#pragma unroll
            for (int k = 0; k < KB; ++k)
                if (tid == k && jk[k] >= 0) hc_vals[b + k] = hk[k];
            continue;
        }
        axpy_rows<T, A, NV, KB>(jk, hk, dv, acc);  // explicit fma: split and two-pass modes' bits
    }
    __syncthreads();  // the caller rewrites the list next
}

}  // namespace twellpy_ffn

// twellpy_ffn_sparse<T, NV, KB, GATED, WRITE_H>
//   x        (M, D)   row stride ldx   token activations
//   g        (M, H)   row stride ldg   gate pre-activation (x @ w_gate.T or x @ w_up.T)
//   w_up     (H, D)   contiguous       up weights (read only when GATED)
//   w_downT  (H, D)   contiguous       w_down transposed: row j is w_down[:, j]
//   y        (M, D)   row stride ldy   output (rows marked heavy, and long rows under
//                                      long_rows, are left untouched)
//   h_out    (M, H)   row stride ldh   optional (WRITE_H): h written at active positions only
//   list_idx (M, capr) int32           optional (row_count != null): per-row list of active
//   list_val (M, capr) accum type      neurons and gate values from twellpy_ffn_rowpack
//   row_count (M,)    int32            true active count; rows with count <= capr use the list,
//                                      other rows scan g themselves
//   heavy    (M,)     int32            1 for rows with more than heavy_limit active neurons, else 0
//   counters (2,)     uint64           [0] += active neurons seen, [1] += heavy rows
// heavy_limit: a value <= FFN_LIST_CAP enables the heavy-row hand-off to the
// host; 0x7fffffff disables it (every row is computed here, the list being
// processed and refilled as often as needed).
// long_rows != 0 (with row lists): rows with row_count > capr are skipped (y left
// untouched, not flagged heavy; counted in counters[0]): ffn_long.cu computes them.
// SPLIT = true: rows served by a row list (row_count <= capr and <= heavy_limit)
// get their up projection only: h overwrites the gate values in list_val and
// their y rows are left to twellpy_spmm_resident (spmm_resident.cu, LISTS),
// which adds the down projection from a shared-memory slice of w_downT. Other
// rows are computed whole here, as without SPLIT.
// Requirements (checked on the host): D % (16/sizeof(T)) == 0, H % (16/sizeof(T)) == 0,
// 16-byte aligned rows, NV * blockDim.x * (16/sizeof(T)) >= D, blockDim.x a multiple of 32
// and <= 32 * FFN_MAX_WARPS.
template <typename T, int NV, int KB, bool GATED, bool WRITE_H, bool SPLIT = false>
__global__ void __launch_bounds__(FFN_MAX_WARPS * 32, FFN_MIN_BLOCKS)
twellpy_ffn_sparse(const T* __restrict__ x, long long ldx,
                   const T* __restrict__ g, long long ldg,
                   const T* __restrict__ w_up,
                   const T* __restrict__ w_downT,
                   T* __restrict__ y, long long ldy,
                   T* __restrict__ h_out, long long ldh,
                   const int* __restrict__ list_idx,
                   typename twellpy::accum<T>::type* __restrict__ list_val,  // h written back (SPLIT)
                   const int* __restrict__ row_count, int capr,
                   int* __restrict__ heavy, unsigned long long* __restrict__ counters,
                   int M, int D, int H, int heavy_limit, int long_rows) {
    using namespace twellpy_ffn;
    typedef typename twellpy::accum<T>::type A;
    constexpr int VEC = vec_of<T>::n;
    static_assert(VEC * FFN_MAX_WARPS * 32 <= FFN_LIST_CAP, "one scan step must fit in the list");
    static_assert(NV >= 1 && KB >= 1, "bad tile constants");

    __shared__ int s_idx[FFN_LIST_CAP];
    __shared__ A s_gval[FFN_LIST_CAP];
    __shared__ A s_red[2][FFN_MAX_WARPS][KB];
    __shared__ int s_warp_tot[FFN_MAX_WARPS];

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int nwarps = blockDim.x >> 5;
    const int DV = D / VEC;            // 16-byte vectors per row of x / weights
    const int step = blockDim.x * VEC; // columns of g scanned per step (<= FFN_LIST_CAP)
    const bool handoff = heavy_limit <= FFN_LIST_CAP;
    unsigned long long seen_total = 0, heavy_total = 0;
    int parity = 0;

    for (long long row = blockIdx.x; row < M; row += gridDim.x) {
        const T* grow = g + row * ldg;
        T* h_row = WRITE_H ? h_out + row * ldh : nullptr;
        uint4 xr[NV];
        if (GATED) {
            const uint4* xv = reinterpret_cast<const uint4*>(x + row * ldx);
#pragma unroll
            for (int k = 0; k < NV; ++k) {
                const int v = k * blockDim.x + tid;
                xr[k] = (v < DV) ? __ldcs(xv + v) : zero4();
            }
        }
        A acc[NV][VEC];
#pragma unroll
        for (int k = 0; k < NV; ++k)
#pragma unroll
            for (int i = 0; i < VEC; ++i) acc[k][i] = A(0);

        const int listed = (row_count != nullptr) ? row_count[row] : -1;  // same in every thread
        if (listed > heavy_limit) {  // only possible with handoff
            if (tid == 0) heavy[row] = 1;
            seen_total += (unsigned long long)listed;
            ++heavy_total;
            continue;
        }
        if (long_rows && listed > capr) {
            // a long row: twellpy_ffn_long_up / _down (ffn_long.cu) spread it over many
            // blocks after this kernel; its y row is theirs
            seen_total += (unsigned long long)listed;
            if (tid == 0) heavy[row] = 0;
            continue;
        }
        if (listed >= 0 && listed <= capr) {
            // ---- fast path: the row's list was built by twellpy_ffn_rowpack ----
            const long long base = row * (long long)capr;
            for (int i = tid; i < listed; i += blockDim.x) {
                s_idx[i] = list_idx[base + i];
                s_gval[i] = list_val[base + i];
            }
            __syncthreads();
            seen_total += (unsigned long long)listed;
            if (tid == 0) heavy[row] = 0;
            if (SPLIT) {
                process_list<T, NV, KB, GATED, WRITE_H, false>(listed, s_idx, s_gval, s_red, parity, xr, acc,
                                                               w_up, w_downT, h_row, D, DV, tid, lane, warp,
                                                               nwarps, list_val + base);
                continue;  // uniform: y of this row comes from twellpy_spmm_resident
            }
            process_list<T, NV, KB, GATED, WRITE_H>(listed, s_idx, s_gval, s_red, parity, xr, acc, w_up,
                                                    w_downT, h_row, D, DV, tid, lane, warp, nwarps);
        } else {
            int n = 0;          // list length, identical in every thread
            int row_total = 0;  // true active count so far, identical in every thread
            for (int c0 = 0; c0 < H; c0 += step) {
                if (!handoff && n + step > FFN_LIST_CAP) {
                    // list could overflow in this step: drain it first (uniform branch)
                    process_list<T, NV, KB, GATED, WRITE_H>(n, s_idx, s_gval, s_red, parity, xr, acc, w_up,
                                                            w_downT, h_row, D, DV, tid, lane, warp, nwarps);
                    n = 0;
                }
                // ---- scan one step of g, compact active neurons (column order) ----
                const int col = c0 + tid * VEC;
                unsigned mask = 0u;
                A gv[VEC];
                if (col < H) {
                    const uint4 raw = __ldcs(reinterpret_cast<const uint4*>(grow + col));
                    unpack16<T, A>(raw, gv);
#pragma unroll
                    for (int i = 0; i < VEC; ++i)
                        if (active_acc(gv[i])) mask |= 1u << i;
                }
                const int c = __popc(mask);
                const int incl = twellpy::warp_inclusive_sum(c, lane);
                if (lane == 31) s_warp_tot[warp] = incl;
                __syncthreads();
                int warp_off = 0, total = 0;
                for (int w = 0; w < nwarps; ++w) {
                    const int t = s_warp_tot[w];
                    warp_off += (w < warp) ? t : 0;
                    total += t;
                }
                row_total += total;
                if (row_total <= heavy_limit) {
                    int pos = n + warp_off + (incl - c);
#pragma unroll
                    for (int i = 0; i < VEC; ++i) {
                        if (mask & (1u << i)) {
                            s_idx[pos] = col + i;
                            s_gval[pos] = gv[i];
                            ++pos;
                        }
                    }
                    n += total;
                }
                __syncthreads();  // list visible; s_warp_tot free for the next step
            }
            seen_total += (unsigned long long)row_total;
            if (row_total > heavy_limit) {  // only possible with handoff
                if (tid == 0) heavy[row] = 1;
                ++heavy_total;
                continue;  // uniform: every thread has the same row_total
            }
            if (tid == 0) heavy[row] = 0;
            process_list<T, NV, KB, GATED, WRITE_H>(n, s_idx, s_gval, s_red, parity, xr, acc, w_up,
                                                    w_downT, h_row, D, DV, tid, lane, warp, nwarps);
        }

        store_row<T, A, NV>(y + row * ldy, acc, DV, tid);
    }
    if (counters != nullptr && tid == 0) {
        // integer sums are order independent, so these atomics stay deterministic
        atomicAdd(&counters[0], seen_total);
        atomicAdd(&counters[1], heavy_total);
    }
}

// twellpy_ffn_list_down<T, NV, KB>: the second pass of the two-pass sparse step
// (FFNPlan.two_pass). twellpy_ffn_sparse<..., SPLIT = true> has written h (fp32,
// unrounded) over the list values of the rows its row lists serve; this kernel adds
// their down projection, y[r] = sum_k h_k * w_downT[idx_k], with the fused kernel's
// fma in the same order, so y gets the same bits. Each pass then gathers rows of one
// weight matrix only (the fused kernel gathers w_up and w_downT together, 46 MB at
// W1 in bf16, about the H100's whole L2).
//   list_idx (M, capr) int32, list_val (M, capr) accum type, row_count (M,) int32
//   w_downT  (H, D)  contiguous      y (M, D) row stride ldy
// Rows with 0 <= row_count <= row_cap (= min(capr, heavy_limit)) are written; the
// others were computed whole by the first pass, or left to the host or to
// ffn_long.cu, and stay untouched. Thread layout as twellpy_ffn_sparse (one block a
// row, thread t owns vectors t, t + blockDim.x, ...): the same NV and block size.
template <typename T, int NV, int KB>
__global__ void __launch_bounds__(FFN_MAX_WARPS * 32, FFN_MIN_BLOCKS)
twellpy_ffn_list_down(const int* __restrict__ list_idx,
                      const typename twellpy::accum<T>::type* __restrict__ list_val,
                      const int* __restrict__ row_count, int capr, int row_cap,
                      const T* __restrict__ w_downT, T* __restrict__ y, long long ldy, int M, int D) {
    using namespace twellpy_ffn;
    typedef typename twellpy::accum<T>::type A;
    constexpr int VEC = vec_of<T>::n;
    static_assert(NV >= 1 && KB >= 1, "bad tile constants");
    const int tid = threadIdx.x;
    const int DV = D / VEC;
    const unsigned long long policy = weight_policy();
    for (long long row = blockIdx.x; row < M; row += gridDim.x) {
        const int n = row_count[row];  // the same in every thread: uniform branches
        if (n < 0 || n > row_cap) continue;
        const int* idx = list_idx + row * (long long)capr;
        const A* val = list_val + row * (long long)capr;
        A acc[NV][VEC];
#pragma unroll
        for (int q = 0; q < NV; ++q)
#pragma unroll
            for (int i = 0; i < VEC; ++i) acc[q][i] = A(0);
        for (int b = 0; b < n; b += KB) {
            // every thread reads the same entries (one broadcast load a warp), then
            // issues the batch's gathers before using any of them
            int jk[KB];
            A hk[KB];
#pragma unroll
            for (int k = 0; k < KB; ++k) {
                jk[k] = (b + k < n) ? idx[b + k] : -1;
                hk[k] = (b + k < n) ? val[b + k] : A(0);
            }
            uint4 dv[KB][NV];
            gather_rows<T, NV, KB>(w_downT, jk, dv, D, DV, tid, policy);
            axpy_rows<T, A, NV, KB>(jk, hk, dv, acc);  // the fused kernel's fma, in its order
        }
        store_row<T, A, NV>(y + row * ldy, acc, DV, tid);
    }
}
