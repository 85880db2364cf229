// ffn_long.cu -- the long rows of the fused FFN: tokens firing more neurons than a
// row list holds (row_count > capr), spread over many blocks.
//
// twellpy_ffn_sparse (ffn_sparse.cu) computes a token in one block. A token firing
// thousands of neurons then becomes one block's serial work: on an H100 (2026-12-06,
// benchmarks/hot_rows_probe.py) one token firing all 5632 neurons took that block about
// 1.7 ms, so a W1-16k call ran at 0.77x dense and a 16-row call at 0.13x. With
// long_rows set, the sparse kernel leaves such rows alone and twellpy_ffn_long does
// them, launched after it on the same stream. Its work comes in three stages of items:
//   1. scan items, LONG_SCAN rows of row_count each: the long rows among them are
//      appended to a list (one atomic per item for its base; row order inside an item).
//      The list's order between items depends on scheduling; nothing below depends on
//      it, since every item computes one row's values in a fixed order.
//   2. up items, one per (long row, 32-column word of g): the word's active bits
//      (relu_active: > 0 or NaN) go to mask and, for the gated FFN, the block's warps
//      share the word's active neurons j (rank r to warp r % LONG_WARPS) and compute
//      u_j = x . w_up[j]; h_j = g_j * u_j overwrites g_j in place, rounded to T as the
//      dense path rounds h. The plain ReLU FFN keeps h_j = g_j where it is.
//   3. down items, one per (long row, slice of LONG_GROUP sixteen-byte vectors of y):
//      the block's LONG_GROUPS lane groups take the row's active neurons in turn (column
//      order), y[slice] += h_j * w_downT[j][slice], and the partials are summed in group
//      order.
// Version 1 (twenty-fourth session) gave each block a 128-row chunk and a group of 4
// words: one all-firing token was 176 warps of 32 serial dot products and 32 blocks of
// 352 serial neurons, 0.28 ms of a W1-16k call, and 16 such tokens in one chunk were
// one block set's loop (a 16-row call took 1.9 ms); a call without long rows scanned
// row_count in thousands of blocks (about 12 us). Here the work of one row is 176 up and
// 64 down items (W1), and a call without long rows is a few scan items.
//
// One launch (phase 0), a persistent grid: blocks take tickets from a counter, scan items
// first, then up items, then down items, until the tickets run out. A block past the scan
// items waits until every scan item is done (it needs the count of long rows), and a
// down item waits until every up item is done. Tickets are handed out in order, so every
// item waited for went to a block that had already started and waits for nothing later:
// the waits end whatever the order in which the hardware schedules blocks. The last block
// to finish zeroes the state for the next launch (the plan allocates it zeroed, once).
// Phases 1, 2 and 3 run the three stages as three launches, without waiting between
// blocks (same bits): for tools that suspend or serialise blocks (compute-sanitizer's
// racecheck and initcheck stalled on the one-launch form on an H100, 2026-12-06), and as
// a fallback.
// No atomics in the arithmetic: every value is summed in a fixed order, so the bits do
// not depend on scheduling. Activeness comes from the mask, never from h, so a neuron
// whose h is 0 still multiplies its (possibly non-finite) down weights, as in the
// sparse kernel.
#include "common.cuh"

#ifndef LONG_WARPS
#define LONG_WARPS 8
#endif
#define LONG_THREADS (LONG_WARPS * 32)
// rows of row_count per scan item (LONG_SCAN_ROUNDS per thread)
#ifndef LONG_SCAN_ROUNDS
#define LONG_SCAN_ROUNDS 4
#endif
#define LONG_SCAN (LONG_THREADS * LONG_SCAN_ROUNDS)
// down work: lanes per neuron (4 sixteen-byte vectors: 64 bytes of a w_downT row, two
// sectors), and neurons in flight per lane group (independent loads before the FMAs)
#ifndef LONG_GROUP
#define LONG_GROUP 4
#endif
#define LONG_GROUPS (LONG_THREADS / LONG_GROUP)
#ifndef LONG_UNROLL
#define LONG_UNROLL 8
#endif

namespace twellpy_long {
using namespace twellpy;

// state words (uint32): tickets handed out, scan items done, long rows found, up items
// done, blocks finished (phases 0 and 3)
enum { TICKETS = 0, SCANNED = 1, FOUND = 2, UP_DONE = 3, FINISHED = 4 };

// Scan item s: the long rows among rows [s * LONG_SCAN, (s + 1) * LONG_SCAN) are appended
// to list, in row order, at a base taken with one atomic. Ends with a barrier.
__device__ __forceinline__ void scan_item(long long s, const int* __restrict__ row_count, int capr, int M,
                                          unsigned* state, int* list, int (*s_cnt)[LONG_WARPS], int* s_base) {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    unsigned bits[LONG_SCAN_ROUNDS];
#pragma unroll
    for (int i = 0; i < LONG_SCAN_ROUNDS; ++i) {
        const long long r = s * LONG_SCAN + (long long)i * LONG_THREADS + tid;
        bits[i] = __ballot_sync(FULL_MASK, r < M && row_count[r] > capr);
        if (lane == 0) s_cnt[i][warp] = __popc(bits[i]);
    }
    __syncthreads();
    if (tid == 0) {
        int total = 0;
        for (int i = 0; i < LONG_SCAN_ROUNDS; ++i)
            for (int w = 0; w < LONG_WARPS; ++w) total += s_cnt[i][w];
        *s_base = total ? (int)atomicAdd(&state[FOUND], (unsigned)total) : 0;
    }
    __syncthreads();
    // position of (round i, warp, lane): earlier rounds, then earlier warps, then lanes
    int pos = *s_base;
#pragma unroll
    for (int i = 0; i < LONG_SCAN_ROUNDS; ++i) {
        int before = pos;
        for (int w = 0; w < warp; ++w) before += s_cnt[i][w];
        if (bits[i] & (1u << lane)) list[before + __popc(bits[i] & lanes_below(lane))] = (int)(s * LONG_SCAN + i * LONG_THREADS + tid);
        for (int w = 0; w < LONG_WARPS; ++w) pos += s_cnt[i][w];
    }
    __syncthreads();  // s_cnt and s_base are rewritten by the block's next scan item
}

// Up item u: word u % HW of long row list[u / HW]. Every warp reads the word's 32 gate
// values; warp 0 writes the mask word; the active neurons go to the warps by rank.
template <typename T, bool GATED, bool WRITE_H>
__device__ __forceinline__ void up_item(long long u, int HW, const int* list, const T* __restrict__ x, long long ldx,
                                        T* g, long long ldg, const T* __restrict__ w_up, unsigned* mask,
                                        long long ldm, T* __restrict__ h_out, long long ldh, int D, int H) {
    typedef typename accum<T>::type A;
    constexpr int VEC = vec_of<T>::n;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int DV = D / VEC;
    const int word = (int)(u % HW);
    const long long row = __ldcg(list + u / HW);
    const int col = word * 32 + lane;
    T* grow = g + row * ldg;
    A gv = A(0);
    bool act = false;
    if (col < H) {
        gv = to_acc<A, T>(grow[col]);
        act = !(gv <= A(0));
    }
    const unsigned bits = __ballot_sync(FULL_MASK, act);
    // every warp has its gate values before any warp writes h over them
    __syncthreads();
    if (warp == 0 && lane == 0) mask[row * ldm + word] = bits;
    if (!GATED) {
        if (WRITE_H && warp == 0 && act) h_out[row * ldh + col] = grow[col];
        return;
    }
    const uint4* xv = reinterpret_cast<const uint4*>(x + row * ldx);
    int rank = 0;
    for (unsigned left = bits; left; left &= left - 1u, ++rank) {
        if (rank % LONG_WARPS != warp) continue;  // warp-uniform
        const int b = __ffs((int)left) - 1;
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
        const A t = warp_total(s);
        if (lane == b) {
            const T h = from_acc<T, A>(gv * t);
            grow[j] = h;
            if (WRITE_H) h_out[row * ldh + j] = h;
        }
    }
}

// Down item d: vectors [sl * LONG_GROUP, sl * LONG_GROUP + LONG_GROUP) of y, with
// sl = d % n_slices, for long row list[d / n_slices]. h and mask were written by other
// blocks: read through L2 (__ldcg), never through the read-only cache. Ends with a barrier.
template <typename T>
__device__ __forceinline__ void down_item(long long d, int n_slices, const int* list, const T* h, long long ldh,
                                          const unsigned* mask, long long ldm, const T* __restrict__ w_downT,
                                          T* __restrict__ y, long long ldy, int D, int H, int* s_tot, int* s_idx,
                                          typename accum<T>::type (*s_part)[LONG_GROUP][vec_of<T>::n],
                                          typename accum<T>::type (*s_sum)[vec_of<T>::n]) {
    typedef typename accum<T>::type A;
    constexpr int VEC = vec_of<T>::n;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int grp = tid / LONG_GROUP, sub = tid % LONG_GROUP;
    const int HW = (H + 31) / 32, DV = D / VEC;
    const int sl = (int)(d % n_slices);
    const long long row = __ldcg(list + d / n_slices);
    const int v = sl * LONG_GROUP + sub;  // this lane's vector of the output row
    const bool has_v = v < DV;
    const uint4* wd = reinterpret_cast<const uint4*>(w_downT);
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
            for (int q = 0; q < LONG_UNROLL; ++q) {
                const int e = e0 + q * LONG_GROUPS;
                const int j = (e < n) ? s_idx[e] : -1;
                hv[q] = (j >= 0) ? to_acc<A, T>(__ldcg(hrow + j)) : A(0);
                wv[q] = (j >= 0 && has_v) ? __ldg(wd + (long long)j * DV + v) : make_uint4(0u, 0u, 0u, 0u);
            }
#pragma unroll
            for (int q = 0; q < LONG_UNROLL; ++q) {
                if (e0 + q * LONG_GROUPS >= n) break;  // padding entries add nothing
                A wa[VEC];
                unpack16<T, A>(wv[q], wa);
#pragma unroll
                for (int i = 0; i < VEC; ++i) acc[i] = fma(hv[q], wa[i], acc[i]);
            }
        }
        __syncthreads();  // s_idx and s_tot are rewritten next
    }
    // ---- the groups' partials, summed in group order: one thread per (vector, element) ----
#pragma unroll
    for (int i = 0; i < VEC; ++i) s_part[grp][sub][i] = acc[i];
    __syncthreads();
    if (tid < LONG_GROUP * VEC) {
        const int vs = tid / VEC, i = tid % VEC;
        A t = A(0);
        for (int q = 0; q < LONG_GROUPS; ++q) t += s_part[q][vs][i];
        s_sum[vs][i] = t;
    }
    __syncthreads();
    if (tid < LONG_GROUP && sl * LONG_GROUP + tid < DV) {
        uint4 out;
        T* e = reinterpret_cast<T*>(&out);
#pragma unroll
        for (int i = 0; i < VEC; ++i) e[i] = from_acc<T, A>(s_sum[tid][i]);
        reinterpret_cast<uint4*>(y + row * ldy)[sl * LONG_GROUP + tid] = out;
    }
    __syncthreads();  // s_part and s_sum are rewritten by the block's next down item
}

// thread 0 waits until state[which] reaches target, then an acquire fence
__device__ __forceinline__ void wait_for(unsigned* state, int which, unsigned target) {
    while (atomicAdd(&state[which], 0u) < target) __nanosleep(64);
    __threadfence();
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
//   state     (>= 5,)  uint32           zero at launch, zero again after phase 0 or 3
//                                       (twellpy_long's TICKETS ... FINISHED)
//   list      (M,)     int32            scratch: the long rows found
//   phase     0: all three stages in one launch, any grid (persistent; about two blocks
//             per SM); 1: scan items, grid ceil(M / LONG_SCAN); 2: up items and 3: down
//             items, any grid each, launched in this order on one stream
// Block LONG_THREADS. Requirements as twellpy_ffn_sparse: D % (16/sizeof(T)) == 0 and
// 16-byte aligned rows of x, w_up, w_downT and y.
template <typename T, bool GATED, bool WRITE_H>
__global__ void __launch_bounds__(LONG_THREADS)
twellpy_ffn_long(const T* __restrict__ x, long long ldx, T* g, long long ldg, const T* __restrict__ w_up,
                 const T* __restrict__ w_downT, T* __restrict__ y, long long ldy,
                 const int* __restrict__ row_count, int capr, unsigned* mask, long long ldm,
                 T* __restrict__ h_out, long long ldh, unsigned* state, int* list, int phase, int M, int D,
                 int H) {
    using namespace twellpy_long;
    typedef typename accum<T>::type A;
    constexpr int VEC = vec_of<T>::n;
    __shared__ int s_cnt[LONG_SCAN_ROUNDS][LONG_WARPS];
    __shared__ int s_base;
    __shared__ int s_idx[LONG_THREADS * 32];  // active columns of LONG_THREADS mask words
    __shared__ A s_part[LONG_GROUPS][LONG_GROUP][VEC];
    __shared__ A s_sum[LONG_GROUP][VEC];
    __shared__ unsigned s_ticket, s_found;
    const int tid = threadIdx.x;
    const int HW = (H + 31) / 32, DV = D / VEC;
    const int n_slices = (DV + LONG_GROUP - 1) / LONG_GROUP;
    const long long n_scan = ((long long)M + LONG_SCAN - 1) / LONG_SCAN;

    if (phase == 1) {  // scan items, one per block
        scan_item(blockIdx.x, row_count, capr, M, state, list, s_cnt, &s_base);
        return;
    }
    if (phase == 2 || phase == 3) {  // the list is complete: the previous launch wrote it
        // read once, by the thread that later counts the block finished (phase 3 zeroes it)
        if (tid == 0) s_found = __ldcg(&state[FOUND]);
        __syncthreads();
        const long long n_long = s_found;
        if (phase == 2) {
            for (long long u = blockIdx.x; u < n_long * HW; u += gridDim.x)
                up_item<T, GATED, WRITE_H>(u, HW, list, x, ldx, g, ldg, w_up, mask, ldm, h_out, ldh, D, H);
            return;
        }
        for (long long d = blockIdx.x; d < n_long * n_slices; d += gridDim.x)
            down_item<T>(d, n_slices, list, g, ldg, mask, ldm, w_downT, y, ldy, D, H, &s_cnt[0][0], s_idx, s_part,
                         s_sum);
        if (tid == 0) {
            __threadfence();  // release: this block's read of state before its count
            if (atomicAdd(&state[FINISHED], 1u) == gridDim.x - 1u) {
                __threadfence();  // acquire: every block's reads of state come before the zeroing
                for (int k = 0; k <= FINISHED; ++k) state[k] = 0u;
            }
        }
        return;
    }

    // ---- phase 0: one launch, items by ticket ----
    bool scanned = false, up_ready = false;
    long long n_long = 0;
    for (;;) {
        if (tid == 0) s_ticket = atomicAdd(&state[TICKETS], 1u);
        __syncthreads();
        const long long t = s_ticket;
        __syncthreads();  // every thread has read s_ticket before the next item rewrites it
        if (t < n_scan) {
            scan_item(t, row_count, capr, M, state, list, s_cnt, &s_base);
            __threadfence();  // release: each thread's list entries before the count of scanned items
            __syncthreads();
            if (tid == 0) atomicAdd(&state[SCANNED], 1u);
            continue;
        }
        if (!scanned) {
            // every scan ticket went to a block that has started (tickets are handed out in
            // order), and scan items wait for nothing: this wait ends
            if (tid == 0) {
                wait_for(state, SCANNED, (unsigned)n_scan);
                s_found = atomicAdd(&state[FOUND], 0u);
            }
            __syncthreads();
            n_long = s_found;
            scanned = true;
        }
        const long long u = t - n_scan;
        if (u < n_long * HW) {
            up_item<T, GATED, WRITE_H>(u, HW, list, x, ldx, g, ldg, w_up, mask, ldm, h_out, ldh, D, H);
            __threadfence();  // each thread's h and mask stores visible device-wide
            __syncthreads();
            if (tid == 0) atomicAdd(&state[UP_DONE], 1u);
            continue;
        }
        const long long d = u - n_long * HW;
        if (d >= n_long * n_slices) break;
        // the same argument: every up ticket went to a block that has started
        if (!up_ready) {
            if (tid == 0) wait_for(state, UP_DONE, (unsigned)(n_long * HW));
            __syncthreads();
            up_ready = true;
        }
        down_item<T>(d, n_slices, list, g, ldg, mask, ldm, w_downT, y, ldy, D, H, &s_cnt[0][0], s_idx, s_part, s_sum);
    }
    if (tid == 0) {
        __threadfence();  // release: this block's state atomics before its count of finished blocks
        if (atomicAdd(&state[FINISHED], 1u) == gridDim.x - 1u) {
            __threadfence();  // acquire: every block's state atomics come before the zeroing
            for (int k = 0; k <= FINISHED; ++k) state[k] = 0u;
        }
    }
}
