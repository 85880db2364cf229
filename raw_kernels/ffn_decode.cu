// ffn_decode.cu -- the whole ReLU FFN (gated or plain) of a few tokens in two launches.
//
// A decode step runs the FFN on a few tokens. The general path (cuBLAS gate
// GEMM, row pack, fused sparse kernel, plus the NaN/Inf count of x, memsets
// and copies) is host-bound there: about eight launches whose host cost is
// several times their GPU time. Here the same FFN takes two kernels:
//   1. twellpy_ffn_decode_gate: every neuron's gate dot product for all M
//      rows (the only dense work: w_gate is read once), ReLU, and for the
//      neurons active in some row the up dot product; h goes to a small
//      (M, H) scratch, plus a 16-bit mask of the rows each neuron is active in. Block (0, 0)
//      also counts the NaN/Inf elements of x (no separate check kernel) and
//      every block its active (row, neuron) pairs (activity statistics);
//   2. twellpy_ffn_decode_down: y = h @ w_down.T over the active neurons
//      only; each block owns a slice of y's columns and walks the active list
//      in neuron order.
// Calls of more than 16 rows run in groups of MR = 16 rows: the group is a grid
// dimension of both kernels, each gate block stages its group's rows of x, and
// the gate blocks of one neuron block are launched next to each other (the
// group is the fast grid dimension), so that w_gate is read from DRAM about once.
// Both are exact for any number of active neurons (a row firing every neuron
// included). Accumulation is fp32 (fp64 for double data) with a fixed order,
// so the same input always gives the same bits. As on the general path, the
// gate value is rounded to T before use (the GEMM's output type), a neuron is
// active when g > 0 or g is NaN, and NaN/Inf in x propagates to y (IEEE).
#include "common.cuh"

#ifndef DECODE_WARPS
#define DECODE_WARPS 8   // warps per block of both kernels
#endif
#ifndef DECODE_NPW
#define DECODE_NPW 2     // neurons per warp in the gate kernel (their row loads overlap)
#endif
#define DECODE_THREADS (32 * DECODE_WARPS)
// Both kernels declare a minimum of one resident block (__launch_bounds__(.., 1)): with the
// default, ptxas held some instantiations (bf16 down at MR = 4, fp32 gate at MR = 4) to 64
// registers and spilled; one block of 256 threads may use up to 255.
// neurons listed per window of the down kernel: 8 row masks (16 bytes) per thread
#define DECODE_WINDOW (8 * DECODE_THREADS)

namespace twellpy_decode {
using namespace twellpy;

// NaN or Inf: every exponent bit set (a bit test: no library call, independent of -ftz)
__device__ __forceinline__ bool is_nonfinite(float v) { return (__float_as_uint(v) & 0x7f800000u) == 0x7f800000u; }
__device__ __forceinline__ bool is_nonfinite(double v) {
    return (__double_as_longlong(v) & 0x7ff0000000000000ll) == 0x7ff0000000000000ll;
}

// 0x8000 in each 16-bit half of w that is not zero, 0 in the other
__device__ __forceinline__ unsigned nonzero_halves(unsigned w) {
    return (((w & 0x7fff7fffu) + 0x7fff7fffu) | w) & 0x80008000u;
}

// Block-wide exclusive prefix of one int per thread (every thread calls it).
// s_warp: DECODE_WARPS + 1 ints of shared memory; *total gets the block's sum.
__device__ __forceinline__ int block_exclusive(int v, int lane, int warp, int* s_warp, int* total) {
    const int incl = warp_inclusive_sum(v, lane);
    if (lane == 31) s_warp[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        const int t = lane < DECODE_WARPS ? s_warp[lane] : 0;
        const int ti = warp_inclusive_sum(t, lane);
        if (lane < DECODE_WARPS) s_warp[lane] = ti - t;
        if (lane == DECODE_WARPS - 1) s_warp[DECODE_WARPS] = ti;
    }
    __syncthreads();
    const int out = s_warp[warp] + incl - v;
    *total = s_warp[DECODE_WARPS];
    __syncthreads();  // s_warp may be reused by the caller's next call
    return out;
}

}  // namespace twellpy_decode

// ---------------------------------------------------------------------------
// twellpy_ffn_decode_gate<T, GATED, MR>: gate, ReLU and up values of every
// neuron for M rows, in groups of MR rows (one group when M <= MR).
//   x          (M, D)   T      rows ldx elements apart, 16-byte aligned
//   w_gate     (H, D)   T      gate weights (the plain ReLU FFN passes w_up)
//   w_up       (H, D)   T      up weights (GATED only; unused otherwise)
//   h          (M, H)   A      out: g * u (GATED) or g where the neuron is
//                              active in row m, 0 elsewhere (A: float, or
//                              double for double data)
//   h_out      (M, ldh) T      out, may be null: h rounded to T, every entry
//   active_rows (G, Hp) uint16 out: bit m of [g, n] set where neuron n is active
//                              in row g * MR + m (Hp = H rounded up to 8; the
//                              padding is the caller's, zero)
//   blk_active (G, n_blk) int  out: active (row, neuron) pairs of each block
//   counters   (4,)     uint64 [3] = NaN/Inf elements of all M rows of x, written
//                              by block (0, 0) when check_x (not added: no zeroing)
//   M, D, H                    M >= 1; D a multiple of the 16-byte vector
// Grid: (G, n_blk) blocks of DECODE_THREADS threads, G = ceil(M / MR) row groups
// and n_blk = ceil(H / (DECODE_WARPS * DECODE_NPW)) neuron blocks; warp w of
// block (g, b) owns neurons (b * DECODE_WARPS + w) * NPW + k for rows g * MR + m.
// Dynamic shared memory: min(M, MR) * D * sizeof(T) bytes (a group's x, staged once
// per block; past 48 KB the caller raises the kernel's max_dynamic_shared_size_bytes first).
// ---------------------------------------------------------------------------
template <typename T, bool GATED, int MR>
__global__ void __launch_bounds__(DECODE_THREADS, 1)
twellpy_ffn_decode_gate(const T* __restrict__ x, long long ldx, const T* __restrict__ w_gate,
                        const T* __restrict__ w_up, typename twellpy::accum<T>::type* __restrict__ h,
                        T* __restrict__ h_out, long long ldh, unsigned short* __restrict__ active_rows,
                        int* __restrict__ blk_active, unsigned long long* __restrict__ counters, int check_x,
                        int M, int D, int H) {
    using namespace twellpy_decode;
    typedef typename twellpy::accum<T>::type A;
    constexpr int VEC = vec_of<T>::n;
    extern __shared__ uint4 s_x[];  // the group's rows, DV vectors each
    __shared__ int s_cnt[DECODE_WARPS + 1];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int DV = D / VEC;
    const int group = blockIdx.x, nblock = blockIdx.y;
    const bool first = group == 0 && nblock == 0;
    const int row0 = group * MR;
    const int Mg = min(MR, M - row0);  // rows of this group, 1..MR

    // block (0, 0) counts the NaN/Inf elements of every row of x (all groups: one count)
    int bad = 0;
    if (check_x && first) {
        for (long long i = tid; i < (long long)M * DV; i += DECODE_THREADS) {
            const long long m = i / DV, v = i - m * DV;
            A xa[VEC];
            unpack16<T, A>(*reinterpret_cast<const uint4*>(x + m * ldx + v * VEC), xa);
#pragma unroll
            for (int e = 0; e < VEC; ++e) bad += is_nonfinite(xa[e]) ? 1 : 0;
        }
        bad = twellpy::warp_sum(bad);
        if (lane == 0) s_cnt[warp] = bad;
    }
    // stage the group's rows of x
    x += (long long)row0 * ldx;
    h += (long long)row0 * H;
    if (h_out != nullptr) h_out += (long long)row0 * ldh;
    active_rows += (long long)group * ((H + 7) / 8 * 8);
    for (int i = tid; i < Mg * DV; i += DECODE_THREADS) {
        const int m = i / DV, v = i - m * DV;
        s_x[i] = *reinterpret_cast<const uint4*>(x + (long long)m * ldx + (long long)v * VEC);
    }
    __syncthreads();
    if (check_x && first && tid == 0) {
        unsigned long long total = 0;
        for (int w = 0; w < DECODE_WARPS; ++w) total += (unsigned long long)s_cnt[w];
        counters[3] = total;
    }
    __syncthreads();  // s_cnt is reused for the active counts below

    const int n0 = (nblock * DECODE_WARPS + warp) * DECODE_NPW;
    const uint4* wg = reinterpret_cast<const uint4*>(w_gate);
    A gs[DECODE_NPW][MR];
#pragma unroll
    for (int k = 0; k < DECODE_NPW; ++k)
#pragma unroll
        for (int m = 0; m < MR; ++m) gs[k][m] = A(0);
    // two iterations in flight where the registers allow (fp32 at MR = 8 and fp64 on sm_75 spilled)
    constexpr int UNROLL = (sizeof(T) == 8 || (sizeof(T) == 4 && MR > 4)) ? 1 : 2;
#pragma unroll UNROLL
    for (int v = lane; v < DV; v += 32) {
        uint4 wv[DECODE_NPW];
#pragma unroll
        for (int k = 0; k < DECODE_NPW; ++k)
            wv[k] = (n0 + k < H) ? __ldg(wg + (long long)(n0 + k) * DV + v) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int m = 0; m < MR; ++m) {
            if (m < Mg) {  // a guard rather than an early exit: the loops stay unrolled, gs in registers
                A xa[VEC];
                unpack16<T, A>(s_x[m * DV + v], xa);
#pragma unroll
                for (int k = 0; k < DECODE_NPW; ++k) {
                    A wa[VEC];
                    unpack16<T, A>(wv[k], wa);
                    A s = gs[k][m];
#pragma unroll
                    for (int e = 0; e < VEC; ++e) s += xa[e] * wa[e];
                    gs[k][m] = s;
                }
            }
        }
    }
    int my_active = 0;  // meaningful in lane 0
#pragma unroll
    for (int k = 0; k < DECODE_NPW; ++k) {
        const int n = n0 + k;
        A g[MR];
        bool act[MR];
        unsigned rows = 0;  // bit m: active in row m
#pragma unroll
        for (int m = 0; m < MR; ++m) {
            // rounded to T as the general path's GEMM output is; warp-uniform after the butterfly
            g[m] = to_acc<A, T>(from_acc<T, A>(warp_total(gs[k][m])));
            act[m] = m < Mg && !(g[m] <= A(0));
            rows |= act[m] ? 1u << m : 0u;
        }
        const bool any = rows != 0u;
        if (n >= H) continue;  // warp-uniform: no shuffle below is skipped by part of a warp
        A hv[MR];
#pragma unroll
        for (int m = 0; m < MR; ++m) hv[m] = act[m] ? g[m] : A(0);
        if (GATED && any) {
            const uint4* wu = reinterpret_cast<const uint4*>(w_up) + (long long)n * DV;
            A us[MR];
#pragma unroll
            for (int m = 0; m < MR; ++m) us[m] = A(0);
            for (int v = lane; v < DV; v += 32) {
                A wa[VEC];
                unpack16<T, A>(__ldg(wu + v), wa);
#pragma unroll
                for (int m = 0; m < MR; ++m) {
                    if (m < Mg) {
                        A xa[VEC];
                        unpack16<T, A>(s_x[m * DV + v], xa);
                        A s = us[m];
#pragma unroll
                        for (int e = 0; e < VEC; ++e) s += xa[e] * wa[e];
                        us[m] = s;
                    }
                }
            }
#pragma unroll
            for (int m = 0; m < MR; ++m) {
                const A u = warp_total(us[m]);
                hv[m] = act[m] ? g[m] * u : A(0);
            }
        }
        if (lane == 0) {
#pragma unroll
            for (int m = 0; m < MR; ++m) {
                if (m < Mg) {
                    h[(long long)m * H + n] = hv[m];
                    if (h_out != nullptr) h_out[(long long)m * ldh + n] = from_acc<T, A>(hv[m]);
                    my_active += act[m] ? 1 : 0;
                }
            }
            active_rows[n] = (unsigned short)rows;
        }
    }
    if (lane == 0) s_cnt[warp] = my_active;
    __syncthreads();
    if (tid == 0) {
        int total = 0;
        for (int w = 0; w < DECODE_WARPS; ++w) total += s_cnt[w];
        blk_active[(long long)group * gridDim.y + nblock] = total;
    }
}

// ---------------------------------------------------------------------------
// twellpy_ffn_decode_down<T, MR>: y = h @ w_down.T over the active neurons.
//   h          (M, H)   A      from twellpy_ffn_decode_gate
//   active_rows (G, Hp) uint16 from twellpy_ffn_decode_gate; Hp = H rounded up
//                              to 8, the padding zero
//   w_downT    (H, D)   T      row n = column n of w_down
//   y          (M, ldy) T      out, 16-byte aligned rows
//   blk_active (n_blk,) int    from twellpy_ffn_decode_gate (all G * n_gate_blocks entries)
//   counters   (4,)     uint64 block (0, 0) writes [0] = active (row, neuron)
//                              pairs, [1] = 0 (no heavy rows on this path)
//   M, D, H, n_blk
// Grid: (ceil(D / VEC / 32), G) blocks of DECODE_THREADS threads, G = ceil(M / MR);
// lane l of every warp of block (b, g) owns the 16-byte vector b * 32 + l of the
// rows g * MR + m of y. The block
// lists the active neurons of a window (DECODE_WINDOW flags) in order, its
// warps take every DECODE_WARPS-th entry, and the warps' sums are added in
// warp order: a fixed order, so the bits do not depend on timing (they do depend
// on which neurons the other rows of the row group fire: the list is their union, so
// a row's bits depend on the group it falls in).
// Each listed neuron adds h * w to exactly the rows it is active in, h = 0
// included (as the general path's list does), and nothing to the others.
// ---------------------------------------------------------------------------
template <typename T, int MR>
__global__ void __launch_bounds__(DECODE_THREADS, 1)
twellpy_ffn_decode_down(const typename twellpy::accum<T>::type* __restrict__ h,
                        const unsigned short* __restrict__ active_rows, const T* __restrict__ w_downT,
                        T* __restrict__ y, long long ldy, const int* __restrict__ blk_active, int n_blk,
                        unsigned long long* __restrict__ counters, int M, int D, int H) {
    using namespace twellpy_decode;
    typedef typename twellpy::accum<T>::type A;
    constexpr int VEC = vec_of<T>::n;
    __shared__ int s_idx[DECODE_WINDOW];              // the window's active neurons, in order
    __shared__ unsigned short s_rows[DECODE_WINDOW];  // and the rows each is active in
    __shared__ int s_warp[DECODE_WARPS + 1];
    __shared__ A s_red[DECODE_WARPS][32][VEC];
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int DV = D / VEC;
    const int v = blockIdx.x * 32 + lane;
    const bool mine = v < DV;
    const int row0 = blockIdx.y * MR;
    const int Mg = min(MR, M - row0);  // rows of this group, 1..MR
    h += (long long)row0 * H;
    y += (long long)row0 * ldy;
    active_rows += (long long)blockIdx.y * ((H + 7) / 8 * 8);

    if (blockIdx.x == 0 && blockIdx.y == 0) {  // activity statistics (an integer sum: any order gives the same)
        int s = 0;
        for (int i = tid; i < n_blk; i += DECODE_THREADS) s += blk_active[i];
        int total;
        block_exclusive(s, lane, warp, s_warp, &total);
        if (tid == 0) {
            counters[0] = (unsigned long long)total;
            counters[1] = 0ull;
        }
    }

    A acc[MR][VEC];
#pragma unroll
    for (int m = 0; m < MR; ++m)
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[m][e] = A(0);

    const uint4* flags = reinterpret_cast<const uint4*>(active_rows);
    const int n_flag_vecs = (H + 7) / 8;
    const uint4* wd = reinterpret_cast<const uint4*>(w_downT);
    for (int base = 0; base < n_flag_vecs; base += DECODE_THREADS) {
        // list this window's active neurons in order, with their row masks
        const int fv = base + tid;
        const uint4 f = fv < n_flag_vecs ? flags[fv] : make_uint4(0u, 0u, 0u, 0u);
        const unsigned words[4] = {f.x, f.y, f.z, f.w};
        int cnt = 0;
#pragma unroll
        for (int q = 0; q < 4; ++q) cnt += __popc(nonzero_halves(words[q]));
        int total;
        int pos = block_exclusive(cnt, lane, warp, s_warp, &total);
        if (cnt) {
#pragma unroll
            for (int q = 0; q < 4; ++q)
#pragma unroll
                for (int b = 0; b < 2; ++b) {
                    const unsigned rows = (words[q] >> (16 * b)) & 0xffffu;
                    if (rows) {
                        s_idx[pos] = fv * 8 + q * 2 + b;
                        s_rows[pos++] = (unsigned short)rows;
                    }
                }
        }
        __syncthreads();
        // two neurons a step per warp: their w_down rows are loaded together
        for (int i = warp; i < total; i += 2 * DECODE_WARPS) {
            const int i2 = i + DECODE_WARPS;
            const int n1 = s_idx[i], n2 = i2 < total ? s_idx[i2] : 0;
            const unsigned r1 = s_rows[i], r2 = i2 < total ? s_rows[i2] : 0u;  // r2 = 0: no second entry
            const uint4 v1 = mine ? __ldg(wd + (long long)n1 * DV + v) : make_uint4(0u, 0u, 0u, 0u);
            const uint4 v2 = (mine && r2) ? __ldg(wd + (long long)n2 * DV + v) : make_uint4(0u, 0u, 0u, 0u);
            A w1[VEC], w2[VEC];
            unpack16<T, A>(v1, w1);
            unpack16<T, A>(v2, w2);
#pragma unroll
            for (int m = 0; m < MR; ++m) {
                if ((r1 >> m) & 1u) {  // warp-uniform (a shared-memory broadcast)
                    const A hv = h[(long long)m * H + n1];
#pragma unroll
                    for (int e = 0; e < VEC; ++e) acc[m][e] += hv * w1[e];
                }
                if ((r2 >> m) & 1u) {
                    const A hv = h[(long long)m * H + n2];
#pragma unroll
                    for (int e = 0; e < VEC; ++e) acc[m][e] += hv * w2[e];
                }
            }
        }
        __syncthreads();  // the next window rewrites s_idx and s_rows
    }

    // the warps' partial sums, added in warp order
#pragma unroll
    for (int m = 0; m < MR; ++m) {
        if (m >= Mg) continue;  // block-uniform: the barriers below are reached by every thread
#pragma unroll
        for (int e = 0; e < VEC; ++e) s_red[warp][lane][e] = acc[m][e];
        __syncthreads();
        if (warp == 0 && mine) {
            vec_t<T, VEC> out;
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                A s = A(0);
                for (int w = 0; w < DECODE_WARPS; ++w) s += s_red[w][lane][e];
                out.v[e] = from_acc<T, A>(s);
            }
            store_vec<T, VEC>(y + (long long)m * ldy + (long long)v * VEC, out);
        }
        __syncthreads();
    }
}
