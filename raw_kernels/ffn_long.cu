// ffn_long.cu -- the long rows of the fused FFN: tokens firing more neurons than a
// row list holds (row_count > capr), spread over many blocks.
//
// twellpy_ffn_sparse (ffn_sparse.cu) computes a token in one block. A token firing
// thousands of neurons then becomes one block's serial work: on an H100 (2026-12-06,
// benchmarks/hot_rows_probe.py) one token firing all 5632 neurons took that block about
// 1.7 ms, so a W1-16k call ran at 0.77x dense and a 16-row call at 0.13x. With
// long_rows set, the sparse kernel leaves such rows alone and twellpy_ffn_long does
// them, launched after it on the same stream. Its blocks do two kinds of work:
//   1. up work, a warp per 32-column word of g: the word's active bits (relu_active:
//      > 0 or NaN) go to mask, and for each active neuron j (gated FFN) the dot
//      product u_j = x . w_up[j]; h_j = g_j * u_j overwrites g_j in place, rounded to T
//      as the dense path rounds h. The plain ReLU FFN keeps h_j = g_j where it is.
//   2. down work, a block per slice of 8 sixteen-byte vectors of y: its 16 lane groups
//      of 8 lanes take the row's active neurons in turn (column order),
//      y[slice] += h_j * w_downT[j][slice], and sum their partials in group order.
// One launch, not two (calls of a few hundred rows are host-bound: every launch counts).
// Each block takes a ticket from a counter when it starts; the first n_up tickets are
// up work, the rest down work, which waits until every up item is done. The tickets of
// up work all went to blocks that had already started, so the wait always ends, whatever
// the order in which the hardware schedules blocks. The last block to finish zeroes the
// counters for the next launch (the plan allocates them zeroed, once).
// phase 1 and 2 split the same work over two launches (up work, then down work; block
// index instead of tickets, no wait): for tools that serialise or suspend blocks, as
// compute-sanitizer's racecheck and initcheck appeared to (2026-12-06, H100: both hung on
// the one-launch form while memcheck-free runs and synccheck passed), and as a fallback.
// No atomics in the arithmetic: every value is summed in a fixed order, so the bits do
// not depend on scheduling. Activeness comes from the mask, never from h, so a neuron
// whose h is 0 still multiplies its (possibly non-finite) down weights, as in the
// sparse kernel. Rows are found by scanning row_count in chunks of LONG_THREADS rows, so
// a call without long rows costs one short launch.
#include "common.cuh"

#ifndef LONG_WARPS
#define LONG_WARPS 4
#endif
#define LONG_THREADS (LONG_WARPS * 32)
// down work: lanes per neuron (8 sixteen-byte vectors: 128 bytes of a w_downT row),
// and neurons in flight per lane group (independent loads before the FMAs)
#define LONG_GROUP 8
#define LONG_GROUPS (LONG_THREADS / LONG_GROUP)
#ifndef LONG_UNROLL
#define LONG_UNROLL 4
#endif

namespace twellpy_long {
using namespace twellpy;

// The long rows among rows [r0, r0 + LONG_THREADS): written to s_rows in row order;
// returns how many (the same value in every thread). Ends with a barrier.
__device__ __forceinline__ int find_long_rows(const int* __restrict__ row_count, int capr, long long r0, int M,
                                              long long* s_rows, int* s_tot) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const long long r = r0 + tid;
    const bool is_long = r < M && row_count[r] > capr;
    const unsigned bits = __ballot_sync(FULL_MASK, is_long);
    if (lane == 0) s_tot[warp] = __popc(bits);
    __syncthreads();
    int before = 0, n = 0;
    for (int w = 0; w < LONG_WARPS; ++w) {
        before += (w < warp) ? s_tot[w] : 0;
        n += s_tot[w];
    }
    if (is_long) s_rows[before + __popc(bits & lanes_below(lane))] = r;
    __syncthreads();
    return n;
}

// Up work of item (bx, by): mask words bx * LONG_WARPS + warp of the long rows in row
// chunks by, by + gy, ...
template <typename T, bool GATED, bool WRITE_H>
__device__ __forceinline__ void up_work(int bx, int by, int gy, const T* __restrict__ x, long long ldx, T* g,
                                        long long ldg, const T* __restrict__ w_up,
                                        const int* __restrict__ row_count, int capr, unsigned* mask, long long ldm,
                                        T* __restrict__ h_out, long long ldh, int M, int D, int H,
                                        long long* s_rows, int* s_tot) {
    typedef typename accum<T>::type A;
    constexpr int VEC = vec_of<T>::n;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int HW = (H + 31) / 32, DV = D / VEC;
    const int word = bx * LONG_WARPS + warp;
    for (long long r0 = (long long)by * LONG_THREADS; r0 < M; r0 += (long long)gy * LONG_THREADS) {
        const int n_long = find_long_rows(row_count, capr, r0, M, s_rows, s_tot);
        for (int k = 0; k < n_long; ++k) {
            if (word >= HW) break;  // warp-uniform; no barrier below
            const long long row = s_rows[k];
            const int col = word * 32 + lane;
            T* grow = g + row * ldg;
            A gv = A(0);
            bool act = false;
            if (col < H) {
                gv = to_acc<A, T>(grow[col]);
                act = !(gv <= A(0));
            }
            unsigned bits = __ballot_sync(FULL_MASK, act);
            if (lane == 0) mask[row * ldm + word] = bits;
            if (!GATED) {
                if (WRITE_H && act) h_out[row * ldh + col] = grow[col];
                continue;
            }
            const uint4* xv = reinterpret_cast<const uint4*>(x + row * ldx);
            while (bits) {
                const int b = __ffs((int)bits) - 1;
                bits &= bits - 1u;
                const int j = word * 32 + b;
                const uint4* wv = reinterpret_cast<const uint4*>(w_up + (long long)j * D);
                A s = A(0);
                for (int v = lane; v < DV; v += 32) {
                    A xa[VEC], wa[VEC];
                    unpack16<T, A>(__ldg(xv + v), xa);
                    unpack16<T, A>(__ldg(wv + v), wa);
#pragma unroll
                    for (int i = 0; i < VEC; ++i) s = fma(xa[i], wa[i], s);
                }
                const A u = warp_total(s);
                if (lane == b) {
                    const T h = from_acc<T, A>(gv * u);
                    grow[j] = h;
                    if (WRITE_H) h_out[row * ldh + j] = h;
                }
            }
        }
        __syncthreads();  // s_rows is rewritten for the next chunk
    }
}

// Down work of item (bx, by): vectors [bx * LONG_GROUP, bx * LONG_GROUP + LONG_GROUP) of
// y for the long rows in row chunks by, by + gy, ... h and mask were written by other
// blocks of this launch: read through L2 (__ldcg), never through the read-only cache.
template <typename T>
__device__ __forceinline__ void down_work(int bx, int by, int gy, const T* h, long long ldh, const unsigned* mask,
                                          long long ldm, const int* __restrict__ row_count, int capr,
                                          const T* __restrict__ w_downT, T* __restrict__ y, long long ldy, int M,
                                          int D, int H, long long* s_rows, int* s_tot, int* s_idx,
                                          typename accum<T>::type (*s_part)[LONG_GROUP][vec_of<T>::n]) {
    typedef typename accum<T>::type A;
    constexpr int VEC = vec_of<T>::n;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int grp = tid / LONG_GROUP, sub = tid % LONG_GROUP;
    const int HW = (H + 31) / 32, DV = D / VEC;
    const int v = bx * LONG_GROUP + sub;  // this lane's vector of the output row
    const bool has_v = v < DV;
    const uint4* wd = reinterpret_cast<const uint4*>(w_downT);
    for (long long r0 = (long long)by * LONG_THREADS; r0 < M; r0 += (long long)gy * LONG_THREADS) {
        const int n_long = find_long_rows(row_count, capr, r0, M, s_rows, s_tot);
        for (int k = 0; k < n_long; ++k) {
            const long long row = s_rows[k];
            const T* hrow = h + row * ldh;
            A acc[VEC];
#pragma unroll
            for (int i = 0; i < VEC; ++i) acc[i] = A(0);
            for (int w0 = 0; w0 < HW; w0 += LONG_THREADS) {
                // ---- the active columns of mask words [w0, w0 + LONG_THREADS), column order ----
                const int w = w0 + tid;
                const unsigned bits = (w < HW) ? __ldcg(mask + row * ldm + w) : 0u;
                const int c = __popc(bits);
                const int incl = warp_inclusive_sum(c, lane);
                if (lane == 31) s_tot[warp] = incl;
                __syncthreads();
                int before = 0, n = 0;
                for (int q = 0; q < LONG_WARPS; ++q) {
                    before += (q < warp) ? s_tot[q] : 0;
                    n += s_tot[q];
                }
                int pos = before + incl - c;
                for (unsigned b = bits; b; b &= b - 1u) s_idx[pos++] = w * 32 + (__ffs((int)b) - 1);
                __syncthreads();
                // ---- lane group grp takes entries grp, grp + LONG_GROUPS, ... ----
                for (int e0 = grp; e0 < n; e0 += LONG_GROUPS * LONG_UNROLL) {
                    uint4 wv[LONG_UNROLL];
                    A hv[LONG_UNROLL];
#pragma unroll
                    for (int u = 0; u < LONG_UNROLL; ++u) {
                        const int e = e0 + u * LONG_GROUPS;
                        const int j = (e < n) ? s_idx[e] : -1;
                        hv[u] = (j >= 0) ? to_acc<A, T>(__ldcg(hrow + j)) : A(0);
                        wv[u] = (j >= 0 && has_v) ? __ldg(wd + (long long)j * DV + v) : make_uint4(0u, 0u, 0u, 0u);
                    }
#pragma unroll
                    for (int u = 0; u < LONG_UNROLL; ++u) {
                        if (e0 + u * LONG_GROUPS >= n) break;  // padding entries add nothing
                        A wa[VEC];
                        unpack16<T, A>(wv[u], wa);
#pragma unroll
                        for (int i = 0; i < VEC; ++i) acc[i] = fma(hv[u], wa[i], acc[i]);
                    }
                }
                __syncthreads();  // s_idx and s_tot are rewritten next
            }
            // ---- the groups' partials, summed in group order ----
#pragma unroll
            for (int i = 0; i < VEC; ++i) s_part[grp][sub][i] = acc[i];
            __syncthreads();
            if (tid < LONG_GROUP && bx * LONG_GROUP + tid < DV) {
                uint4 out;
                T* e = reinterpret_cast<T*>(&out);
#pragma unroll
                for (int i = 0; i < VEC; ++i) {
                    A t = A(0);
                    for (int q = 0; q < LONG_GROUPS; ++q) t += s_part[q][tid][i];
                    e[i] = from_acc<T, A>(t);
                }
                reinterpret_cast<uint4*>(y + row * ldy)[bx * LONG_GROUP + tid] = out;
            }
            __syncthreads();  // s_part is rewritten for the next row
        }
        __syncthreads();  // s_rows is rewritten for the next chunk
    }
}

}  // namespace twellpy_long

// twellpy_ffn_long<T, GATED, WRITE_H>
//   x         (M, D)   row stride ldx   token activations (read when GATED)
//   g         (M, H)   row stride ldg   gate pre-activation; long rows: h written over
//                                       the active entries (in place), then read back
//   w_up      (H, D)   contiguous       up weights (GATED)
//   w_downT   (H, D)   contiguous       w_down transposed: row j is w_down[:, j]
//   y         (M, D)   row stride ldy   output: long rows written in full, others untouched
//   row_count (M,)     int32            active count per row (twellpy_ffn_rowpack)
//   mask      (M, HW)  row stride ldm   uint32, HW = ceil(H / 32): active bits of the
//                                       long rows (other rows untouched)
//   h_out     (M, H)   row stride ldh   optional (WRITE_H): h at the long rows' active entries
//   tickets   (>= 3,)  uint32           zero at launch, zero again at the end: [0] tickets
//                                       handed out, [1] up items done, [2] blocks done
//                                       (phase 0 only; untouched by phases 1 and 2)
//   phase     0: one launch, tickets; 1: up work only, grid gx_up * gy; 2: down work only,
//             grid gx_down * gy, launched after phase 1 on the same stream
// Grid: (gx_up + gx_down) * gy blocks in x, with gx_up = ceil(HW / LONG_WARPS) (one warp
// per 32-column word), gx_down = ceil(DV / LONG_GROUP) and gy row chunks in flight; block
// LONG_THREADS. Requirements as twellpy_ffn_sparse: D % (16/sizeof(T)) == 0 and
// 16-byte aligned rows of x, w_up, w_downT and y.
template <typename T, bool GATED, bool WRITE_H>
__global__ void __launch_bounds__(LONG_THREADS)
twellpy_ffn_long(const T* __restrict__ x, long long ldx, T* g, long long ldg, const T* __restrict__ w_up,
                 const T* __restrict__ w_downT, T* __restrict__ y, long long ldy,
                 const int* __restrict__ row_count, int capr, unsigned* mask, long long ldm,
                 T* __restrict__ h_out, long long ldh, unsigned* tickets, int gx_up, int gx_down, int gy,
                 int phase, int M, int D, int H) {
    using namespace twellpy_long;
    typedef typename accum<T>::type A;
    __shared__ long long s_rows[LONG_THREADS];
    __shared__ int s_tot[LONG_WARPS];
    __shared__ int s_idx[LONG_THREADS * 32];  // active columns of LONG_THREADS mask words
    __shared__ A s_part[LONG_GROUPS][LONG_GROUP][vec_of<T>::n];
    __shared__ unsigned s_ticket;
    const unsigned n_up = (unsigned)gx_up * (unsigned)gy;
    if (phase != 0) {
        // two launches: the stream orders the up launch before the down launch
        const unsigned b = blockIdx.x;
        if (phase == 1)
            up_work<T, GATED, WRITE_H>((int)(b % gx_up), (int)(b / gx_up), gy, x, ldx, g, ldg, w_up, row_count,
                                       capr, mask, ldm, h_out, ldh, M, D, H, s_rows, s_tot);
        else
            down_work<T>((int)(b % gx_down), (int)(b / gx_down), gy, g, ldg, mask, ldm, row_count, capr, w_downT,
                         y, ldy, M, D, H, s_rows, s_tot, s_idx, s_part);
        return;
    }
    if (threadIdx.x == 0) s_ticket = atomicAdd(&tickets[0], 1u);
    __syncthreads();
    const unsigned t = s_ticket;
    if (t < n_up) {
        up_work<T, GATED, WRITE_H>((int)(t % gx_up), (int)(t / gx_up), gy, x, ldx, g, ldg, w_up, row_count, capr,
                                   mask, ldm, h_out, ldh, M, D, H, s_rows, s_tot);
        // each thread's h and mask stores visible device-wide, then one report for the block
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) {
            atomicAdd(&tickets[1], 1u);
            // release for the reset: this report comes before the block's count on
            // tickets[2] (a down block's spin reads come before its fence after the wait)
            __threadfence();
        }
    } else {
        if (threadIdx.x == 0) {
            // every up ticket went to a block that has started: this wait ends
            while (atomicAdd(&tickets[1], 0u) < n_up) __nanosleep(64);
            __threadfence();
        }
        __syncthreads();
        const unsigned d = t - n_up;
        down_work<T>((int)(d % gx_down), (int)(d / gx_down), gy, g, ldg, mask, ldm, row_count, capr, w_downT, y, ldy,
                     M, D, H, s_rows, s_tot, s_idx, s_part);
    }
    if (threadIdx.x == 0) {
        const unsigned total = n_up + (unsigned)gx_down * (unsigned)gy;
        if (atomicAdd(&tickets[2], 1u) == total - 1u) {  // the last block: nobody reads them any more
            __threadfence();  // acquire: every block's ticket atomics come before the zeroing
            tickets[0] = 0u;
            tickets[1] = 0u;
            tickets[2] = 0u;
        }
    }
}
