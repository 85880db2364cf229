// train_ffn.cu -- kernels of the sparse FFN training step and of the public
// training primitives (twellpy.ops): ReLU pattern extraction straight from the
// gate GEMM output, CSR -> Hybrid packing, fused forward (SDDMM + SpMM),
// fused backward (SDDMM + L1 injection + SpMM), a deterministic transpose by
// counting sort, and gather-based SpMM^T / weight gradients.
//
// Layout conventions (see docs/internals.md):
//   * dense matrices are row-major, C-contiguous;
//   * the ELL part of a Hybrid is (M, W) values + (M, W) int32 column ids,
//     padding = (0, -1), plus (M,) int32 stored counts (0 for backup rows);
//   * "combined" value buffers hold the ELL values (M*W) followed by the
//     dense backup rows (R*N); a transposed entry's `pos` indexes them.
//
// Determinism: no kernel here uses floating-point atomics. Integer atomics
// are used on counters that one warp owns for a row at a time (slot positions),
// and on per-neuron counts whose sums do not depend on the order, so every
// output (padding included) is the same bit pattern on every run.
#include "common.cuh"

#ifndef TW_WARPS
#define TW_WARPS 8  // warps per block of the warp-per-row kernels
#endif
#ifndef TW_PACK_UNROLL
#define TW_PACK_UNROLL 4  // 16-byte loads in flight per lane in relu_to_hybrid's ELL rows (as ffn_rowpack)
#endif
// 1: relu_to_hybrid reads the gate output with streaming (evict-first) loads, as
// ffn_rowpack does; 0: read-only cached loads. benchmarks/count_pack_probe.py times both.
#ifndef TW_PACK_STREAM
#define TW_PACK_STREAM 0
#endif
// 1: relu_count, relu_pack and relu_to_hybrid test a 16-bit vector's values two at a time
// on its 32-bit words (relu_on_bits) and skip the warp scan where no lane (or no lane more
// than once) is active; 0: relu_on a value at a time and the scan every time (the pack was
// instruction-bound: 74% issue on an H100, 2026-12-07). Same bits either way (CPU emulation
// of every 16-bit pattern; the GPU tests compare both settings on every pattern). On since
// an H100 run (2026-12-07): relu_count_pack 0.160 -> 0.125 ms at W1-16k, faster in every round.
#ifndef TW_PACK_WORDS
#define TW_PACK_WORDS 1
#endif
// vec = 2 in twellpy_train_fwd / _bwd: each lane keeps its TW_XREG 16-byte vectors of
// the x (dy) row in registers (so D <= 32 * TW_XREG * 16 / sizeof(T)) instead of
// re-reading the row for every slot's dot product, and the dot products of
// TW_SLOT_BATCH slots gather their weight rows together.
#ifndef TW_XREG
#define TW_XREG 8
#endif
// Defaults: one slot at a time, the row in shared memory, the fastest of the variants on
// an H100 (2026-12-07: batches of 2 and 4 were 1.4-1.9x slower, registers 1.1x slower).
#ifndef TW_SLOT_BATCH
#define TW_SLOT_BATCH 1
#endif
// Where vec = 2 keeps the row: 0 in registers, 1 in shared memory (TW_WARPS * TW_XREG *
// 512 bytes a block), which leaves the registers to the weight gathers in flight.
#ifndef TW_XSRC_SMEM
#define TW_XSRC_SMEM 1
#endif
// 0 compiles the vec = 2 loops out of twellpy_train_fwd / _bwd / _ell_y / _ell_dx (vec = 2
// then runs the vec = 1 loops): their registers would otherwise cut the resident warps of
// the vec = 1 loops that share the kernel (sm_90a, bf16: 124-125 registers a thread with the
// row in registers, 80 with this 0; 52-56 before the row loops were written). The launcher
// passes 0 when the row loops are off.
#ifndef TW_ROW_LOOPS
#define TW_ROW_LOOPS 1
#endif
// Resident blocks per SM twellpy_train_fwd / _bwd are register-sized for (launch bound):
// 1 leaves the compiler free (157-168 registers at bf16 with the row in registers and
// batches of 2, 96-108 in shared memory), 2 caps a thread at 128, 3 at 80.
#ifndef TW_ROW_MIN_BLOCKS
#define TW_ROW_MIN_BLOCKS 1
#endif
#ifndef TW_GATHER_THREADS
#define TW_GATHER_THREADS 128  // threads per block of the gather (SpMM^T) kernels
#endif

static_assert(TW_WARPS >= 1 && TW_WARPS <= 32, "TW_WARPS must be in [1, 32]");
static_assert(TW_PACK_UNROLL >= 1 && TW_PACK_UNROLL <= 8, "TW_PACK_UNROLL must be in [1, 8]");
static_assert(TW_XREG >= 1 && TW_XREG <= 16, "TW_XREG must be in [1, 16]");
static_assert(TW_SLOT_BATCH >= 1 && TW_SLOT_BATCH <= 8, "TW_SLOT_BATCH must be in [1, 8]");
static_assert(TW_GATHER_THREADS % 32 == 0 && TW_GATHER_THREADS <= 1024,
              "TW_GATHER_THREADS must be a multiple of 32, at most 1024");

namespace twellpy_train {
using namespace twellpy;

// Elements of T in one 16-byte vector load.
template <typename T> struct VecN { static constexpr int N = 16 / (int)sizeof(T); };

template <typename T, typename A>
__device__ __forceinline__ void load_vec(const T* p, A* out) {
    uint4 raw = __ldg(reinterpret_cast<const uint4*>(p));
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < VecN<T>::N; ++i) out[i] = to_acc<A, T>(e[i]);
}

template <typename T, typename A>
__device__ __forceinline__ void store_vec(T* p, const A* v) {
    uint4 raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < VecN<T>::N; ++i) e[i] = from_acc<T, A>(v[i]);
    *reinterpret_cast<uint4*>(p) = raw;
}

// relu(v) != 0, decided on bits so that -ftz cannot hide a positive denormal:
// strictly positive (denormals included) or NaN.
__device__ __forceinline__ bool relu_on(float v) {
    unsigned b = __float_as_uint(v), m = b & 0x7fffffffu;
    return m > 0x7f800000u || (m != 0u && !(b >> 31));
}
__device__ __forceinline__ bool relu_on(double v) {
    unsigned long long b = (unsigned long long)__double_as_longlong(v);
    unsigned long long m = b & 0x7fffffffffffffffull;
    return m > 0x7ff0000000000000ull || (m != 0ull && !(b >> 63));
}
__device__ __forceinline__ bool relu_on(__half v) {
    unsigned short b = __half_as_ushort(v), m = b & 0x7fffu;
    return m > 0x7c00u || (m != 0u && !(b >> 15));
}
__device__ __forceinline__ bool relu_on(__nv_bfloat16 v) {
    unsigned short b = __bfloat16_as_ushort(v), m = b & 0x7fffu;
    return m > 0x7f80u || (m != 0u && !(b >> 15));
}

// relu_on of the N values of a 16-byte vector, as bits (bit i: value i); 16-bit types two
// values a 32-bit word (relu_bits16, every positive magnitude counts: LEAST = 1).
template <typename T> __device__ __forceinline__ unsigned relu_on_bits(const uint4& raw) {
    const T* e = reinterpret_cast<const T*>(&raw);
    unsigned bits = 0u;
#pragma unroll
    for (int i = 0; i < VecN<T>::N; ++i) bits |= (relu_on(e[i]) ? 1u : 0u) << i;
    return bits;
}
#if TW_PACK_WORDS
template <> __device__ __forceinline__ unsigned relu_on_bits<__nv_bfloat16>(const uint4& raw) {
    return relu_bits16<BF16_INF, 1u>(raw);
}
template <> __device__ __forceinline__ unsigned relu_on_bits<__half>(const uint4& raw) {
    return relu_bits16<HALF_INF, 1u>(raw);
}
#endif

// finite (neither NaN nor Inf), decided on bits (no float compare that -ftz could change)
__device__ __forceinline__ bool finite_acc(float v) { return (__float_as_uint(v) & 0x7f800000u) != 0x7f800000u; }
__device__ __forceinline__ bool finite_acc(double v) {
    return ((unsigned long long)__double_as_longlong(v) & 0x7ff0000000000000ull) != 0x7ff0000000000000ull;
}
__device__ __forceinline__ float abs_acc(float v) { return fabsf(v); }
__device__ __forceinline__ double abs_acc(double v) { return fabs(v); }

template <typename A> __device__ __forceinline__ A sign_of(A h) {
    return h > A(0) ? A(1) : (h < A(0) ? A(-1) : (h == h ? A(0) : h));
}

// h = g * u rounded to the storage type (as a dense bf16 forward would), or
// the stored ReLU value itself for the non-gated FFN.
template <typename T, typename A, int GATED>
__device__ __forceinline__ A h_value(T g, T u) {
    if (GATED) return to_acc<A, T>(from_acc<T, A>(to_acc<A, T>(g) * to_acc<A, T>(u)));
    return to_acc<A, T>(g);
}

// Warp-wide dot product of two length-D rows; every lane gets the sum. The
// reduction order is fixed, so the result is deterministic.
template <typename T, typename A>
__device__ __forceinline__ A warp_dot(const T* __restrict__ a, const T* __restrict__ b, int D, int vec,
                                      int lane) {
    A s = A(0);
    if (vec) {
        constexpr int N = VecN<T>::N;
#pragma unroll 4
        for (int c = lane * N; c < D; c += 32 * N) {
            A av[N], bv[N];
            load_vec<T, A>(a + c, av);
            load_vec<T, A>(b + c, bv);
#pragma unroll
            for (int i = 0; i < N; ++i) s += av[i] * bv[i];
        }
    } else {
        for (int c = lane; c < D; c += 32) s += to_acc<A, T>(a[c]) * to_acc<A, T>(b[c]);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    return s;
}

// A warp's copy of one x (dy) row for vec = 2: lane l's vector j (j < TW_XREG) holds the
// columns (32 j + l) * N .. + N - 1, the ones warp_dot's vector loop gives it (zeros past D).
struct RowRegs {  // in the lane's registers
    uint4 v[TW_XREG];
    __device__ __forceinline__ uint4 get(int j, int) const { return v[j]; }
    __device__ __forceinline__ void put(int j, int, uint4 x) { v[j] = x; }
};
struct RowSmem {  // in the warp's TW_XREG * 512 bytes of shared memory
    uint4* p;
    __device__ __forceinline__ uint4 get(int j, int lane) const { return p[j * 32 + lane]; }
    __device__ __forceinline__ void put(int j, int lane, uint4 x) { p[j * 32 + lane] = x; }
};

template <typename T, typename Row>
__device__ __forceinline__ void load_row(const T* __restrict__ row, int D, int lane, Row& xr) {
    constexpr int N = VecN<T>::N;
#pragma unroll
    for (int j = 0; j < TW_XREG; ++j) {
        const int c = (j * 32 + lane) * N;
        xr.put(j, lane, (c < D) ? __ldg(reinterpret_cast<const uint4*>(row + c)) : make_uint4(0u, 0u, 0u, 0u));
    }
    __syncwarp();  // shared rows: every lane's vectors are written before any is read
}

// warp_dot (vector path) of a register-held row with the weight rows w[k[b]], b < live,
// for KB slots at once: every weight load of the batch is issued before any product,
// and the butterflies of the batch interleave. Per slot the products, their order and
// the reduction are warp_dot's, so the results are the same bits. out[b] for b >= live
// is meaningless.
template <typename T, typename A, int KB, typename Row>
__device__ __forceinline__ void warp_dots_row(const Row& xr, const T* __restrict__ w, const int (&k)[KB], int live,
                                              int D, int lane, A (&out)[KB]) {
    constexpr int N = VecN<T>::N;
    uint4 wv[KB][TW_XREG];
#pragma unroll
    for (int b = 0; b < KB; ++b) {
        const T* wr = w + (long long)(b < live ? k[b] : 0) * D;
#pragma unroll
        for (int j = 0; j < TW_XREG; ++j) {
            const int c = (j * 32 + lane) * N;
            if (c < D) wv[b][j] = __ldg(reinterpret_cast<const uint4*>(wr + c));
            else wv[b][j] = make_uint4(0u, 0u, 0u, 0u);
        }
    }
#pragma unroll
    for (int b = 0; b < KB; ++b) {
        A s = A(0);
#pragma unroll
        for (int j = 0; j < TW_XREG; ++j) {
            if ((j * 32 + lane) * N < D) {
                A xa[N], wa[N];
                unpack16<T, A>(xr.get(j, lane), xa);
                unpack16<T, A>(wv[b][j], wa);
#pragma unroll
                for (int i = 0; i < N; ++i) s += xa[i] * wa[i];
            }
        }
        out[b] = s;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
#pragma unroll
        for (int b = 0; b < KB; ++b) out[b] += __shfl_xor_sync(0xffffffffu, out[b], off);
    }
}

// out_row = sum over the slots s < n, in slot order, of a_s * wa[k_s] (+ b_s * wb[k_s] when
// DUAL), one fp32 (fp64) accumulator per column, 16-byte vectors (the vec = 1 loops' products
// in their order, so the same bits). The coefficients come from the row's slot values p and q:
// PROD (the forward's y): a_s = h_value<GATED>(p_s, q_s); otherwise (the backward's dx)
// a_s = p_s, b_s = q_s. Each lane loads one slot's column and coefficients, 32 slots at a
// time, and shuffles broadcast them, so no weight gather waits for a dependent load.
template <typename T, typename A, bool DUAL, bool PROD, int GATED>
__device__ __forceinline__ void warp_slot_axpys(int n, const int* __restrict__ idx_row, const T* __restrict__ p,
                                                const T* __restrict__ q, const T* __restrict__ wa,
                                                const T* __restrict__ wb, T* __restrict__ out_row, int D,
                                                int lane) {
    constexpr int N = VecN<T>::N;
    const int chunks = (D + 32 * N - 1) / (32 * N);  // warp-uniform: every lane joins the shuffles
    for (int j = 0; j < chunks; ++j) {
        const int c = (j * 32 + lane) * N;
        const bool col_ok = c < D;
        A acc[N];
#pragma unroll
        for (int i = 0; i < N; ++i) acc[i] = A(0);
        for (int g0 = 0; g0 < n; g0 += 32) {
            int mk = 0;
            A ma = A(0), mb = A(0);
            const int s = g0 + lane;
            if (s < n) {
                mk = idx_row[s];
                if (PROD) {
                    ma = h_value<T, A, GATED>(p[s], q[s]);
                } else {
                    ma = to_acc<A, T>(p[s]);
                    if (DUAL) mb = to_acc<A, T>(q[s]);
                }
            }
            const int cnt = min(32, n - g0);
#pragma unroll 4
            for (int t = 0; t < cnt; ++t) {
                const long long k = __shfl_sync(0xffffffffu, mk, t);
                const A a = __shfl_sync(0xffffffffu, ma, t);
                A wv[N];
                if (col_ok) {
                    load_vec<T, A>(wa + k * D + c, wv);
#pragma unroll
                    for (int i = 0; i < N; ++i) acc[i] = fma(a, wv[i], acc[i]);
                }
                if (DUAL) {
                    const A b = __shfl_sync(0xffffffffu, mb, t);
                    if (col_ok) {
                        load_vec<T, A>(wb + k * D + c, wv);
#pragma unroll
                        for (int i = 0; i < N; ++i) acc[i] = fma(b, wv[i], acc[i]);
                    }
                }
            }
        }
        if (col_ok) store_vec<T, A>(out_row + c, acc);
    }
}

// vec = 2's dot products of a warp's row (x or dy, length D, read once into registers or
// shared memory) with the weight rows w[idx_row[s]] of its n slots, TW_SLOT_BATCH slots at a
// time; done(s, value) receives them in slot order.
template <typename T, typename A, typename Done>
__device__ __forceinline__ void row_slot_dots(const T* __restrict__ row, const T* __restrict__ w,
                                              const int* __restrict__ idx_row, int n, int D, int lane, Done done) {
#if TW_XSRC_SMEM
    __shared__ uint4 s_rows[TW_WARPS][TW_XREG * 32];
    RowSmem xrow{s_rows[threadIdx.x >> 5]};
#else
    RowRegs xrow;
#endif
    load_row<T>(row, D, lane, xrow);
    for (int s0 = 0; s0 < n; s0 += TW_SLOT_BATCH) {
        const int live = min(TW_SLOT_BATCH, n - s0);
        int k[TW_SLOT_BATCH];
        A v[TW_SLOT_BATCH];
#pragma unroll
        for (int b = 0; b < TW_SLOT_BATCH; ++b) k[b] = (b < live) ? idx_row[s0 + b] : 0;
        warp_dots_row<T, A, TW_SLOT_BATCH>(xrow, w, k, live, D, lane, v);
#pragma unroll
        for (int b = 0; b < TW_SLOT_BATCH; ++b)
            if (b < live) done(s0 + b, v[b]);
    }
}

// The forward's slot epilogue: u rounded to T into uval[at] (lane 0), returns |h| of the slot.
template <typename T, typename A>
__device__ __forceinline__ A fwd_slot_u(T* __restrict__ uval, const T* __restrict__ gval, long long at, A u,
                                        int lane) {
    const T ut = from_acc<T, A>(u);
    if (lane == 0) uval[at] = ut;
    return abs_acc(h_value<T, A, 1>(gval[at], ut));
}

// The backward's slot epilogue: dh (+ the L1 term) into du, dg (GATED) or dh (lane 0).
template <typename T, typename A, int GATED>
__device__ __forceinline__ void bwd_slot_d(const T* __restrict__ gval, const T* __restrict__ uval,
                                           T* __restrict__ da, T* __restrict__ db, long long at, A dh, double l1s,
                                           int lane) {
    const T g = gval[at];
    const T u = GATED ? uval[at] : g;
    // as the backup-row kernel and the numpy twin: no L1 term (not 0 * sign, NaN for a NaN h) when l1 = 0
    if (l1s != 0.0) dh += A(l1s) * sign_of<A>(h_value<T, A, GATED>(g, u));
    if (lane == 0) {
        if (GATED) {
            da[at] = from_acc<T, A>(dh * to_acc<A, T>(g));
            db[at] = from_acc<T, A>(dh * to_acc<A, T>(u));
        } else {
            da[at] = from_acc<T, A>(dh);
        }
    }
}

}  // namespace twellpy_train

using namespace twellpy;
using namespace twellpy_train;

// ---------------------------------------------------------------------------
// twellpy_train_relu_count<T>: stored entries of relu(z) per row.
//   z        (rows, H) T     gate GEMM output (one row chunk)
//   row_nnz  (rows,)   int   out
// One warp per row; vec = 1 when rows start 16-byte aligned and H*sizeof(T) % 16 == 0.
template <typename T>
__global__ void __launch_bounds__(32 * TW_WARPS)
twellpy_train_relu_count(const T* __restrict__ z, long long rows, int H, int vec, int* __restrict__ row_nnz) {
    const int lane = threadIdx.x & 31;
    const long long r = (long long)blockIdx.x * TW_WARPS + (threadIdx.x >> 5);
    if (r >= rows) return;
    const T* zr = z + r * (long long)H;
    int n = 0;
    if (vec) {
        constexpr int N = VecN<T>::N;
#pragma unroll 4
        for (int c = lane * N; c < H; c += 32 * N) {
            n += __popc(relu_on_bits<T>(__ldg(reinterpret_cast<const uint4*>(zr + c))));
        }
    } else {
        for (int c = lane; c < H; c += 32) n += relu_on(zr[c]) ? 1 : 0;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) n += __shfl_xor_sync(0xffffffffu, n, off);
    if (lane == 0) row_nnz[r] = n;
}

// twellpy_train_relu_pack<T>: CSR of relu(z), columns ascending; positions come
// from warp prefix counts (ballot / shuffle scan), never from atomics.
//   z        (rows, H) T
//   indptr   (rows+1,) long long   row starts in col/val (exclusive scan of row_nnz)
//   col      (nnz,)    int   out
//   val      (nnz,)    T     out (relu(z) = z on the pattern; NaN kept)
template <typename T>
__global__ void __launch_bounds__(32 * TW_WARPS)
twellpy_train_relu_pack(const T* __restrict__ z, long long rows, int H, int vec,
                        const long long* __restrict__ indptr, int* __restrict__ col, T* __restrict__ val) {
    const int lane = threadIdx.x & 31;
    const long long r = (long long)blockIdx.x * TW_WARPS + (threadIdx.x >> 5);
    if (r >= rows) return;
    const T* zr = z + r * (long long)H;
    long long pos = indptr[r];
    if (vec) {
        constexpr int N = VecN<T>::N;
        for (int c0 = 0; c0 < H; c0 += 32 * N) {
            const int c = c0 + lane * N;
            uint4 raw = make_uint4(0u, 0u, 0u, 0u);
            unsigned bitsm = 0u;
            if (c < H) {  // H % N == 0 here, so the whole vector is in range
                raw = __ldg(reinterpret_cast<const uint4*>(zr + c));
                bitsm = relu_on_bits<T>(raw);
            }
            int total;
            long long p = pos + warp_exclusive_count<(TW_PACK_WORDS != 0)>(__popc(bitsm), lane, total);
            const T* e = reinterpret_cast<const T*>(&raw);
            if (bitsm != 0u) {
#pragma unroll
                for (int i = 0; i < N; ++i) {
                    if ((bitsm >> i) & 1u) {
                        col[p] = c + i;
                        val[p] = e[i];
                        ++p;
                    }
                }
            }
            pos += total;
        }
    } else {
        const unsigned below = (1u << lane) - 1u;
        for (int c0 = 0; c0 < H; c0 += 32) {
            const int c = c0 + lane;
            T v = c < H ? zr[c] : zero_value<T>();
            const bool on = c < H && relu_on(v);
            const unsigned mask = __ballot_sync(0xffffffffu, on);
            if (on) {
                const long long p = pos + __popc(mask & below);
                col[p] = c;
                val[p] = v;
            }
            pos += __popc(mask);
        }
    }
}

// twellpy_train_relu_to_hybrid<T>: relu(z) straight into a Hybrid, no CSR in
// between (the forward's path when one chunk holds every row). The host has
// read relu_count's counts and chosen W and the backup rows, so every row
// knows where it goes: rows with row_map < 0 pack their active columns
// (ascending, positions from warp prefix counts) into the ELL slots; backup
// rows are written whole (relu(z), zeros included), so the backup part needs
// no zero fill. neuron_counts gets +1 per active entry: integer atomics, so
// the counts are exact and the same on every run whatever the order.
//   z             (rows, H) T     gate GEMM output, rows = M
//   row_map       (M,)    int     -1, or the row's position in backup
//   ell_val       (M, W)  T       out (padding 0)
//   ell_idx       (M, W)  int     out (padding -1)
//   ell_nnz       (M,)    int     out (0 for backup rows)
//   backup        (R, H)  T       out
//   neuron_counts (H,)    int     in/out, zero-filled by the caller
// vec = 1: z rows start 16-byte aligned and H*sizeof(T) % 16 == 0 (vector loads);
// vec_store = 1: so do the backup rows (vector stores; the backup part starts
// after M*W ELL values, so it is aligned only when M*W*sizeof(T) % 16 == 0).
// Rows go to the ELL part only when relu_count (the same relu_on test on the
// same z) counted at most W active columns, so the p < W guards never drop
// an entry; they only keep a broken caller from writing out of bounds (such a
// caller would also see neuron_counts count entries the ELL part does not hold).
// mode (a speculative forward knows W before reading z, so one read can count and pack):
//   0  as above (row_map from relu_count's counts; token_counts unused)
//   1  count and pack: row_map is not read; every row is scanned as an ELL row, its
//      active count goes to token_counts, and a row of more than W (a backup row to
//      be) keeps padding and ell_nnz 0; neuron_counts counts every active entry
//   2  the backup rows alone, after mode 1 and row_maps: rows with row_map < 0 return
//      at once; the others write their dense backup row (no neuron counts: mode 1
//      counted them), leaving their ELL slots as mode 1 left them
template <typename T>
__global__ void __launch_bounds__(32 * TW_WARPS)
twellpy_train_relu_to_hybrid(const T* __restrict__ z, long long M, int H, int vec, int vec_store,
                             const int* __restrict__ row_map, int W, T* __restrict__ ell_val,
                             int* __restrict__ ell_idx, int* __restrict__ ell_nnz, T* __restrict__ backup,
                             int* __restrict__ neuron_counts, int* __restrict__ token_counts, int mode) {
    const int lane = threadIdx.x & 31;
    const long long r = (long long)blockIdx.x * TW_WARPS + (threadIdx.x >> 5);
    if (r >= M) return;
    const T* zr = z + r * (long long)H;
    const int rm = mode == 1 ? -1 : row_map[r];
    if (mode == 2 && rm < 0) return;
    const bool count_neurons = mode != 2;
    const long long base = r * (long long)W;
    int pos = 0;  // active columns of this row seen so far (the same on every lane)
    if (rm >= 0) {
        T* br = backup + (long long)rm * H;
        if (vec) {
            constexpr int N = VecN<T>::N;
            for (int c = lane * N; c < H; c += 32 * N) {
                uint4 raw = __ldg(reinterpret_cast<const uint4*>(zr + c));
                T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
                for (int i = 0; i < N; ++i) {
                    if (!relu_on(e[i])) e[i] = zero_value<T>();
                    else if (count_neurons) atomicAdd(neuron_counts + c + i, 1);
                }
                if (vec_store) {
                    *reinterpret_cast<uint4*>(br + c) = raw;
                } else {
#pragma unroll
                    for (int i = 0; i < N; ++i) br[c + i] = e[i];
                }
            }
        } else {
            for (int c = lane; c < H; c += 32) {
                const T v = zr[c];
                const bool on = relu_on(v);
                if (on && count_neurons) atomicAdd(neuron_counts + c, 1);
                br[c] = on ? v : zero_value<T>();
            }
        }
    } else if (vec) {
        constexpr int N = VecN<T>::N;
        constexpr int U = TW_PACK_UNROLL;
        for (int b0 = 0; b0 < H; b0 += 32 * N * U) {
            // U loads in flight per lane before any is packed (one at a time left
            // the warp waiting a full memory latency per 512 bytes)
            uint4 raw[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int c = b0 + (u * 32 + lane) * N;  // H % N == 0 here: a vector is all in or all out
#if TW_PACK_STREAM
                raw[u] = c < H ? __ldcs(reinterpret_cast<const uint4*>(zr + c)) : make_uint4(0u, 0u, 0u, 0u);
#else
                raw[u] = c < H ? __ldg(reinterpret_cast<const uint4*>(zr + c)) : make_uint4(0u, 0u, 0u, 0u);
#endif
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int c = b0 + (u * 32 + lane) * N;
                const T* e = reinterpret_cast<const T*>(&raw[u]);
                const unsigned bitsm = c < H ? relu_on_bits<T>(raw[u]) : 0u;
                int total;
                int p = pos + warp_exclusive_count<(TW_PACK_WORDS != 0)>(__popc(bitsm), lane, total);
                if (bitsm != 0u) {
#pragma unroll
                    for (int i = 0; i < N; ++i) {
                        if ((bitsm >> i) & 1u) {
                            if (p < W) {
                                ell_val[base + p] = e[i];
                                ell_idx[base + p] = c + i;
                            }
                            atomicAdd(neuron_counts + c + i, 1);
                            ++p;
                        }
                    }
                }
                pos += total;
            }
        }
    } else {
        const unsigned below = (1u << lane) - 1u;
        for (int c0 = 0; c0 < H; c0 += 32) {
            const int c = c0 + lane;
            const T v = c < H ? zr[c] : zero_value<T>();
            const bool on = c < H && relu_on(v);
            const unsigned mask = __ballot_sync(0xffffffffu, on);
            if (on) {
                const int p = pos + __popc(mask & below);
                if (p < W) {
                    ell_val[base + p] = v;
                    ell_idx[base + p] = c;
                }
                atomicAdd(neuron_counts + c, 1);
            }
            pos += __popc(mask);
        }
    }
    if (mode == 2) return;  // mode 1 wrote this row's slots
    // a mode-1 row past W overwrites the slots its lanes filled: those stores must come first
    // (no shuffle follows the last ones, so nothing else orders them)
    __syncwarp();
    const int kept = (rm >= 0 || (mode == 1 && pos > W)) ? 0 : min(pos, W);
    for (int s = kept + lane; s < W; s += 32) {
        ell_val[base + s] = zero_value<T>();
        ell_idx[base + s] = -1;
    }
    if (lane == 0) {
        ell_nnz[r] = kept;
        if (mode == 1) token_counts[r] = pos;
    }
}

// twellpy_train_csr_to_hybrid<T>: split a CSR (sorted columns) into the ELL
// part (rows with row_map < 0) and dense backup rows (row_map >= 0).
//   indptr  (M+1,)  long long;  col (nnz,) int;  val (nnz,) T
//   row_map (M,)    int    -1, or the row's position in backup
//   ell_val (M, W)  T      out (padding 0)
//   ell_idx (M, W)  int    out (padding -1)
//   ell_nnz (M,)    int    out (0 for backup rows)
//   backup  (R, N)  T      out, must be zero-filled by the caller
template <typename T>
__global__ void __launch_bounds__(32 * TW_WARPS)
twellpy_train_csr_to_hybrid(const long long* __restrict__ indptr, const int* __restrict__ col,
                            const T* __restrict__ val, const int* __restrict__ row_map, long long M, int W,
                            int N, T* __restrict__ ell_val, int* __restrict__ ell_idx,
                            int* __restrict__ ell_nnz, T* __restrict__ backup) {
    const int lane = threadIdx.x & 31;
    const long long r = (long long)blockIdx.x * TW_WARPS + (threadIdx.x >> 5);
    if (r >= M) return;
    const long long start = indptr[r];
    const long long n = indptr[r + 1] - start;
    const int rm = row_map[r];
    const long long base = r * (long long)W;
    int kept = 0;
    if (rm >= 0) {
        T* br = backup + (long long)rm * N;
        for (long long e = lane; e < n; e += 32) {
            const int c = col[start + e];
            if (c >= 0 && c < N) br[c] = val[start + e];
        }
    } else {
        kept = (int)(n < W ? n : W);  // the caller sends every row with n > W to backup
        for (int s = lane; s < kept; s += 32) {
            ell_val[base + s] = val[start + s];
            ell_idx[base + s] = col[start + s];
        }
    }
    for (int s = kept + lane; s < W; s += 32) {
        ell_val[base + s] = zero_value<T>();
        ell_idx[base + s] = -1;
    }
    if (lane == 0) ell_nnz[r] = kept;
}

// ---------------------------------------------------------------------------
// y of one ELL row: sum over its n slots of h * w_downT[k] (h = g * u rounded to T, or g).
// vec 2: the slot metadata broadcast by shuffles; 1: 16-byte vectors; 0: scalars. 2 and 1
// give the same bits.
template <typename T, typename A, int GATED>
__device__ __forceinline__ void ell_y_row(int n, long long base, const int* __restrict__ idx,
                                          const T* __restrict__ gval, const T* __restrict__ uval,
                                          const T* __restrict__ w_downT, T* __restrict__ yr, int D, int vec,
                                          int lane) {
    if (TW_ROW_LOOPS && vec == 2) {
        warp_slot_axpys<T, A, false, true, GATED>(n, idx + base, gval + base, (GATED ? uval : gval) + base,
                                                  w_downT, w_downT, yr, D, lane);
    } else if (vec) {
        constexpr int N = VecN<T>::N;
        for (int c = lane * N; c < D; c += 32 * N) {
            A acc[N];
#pragma unroll
            for (int i = 0; i < N; ++i) acc[i] = A(0);
#pragma unroll 4
            for (int s = 0; s < n; ++s) {
                const int k = idx[base + s];
                const A h = h_value<T, A, GATED>(gval[base + s], GATED ? uval[base + s] : gval[base + s]);
                A wv[N];
                load_vec<T, A>(w_downT + (long long)k * D + c, wv);
#pragma unroll
                for (int i = 0; i < N; ++i) acc[i] = fma(h, wv[i], acc[i]);  // spelled: the split's bits
            }
            store_vec<T, A>(yr + c, acc);
        }
    } else {
        for (int c = lane; c < D; c += 32) {
            A acc = A(0);
            for (int s = 0; s < n; ++s) {
                const int k = idx[base + s];
                const A h = h_value<T, A, GATED>(gval[base + s], GATED ? uval[base + s] : gval[base + s]);
                acc = fma(h, to_acc<A, T>(w_downT[(long long)k * D + c]), acc);
            }
            yr[c] = from_acc<T, A>(acc);
        }
    }
}

// dx of one ELL row: sum over its n slots of da * w_a[k] (+ db * w_b[k] when GATED); vec as
// in ell_y_row.
template <typename T, typename A, int GATED>
__device__ __forceinline__ void ell_dx_row(int n, long long base, const int* __restrict__ idx,
                                           const T* __restrict__ da, const T* __restrict__ db,
                                           const T* __restrict__ w_a, const T* __restrict__ w_b,
                                           T* __restrict__ dxr, int D, int vec, int lane) {
    if (TW_ROW_LOOPS && vec == 2) {
        warp_slot_axpys<T, A, GATED != 0, false, GATED>(n, idx + base, da + base, db + base, w_a, w_b, dxr, D,
                                                        lane);
    } else if (vec) {
        constexpr int N = VecN<T>::N;
        for (int c = lane * N; c < D; c += 32 * N) {
            A acc[N];
#pragma unroll
            for (int i = 0; i < N; ++i) acc[i] = A(0);
#pragma unroll 4
            for (int s = 0; s < n; ++s) {
                const long long k = idx[base + s];
                const A a = to_acc<A, T>(da[base + s]);
                A wv[N];
                load_vec<T, A>(w_a + k * D + c, wv);
#pragma unroll
                for (int i = 0; i < N; ++i) acc[i] = fma(a, wv[i], acc[i]);  // spelled: the split's bits
                if (GATED) {
                    const A b = to_acc<A, T>(db[base + s]);
                    load_vec<T, A>(w_b + k * D + c, wv);
#pragma unroll
                    for (int i = 0; i < N; ++i) acc[i] = fma(b, wv[i], acc[i]);
                }
            }
            store_vec<T, A>(dxr + c, acc);
        }
    } else {
        for (int c = lane; c < D; c += 32) {
            A acc = A(0);
            for (int s = 0; s < n; ++s) {
                const long long k = idx[base + s];
                acc = fma(to_acc<A, T>(da[base + s]), to_acc<A, T>(w_a[k * D + c]), acc);
                if (GATED) acc = fma(to_acc<A, T>(db[base + s]), to_acc<A, T>(w_b[k * D + c]), acc);
            }
            dxr[c] = from_acc<T, A>(acc);
        }
    }
}

// twellpy_train_ell_y<T, GATED> / twellpy_train_ell_dx<T, GATED>: the second pass of the
// two-pass ELL forward / backward (cuda_train.TWO_PASS), one warp per row: y from the u
// values the forward's first pass (twellpy_train_fwd<T, GATED, 0>) wrote, dx from the du
// and dg of the backward's first pass (twellpy_train_bwd<T, GATED, 0>). Each pass gathers
// rows of fewer weight matrices (L2 holds about two of W1's), with the same bits as the
// one-pass kernels. Backup rows (nnz 0) get 0; ell_dx leaves rows r with skip[r] >= 0 (skip:
// the row map, or null) untouched, for the flow whose backup rows' dx is written first
// (cuda_train.DH_BY_NEURON).
template <typename T, int GATED>
__global__ void __launch_bounds__(32 * TW_WARPS)
twellpy_train_ell_y(const T* __restrict__ w_downT, const int* __restrict__ idx, const int* __restrict__ nnz,
                    const T* __restrict__ gval, const T* __restrict__ uval, T* __restrict__ y, long long M, int W,
                    int D, int vec) {
    typedef typename accum<T>::type A;
    const long long r = (long long)blockIdx.x * TW_WARPS + (threadIdx.x >> 5);
    if (r >= M) return;
    ell_y_row<T, A, GATED>(min(nnz[r], W), r * (long long)W, idx, gval, uval, w_downT, y + r * (long long)D, D, vec,
                           threadIdx.x & 31);
}

template <typename T, int GATED>
__global__ void __launch_bounds__(32 * TW_WARPS)
twellpy_train_ell_dx(const T* __restrict__ w_a, const T* __restrict__ w_b, const int* __restrict__ idx,
                     const int* __restrict__ nnz, const T* __restrict__ da, const T* __restrict__ db,
                     T* __restrict__ dx, long long M, int W, int D, int vec, const int* __restrict__ skip) {
    typedef typename accum<T>::type A;
    const long long r = (long long)blockIdx.x * TW_WARPS + (threadIdx.x >> 5);
    if (r >= M || (skip != nullptr && skip[r] >= 0)) return;
    ell_dx_row<T, A, GATED>(min(nnz[r], W), r * (long long)W, idx, da, db, w_a, w_b, dx + r * (long long)D, D, vec,
                            threadIdx.x & 31);
}

// ---------------------------------------------------------------------------
// twellpy_train_fwd<T, GATED>: ELL part of the FFN forward, one warp per row.
//   x       (M, D) T     input rows
//   w_up    (H, D) T     up projection (GATED only)
//   w_downT (H, D) T     w_down transposed
//   idx     (M, W) int   pattern (active neurons), -1 padding
//   nnz     (M,)   int   stored slots (0 for backup rows)
//   gval    (M, W) T     g = relu(x w_gate^T) on the pattern (ReLU FFN: h)
//   uval    (M, W) T     out (GATED): u = x w_up^T on the pattern, padding 0
//   y       (M, D) T     out: (g*u) @ w_down^T for the ELL rows, 0 for backup rows (not written
//                        with Y = 0: the split forward computes y with twellpy_spmm_resident)
//   habs    (M,)   A     out: sum of |h| over the row's slots (the L1 statistic without
//                        another pass over the values; 0 for backup rows), A = accum<T>
//   vec     0: scalar loops; 1: 16-byte vectors (rows 16-byte aligned, D * sizeof(T) % 16 == 0);
//           2: as 1, with the x row in registers (D <= 32 * TW_XREG * 16 / sizeof(T)) and the
//           slot metadata of the y product broadcast by shuffles. 1 and 2 give the same bits.
template <typename T, int GATED, int Y = 1>
__global__ void __launch_bounds__(32 * TW_WARPS, TW_ROW_MIN_BLOCKS)
twellpy_train_fwd(const T* __restrict__ x, const T* __restrict__ w_up, const T* __restrict__ w_downT,
                  const int* __restrict__ idx, const int* __restrict__ nnz, const T* __restrict__ gval,
                  T* __restrict__ uval, T* __restrict__ y, typename accum<T>::type* __restrict__ habs,
                  long long M, int W, int D, int vec) {
    typedef typename accum<T>::type A;
    const int lane = threadIdx.x & 31;
    const long long r = (long long)blockIdx.x * TW_WARPS + (threadIdx.x >> 5);
    if (r >= M) return;
    const int n = min(nnz[r], W);
    const long long base = r * (long long)W;
    A hs = A(0);  // sum of |h| in slot order (every lane holds the same value)
    if (GATED) {
        const T* xr = x + r * (long long)D;
        if (TW_ROW_LOOPS && vec == 2) {
            row_slot_dots<T, A>(xr, w_up, idx + base, n, D, lane,
                                [&](int s, A u) { hs += fwd_slot_u<T, A>(uval, gval, base + s, u, lane); });
        } else {
            for (int s = 0; s < n; ++s)
                hs += fwd_slot_u<T, A>(uval, gval, base + s,
                                       warp_dot<T, A>(xr, w_up + (long long)idx[base + s] * D, D, vec, lane), lane);
        }
        for (int s = n + lane; s < W; s += 32) uval[base + s] = zero_value<T>();
        __syncwarp();
    } else {
        for (int s = 0; s < n; ++s) hs += abs_acc(to_acc<A, T>(gval[base + s]));
    }
    if (lane == 0) habs[r] = hs;
    if (!Y) return;  // uniform over the warp
    ell_y_row<T, A, GATED>(n, base, idx, gval, uval, w_downT, y + r * (long long)D, D, vec, lane);
}

// twellpy_train_bwd<T, GATED>: ELL part of the FFN backward, one warp per row.
// dh = (dy @ w_down) on the pattern + l1s * sign(h)  (fused L1 injection);
// GATED: du = dh * g, dg = dh * u, dx = du @ w_up + dg @ w_gate;
// ReLU : da = dh, dx = dh @ w_up.
//   dy      (M, D) T;  w_downT (H, D) T;  w_a (H, D) T = w_up;  w_b (H, D) T = w_gate (GATED)
//   idx, nnz, gval, uval as in twellpy_train_fwd (uval GATED only)
//   da      (M, W) T   out: du (GATED) or dh (ReLU), padding 0
//   db      (M, W) T   out: dg (GATED), padding 0
//   dx      (M, D) T   out: ELL rows; 0 for backup rows (not written with DX = 0: the split
//                      backward computes dx with twellpy_spmm_resident, DUAL, from da and db)
//   vec     as in twellpy_train_fwd (2: the dy row in registers); 1 and 2 give the same bits
template <typename T, int GATED, int DX = 1>
__global__ void __launch_bounds__(32 * TW_WARPS, TW_ROW_MIN_BLOCKS)
twellpy_train_bwd(const T* __restrict__ dy, const T* __restrict__ w_downT, const T* __restrict__ w_a,
                  const T* __restrict__ w_b, const int* __restrict__ idx, const int* __restrict__ nnz,
                  const T* __restrict__ gval, const T* __restrict__ uval, T* __restrict__ da,
                  T* __restrict__ db, T* __restrict__ dx, long long M, int W, int D, double l1s, int vec) {
    typedef typename accum<T>::type A;
    const int lane = threadIdx.x & 31;
    const long long r = (long long)blockIdx.x * TW_WARPS + (threadIdx.x >> 5);
    if (r >= M) return;
    const int n = min(nnz[r], W);
    const long long base = r * (long long)W;
    const T* dyr = dy + r * (long long)D;
    if (TW_ROW_LOOPS && vec == 2) {
        row_slot_dots<T, A>(dyr, w_downT, idx + base, n, D, lane, [&](int s, A dh) {
            bwd_slot_d<T, A, GATED>(gval, uval, da, db, base + s, dh, l1s, lane);
        });
    } else {
        for (int s = 0; s < n; ++s)
            bwd_slot_d<T, A, GATED>(gval, uval, da, db, base + s,
                                    warp_dot<T, A>(dyr, w_downT + (long long)idx[base + s] * D, D, vec, lane), l1s,
                                    lane);
    }
    for (int s = n + lane; s < W; s += 32) {
        da[base + s] = zero_value<T>();
        if (GATED) db[base + s] = zero_value<T>();
    }
    if (!DX) return;  // uniform over the warp
    __syncwarp();
    ell_dx_row<T, A, GATED>(n, base, idx, da, db, w_a, w_b, dx + r * (long long)D, D, vec, lane);
}

// ---------------------------------------------------------------------------
// Deterministic transpose by counting sort. Rows are cut into nb blocks of
// rpb consecutive rows; one warp owns one block and walks its rows in order.
// Pass 1 counts entries per (block, column); the host turns the counts into
// start offsets (column-major exclusive scan); pass 2 places every entry.
// Inside a column, entries end up sorted by row, so the transpose is the same
// bit pattern on every run (a row holds each column at most once, so each
// counter is bumped by at most one lane per row).
//   idx     (M, K) int   slot columns, -1 (or out of [0, N)) = skip
//   row_map (M,)   int   -1: the row lives in the slots; else its backup row
//   backup  (R, N) T     dense backup rows; their non-zeros are the entries
//   counts  (nb, N) int  out (zero-filled by the caller)
//   col_tot (N,)    int  out (zero-filled by the caller): entries per column, so the host
//                        needs no reduction pass over counts (nb x N, 23 MB at W1-16k)
template <typename T>
__global__ void __launch_bounds__(32 * TW_WARPS)
twellpy_train_tr_count(const int* __restrict__ idx, const int* __restrict__ row_map,
                       const T* __restrict__ backup, long long M, int K, int N, int rpb, int nb,
                       int* __restrict__ counts, int* __restrict__ col_tot) {
    const int lane = threadIdx.x & 31;
    const long long b = (long long)blockIdx.x * TW_WARPS + (threadIdx.x >> 5);
    if (b >= nb) return;
    int* cb = counts + b * (long long)N;
    const long long r_end = min((b + 1) * (long long)rpb, M);
    for (long long r = b * (long long)rpb; r < r_end; ++r) {
        const int rm = row_map[r];
        if (rm >= 0) {
            const T* br = backup + (long long)rm * N;
            for (int c = lane; c < N; c += 32)
                if (nonzero(br[c])) { atomicAdd(cb + c, 1); atomicAdd(col_tot + c, 1); }
        } else {
            const int* ir = idx + r * (long long)K;
            for (int s = lane; s < K; s += 32) {
                const int c = ir[s];
                if (c >= 0 && c < N) { atomicAdd(cb + c, 1); atomicAdd(col_tot + c, 1); }
            }
        }
    }
}

//   cursor  (nb, N) int  in: start offset of each (block, column); consumed
//   out_row (nnz,)  int  out: row of each entry of the transpose (sorted per column)
//   out_pos (nnz,)  int  out: position in the combined value buffer
//                          (r*K + s for slots, M*K + rm*N + c for backup)
template <typename T>
__global__ void __launch_bounds__(32 * TW_WARPS)
twellpy_train_tr_place(const int* __restrict__ idx, const int* __restrict__ row_map,
                       const T* __restrict__ backup, long long M, int K, int N, int rpb, int nb,
                       int* __restrict__ cursor, int* __restrict__ out_row, int* __restrict__ out_pos) {
    const int lane = threadIdx.x & 31;
    const long long b = (long long)blockIdx.x * TW_WARPS + (threadIdx.x >> 5);
    if (b >= nb) return;
    int* cb = cursor + b * (long long)N;
    const long long r_end = min((b + 1) * (long long)rpb, M);
    const long long backup_base = M * (long long)K;
    for (long long r = b * (long long)rpb; r < r_end; ++r) {
        const int rm = row_map[r];
        if (rm >= 0) {
            const T* br = backup + (long long)rm * N;
            for (int c = lane; c < N; c += 32) {
                if (nonzero(br[c])) {
                    const int p = atomicAdd(cb + c, 1);
                    out_row[p] = (int)r;
                    out_pos[p] = (int)(backup_base + (long long)rm * N + c);
                }
            }
        } else {
            const int* ir = idx + r * (long long)K;
            for (int s = lane; s < K; s += 32) {
                const int c = ir[s];
                if (c >= 0 && c < N) {
                    const int p = atomicAdd(cb + c, 1);
                    out_row[p] = (int)r;
                    out_pos[p] = (int)(r * K + s);
                }
            }
        }
        __syncwarp();  // the next row's bumps of a counter come after this row's
    }
}

// ---------------------------------------------------------------------------
// twellpy_train_wgrad<T, GATED>: weight gradients from the transposed pattern,
// one block per (neuron, column chunk); no atomics, fixed summation order.
//   indptr (H+1,) int; rows (nnz,) int; pos (nnz,) int   transposed pattern
//   x (M, D) T; dy (M, D) T
//   da, db, gval, uval: combined value buffers (ELL M*W then backup R*H)
//   dw_a     (H, D) T  out: dw_up   = da^T @ x
//   dw_b     (H, D) T  out: dw_gate = db^T @ x   (GATED)
//   dw_downT (H, D) T  out: (dy^T @ h)^T = h^T @ dy
//   base_a, base_b, base_h (H, D) A or null: sums the entries are added to
//            (the backup rows' GEMM products; rounded to T once, with the entries)
// grid = (H, ceil(D / (TW_GATHER_THREADS * VecN))), block = TW_GATHER_THREADS
template <typename T, int GATED>
__global__ void __launch_bounds__(TW_GATHER_THREADS)
twellpy_train_wgrad(const int* __restrict__ indptr, const int* __restrict__ rows, const int* __restrict__ pos,
                    const T* __restrict__ x, const T* __restrict__ dy, const T* __restrict__ da,
                    const T* __restrict__ db, const T* __restrict__ gval, const T* __restrict__ uval,
                    T* __restrict__ dw_a, T* __restrict__ dw_b, T* __restrict__ dw_downT, int H, int D,
                    int vec, const typename accum<T>::type* __restrict__ base_a,
                    const typename accum<T>::type* __restrict__ base_b,
                    const typename accum<T>::type* __restrict__ base_h) {
    typedef typename accum<T>::type A;
    constexpr int N = VecN<T>::N;
    const long long k = blockIdx.x;
    const int e0 = indptr[k], e1 = indptr[k + 1];
    A acc_a[N], acc_b[N], acc_h[N];
#pragma unroll
    for (int i = 0; i < N; ++i) acc_a[i] = acc_b[i] = acc_h[i] = A(0);
    if (vec) {
        const int c = (blockIdx.y * TW_GATHER_THREADS + threadIdx.x) * N;
        if (c >= D) return;
        if (base_a != nullptr) {
#pragma unroll
            for (int i = 0; i < N; ++i) {
                acc_a[i] = base_a[k * D + c + i];
                acc_h[i] = base_h[k * D + c + i];
                if (GATED) acc_b[i] = base_b[k * D + c + i];
            }
        }
        int e = e0;
        // Four entries per step: their loads are all issued before the FMAs, so
        // four gathers are in flight (the loop is latency-bound otherwise). The
        // summation order is unchanged (entry by entry).
        for (; e + 4 <= e1; e += 4) {
            long long m4[4];
            int p4[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                m4[j] = rows[e + j];
                p4[j] = pos[e + j];
            }
            A a4[4], h4[4], b4[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                a4[j] = to_acc<A, T>(da[p4[j]]);
                h4[j] = h_value<T, A, GATED>(gval[p4[j]], GATED ? uval[p4[j]] : gval[p4[j]]);
                b4[j] = GATED ? to_acc<A, T>(db[p4[j]]) : A(0);
            }
            uint4 xr[4], dr[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                xr[j] = __ldg(reinterpret_cast<const uint4*>(x + m4[j] * D + c));
                dr[j] = __ldg(reinterpret_cast<const uint4*>(dy + m4[j] * D + c));
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const T* xe = reinterpret_cast<const T*>(&xr[j]);
                const T* de = reinterpret_cast<const T*>(&dr[j]);
#pragma unroll
                for (int i = 0; i < N; ++i) {
                    const A xv = to_acc<A, T>(xe[i]);
                    acc_a[i] += a4[j] * xv;
                    acc_h[i] += h4[j] * to_acc<A, T>(de[i]);
                    if (GATED) acc_b[i] += b4[j] * xv;
                }
            }
        }
        for (; e < e1; ++e) {
            const long long m = rows[e];
            const int p = pos[e];
            const A a = to_acc<A, T>(da[p]);
            const A h = h_value<T, A, GATED>(gval[p], GATED ? uval[p] : gval[p]);
            A xv[N], dv[N];
            load_vec<T, A>(x + m * D + c, xv);
            load_vec<T, A>(dy + m * D + c, dv);
#pragma unroll
            for (int i = 0; i < N; ++i) {
                acc_a[i] += a * xv[i];
                acc_h[i] += h * dv[i];
            }
            if (GATED) {
                const A bb = to_acc<A, T>(db[p]);
#pragma unroll
                for (int i = 0; i < N; ++i) acc_b[i] += bb * xv[i];
            }
        }
        store_vec<T, A>(dw_a + k * D + c, acc_a);
        store_vec<T, A>(dw_downT + k * D + c, acc_h);
        if (GATED) store_vec<T, A>(dw_b + k * D + c, acc_b);
    } else {
        const int c0 = blockIdx.y * TW_GATHER_THREADS * N + threadIdx.x;
        if (base_a != nullptr) {
#pragma unroll
            for (int i = 0; i < N; ++i) {
                const int c = c0 + i * TW_GATHER_THREADS;
                if (c < D) {
                    acc_a[i] = base_a[k * D + c];
                    acc_h[i] = base_h[k * D + c];
                    if (GATED) acc_b[i] = base_b[k * D + c];
                }
            }
        }
        for (int e = e0; e < e1; ++e) {
            const long long m = rows[e];
            const int p = pos[e];
            const A a = to_acc<A, T>(da[p]);
            const A h = h_value<T, A, GATED>(gval[p], GATED ? uval[p] : gval[p]);
            const A bb = GATED ? to_acc<A, T>(db[p]) : A(0);
#pragma unroll
            for (int i = 0; i < N; ++i) {
                const int c = c0 + i * TW_GATHER_THREADS;
                if (c < D) {
                    const A xv = to_acc<A, T>(x[m * D + c]);
                    acc_a[i] += a * xv;
                    acc_h[i] += h * to_acc<A, T>(dy[m * D + c]);
                    if (GATED) acc_b[i] += bb * xv;
                }
            }
        }
#pragma unroll
        for (int i = 0; i < N; ++i) {
            const int c = c0 + i * TW_GATHER_THREADS;
            if (c < D) {
                dw_a[k * D + c] = from_acc<T, A>(acc_a[i]);
                dw_downT[k * D + c] = from_acc<T, A>(acc_h[i]);
                if (GATED) dw_b[k * D + c] = from_acc<T, A>(acc_b[i]);
            }
        }
    }
}

// twellpy_train_wgrad_dh<T, GATED, NV>: the backward's dh on the pattern and the three weight
// gradients in one pass over the transposed pattern (cuda_train.DH_BY_NEURON), one block per
// neuron k over the whole row (thread t owns the 16-byte vectors t, t + blockDim.x, ..., NV of
// them). Each entry (row m, combined position p) gathers dy[m] and x[m] once:
//   p < ell_size (an ELL entry): dh = dy[m] . w_downT[k] (+ l1s * sign(h)), a block-wide dot
//     product in a fixed order (per thread, per warp by xor shuffles, then warp by warp), then
//     du = dh * g, dg = dh * u (GATED; ReLU: dh) rounded to T into da[p], db[p] for
//     twellpy_train_ell_dx; the row-oriented backward's first pass instead gathers a w_downT
//     row per entry, while the dy row this one gathers is the one dw_downT needs anyway;
//   p >= ell_size (a backup entry): da[p], db[p] as the backup rows' backward wrote them.
// Then, entry by entry in the pattern's order (as twellpy_train_wgrad): dw_a[k] += da * x[m],
// dw_b[k] += db * x[m] (GATED), dw_downT[k] += h * dy[m]. Deterministic; dh's summation order
// differs from the row-oriented kernels', so da and db may differ from theirs in the last bit.
// Off by default: on an H100 (2026-12-07) it moved its bytes at about 40% of
// twellpy_train_wgrad's rate (the per-step reduction and barrier), so the backward was slower.
//   indptr (H+1,), rows, pos (nnz,) int       transposed pattern (twellpy_train_tr_place)
//   x, dy (M, D) T; w_downT (H, D) T; gval, uval, da, db: combined value buffers
//   dw_a, dw_b, dw_downT (H, D) T out; base_a, base_b, base_h (H, D) A or null, as in
//   twellpy_train_wgrad. Requires 16-byte aligned rows and D % VecN == 0.
//   grid = (H,), block = (ceil(D / VecN / NV) rounded up to 32,) <= TW_DH_THREADS
#ifndef TW_DH_THREADS
#define TW_DH_THREADS 512
#endif
#ifndef TW_DH_BATCH
#define TW_DH_BATCH 4  // entries whose dy and x gathers are in flight together (NV = 1)
#endif
#ifndef TW_DH_PREFETCH
#define TW_DH_PREFETCH 0  // 1: gather the next step's entries while this step reduces (2x registers)
#endif
// thread j writes entry j's du, dg: a step's entries must not outnumber a warp
static_assert(TW_DH_BATCH >= 1 && TW_DH_BATCH <= 32, "TW_DH_BATCH must be in [1, 32]");
static_assert(TW_DH_THREADS % 32 == 0 && TW_DH_THREADS <= 1024, "TW_DH_THREADS must be a multiple of 32, <= 1024");
template <typename T, int GATED, int NV>
__global__ void __launch_bounds__(TW_DH_THREADS)
twellpy_train_wgrad_dh(const int* __restrict__ indptr, const int* __restrict__ rows, const int* __restrict__ pos,
                       long long ell_size, const T* __restrict__ x, const T* __restrict__ dy,
                       const T* __restrict__ w_downT, T* __restrict__ da, T* __restrict__ db,
                       const T* __restrict__ gval, const T* __restrict__ uval, T* __restrict__ dw_a,
                       T* __restrict__ dw_b, T* __restrict__ dw_downT, int D, double l1s,
                       const typename accum<T>::type* __restrict__ base_a,
                       const typename accum<T>::type* __restrict__ base_b,
                       const typename accum<T>::type* __restrict__ base_h) {
    typedef typename accum<T>::type A;
    constexpr int N = VecN<T>::N;
    constexpr int E = (TW_DH_BATCH / NV) > 0 ? TW_DH_BATCH / NV : 1;
    __shared__ A s_part[2][E][TW_DH_THREADS / 32];  // per-warp partial dots, two steps' buffers
    int parity = 0;
    const long long k = blockIdx.x;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
    const int DV = D / N;
    const int e0 = indptr[k], e1 = indptr[k + 1];
    A acc_a[NV][N], acc_b[NV][N], acc_h[NV][N];
    uint4 wd[NV];
#pragma unroll
    for (int q = 0; q < NV; ++q) {
        const int v = q * blockDim.x + tid;
        const bool in = v < DV;
        wd[q] = in ? __ldg(reinterpret_cast<const uint4*>(w_downT + k * D) + v) : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int i = 0; i < N; ++i) {
            const long long at = k * D + (long long)v * N + i;
            acc_a[q][i] = (in && base_a != nullptr) ? base_a[at] : A(0);
            acc_h[q][i] = (in && base_h != nullptr) ? base_h[at] : A(0);
            acc_b[q][i] = (in && GATED && base_b != nullptr) ? base_b[at] : A(0);
        }
    }
    // one step's entries: rows, positions (-1 past the end) and their dy and x vectors, every
    // gather issued before the first use (the loop is latency-bound)
    auto load_step = [&](int eb, long long (&m)[E], int (&p)[E], T (&gv)[E], T (&uv)[E], uint4 (&dr)[E][NV],
                         uint4 (&xr)[E][NV]) {
#pragma unroll
        for (int j = 0; j < E; ++j) {
            const bool live = eb + j < e1;
            m[j] = live ? rows[eb + j] : 0;
            p[j] = live ? pos[eb + j] : -1;
        }
#pragma unroll
        for (int j = 0; j < E; ++j) {  // the entry's g and u (the same address in every thread)
            gv[j] = p[j] >= 0 ? gval[p[j]] : zero_value<T>();
            uv[j] = (GATED && p[j] >= 0) ? uval[p[j]] : gv[j];
        }
#pragma unroll
        for (int j = 0; j < E; ++j)
#pragma unroll
            for (int q = 0; q < NV; ++q) {
                const int v = q * blockDim.x + tid;
                const bool in = p[j] >= 0 && v < DV;
                dr[j][q] = in ? __ldg(reinterpret_cast<const uint4*>(dy + m[j] * D) + v) : make_uint4(0u, 0u, 0u, 0u);
                xr[j][q] = in ? __ldg(reinterpret_cast<const uint4*>(x + m[j] * D) + v) : make_uint4(0u, 0u, 0u, 0u);
            }
    };
    long long m[E];
    int p[E];
    T gv[E], uv[E];
    uint4 dr[E][NV], xr[E][NV];
#if TW_DH_PREFETCH
    // the next step's gathers fly while this step reduces, syncs and accumulates
    long long m_next[E];
    int p_next[E];
    T gv_next[E], uv_next[E];
    uint4 dr_next[E][NV], xr_next[E][NV];
    load_step(e0, m_next, p_next, gv_next, uv_next, dr_next, xr_next);
#endif
    for (int e = e0; e < e1; e += E) {
#if TW_DH_PREFETCH
#pragma unroll
        for (int j = 0; j < E; ++j) {
            m[j] = m_next[j];
            p[j] = p_next[j];
            gv[j] = gv_next[j];
            uv[j] = uv_next[j];
#pragma unroll
            for (int q = 0; q < NV; ++q) {
                dr[j][q] = dr_next[j][q];
                xr[j][q] = xr_next[j][q];
            }
        }
        if (e + E < e1) load_step(e + E, m_next, p_next, gv_next, uv_next, dr_next, xr_next);
#else
        load_step(e, m, p, gv, uv, dr, xr);
#endif
#pragma unroll
        for (int j = 0; j < E; ++j) {
            A s = A(0);
#pragma unroll
            for (int q = 0; q < NV; ++q) {
                const T* de = reinterpret_cast<const T*>(&dr[j][q]);
                const T* we = reinterpret_cast<const T*>(&wd[q]);
#pragma unroll
                for (int i = 0; i < N; ++i) s = fma(to_acc<A, T>(de[i]), to_acc<A, T>(we[i]), s);
            }
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
            if (lane == 0) s_part[parity][j][warp] = s;
        }
        __syncthreads();
        // every thread finishes every entry itself (the same operations on the same values, so
        // the same bits): one barrier a step; the partials alternate between two buffers, so
        // the next step's writes never meet this step's reads
#pragma unroll
        for (int j = 0; j < E; ++j) {
            if (p[j] < 0) continue;  // the same in every thread
            const long long at = p[j];
            const A h = h_value<T, A, GATED>(gv[j], uv[j]);
            A a, b = A(0);
            if (at < ell_size) {
                A dh = A(0);
                for (int w = 0; w < nwarps; ++w) dh += s_part[parity][j][w];
                // as bwd_slot_d: no L1 term (not 0 * sign, NaN for a NaN h) when l1 = 0
                if (l1s != 0.0) dh += A(l1s) * sign_of<A>(h);
                const T ta = from_acc<T, A>(GATED ? dh * to_acc<A, T>(gv[j]) : dh);
                a = to_acc<A, T>(ta);
                if (tid == j) da[at] = ta;
                if (GATED) {
                    const T tb = from_acc<T, A>(dh * to_acc<A, T>(uv[j]));
                    b = to_acc<A, T>(tb);
                    if (tid == j) db[at] = tb;
                }
            } else {  // written by the backup rows' backward before this kernel
                a = to_acc<A, T>(da[at]);
                if (GATED) b = to_acc<A, T>(db[at]);
            }
#pragma unroll
            for (int q = 0; q < NV; ++q) {
                const T* xe = reinterpret_cast<const T*>(&xr[j][q]);
                const T* de = reinterpret_cast<const T*>(&dr[j][q]);
#pragma unroll
                for (int i = 0; i < N; ++i) {
                    const A xv = to_acc<A, T>(xe[i]);
                    acc_a[q][i] += a * xv;
                    acc_h[q][i] += h * to_acc<A, T>(de[i]);
                    if (GATED) acc_b[q][i] += b * xv;
                }
            }
        }
        parity ^= 1;
    }
#pragma unroll
    for (int q = 0; q < NV; ++q) {
        const int v = q * blockDim.x + tid;
        if (v >= DV) continue;
        store_vec<T, A>(dw_a + k * D + (long long)v * N, acc_a[q]);
        store_vec<T, A>(dw_downT + k * D + (long long)v * N, acc_h[q]);
        if (GATED) store_vec<T, A>(dw_b + k * D + (long long)v * N, acc_b[q]);
    }
}

// twellpy_train_gather_t<T>: out = A^T @ B from the transposed pattern of A.
//   indptr (N+1,) int; rows (nnz,) int; pos (nnz,) int;  vals: combined values of A
//   B   (M, Kc) T;   out (N, Kc) T
// grid = (N, ceil(Kc / (TW_GATHER_THREADS * VecN))), block = TW_GATHER_THREADS
template <typename T>
__global__ void __launch_bounds__(TW_GATHER_THREADS)
twellpy_train_gather_t(const int* __restrict__ indptr, const int* __restrict__ rows, const int* __restrict__ pos,
                       const T* __restrict__ vals, const T* __restrict__ B, T* __restrict__ out, int Kc,
                       int vec) {
    typedef typename accum<T>::type A;
    constexpr int N = VecN<T>::N;
    const long long k = blockIdx.x;
    const int e0 = indptr[k], e1 = indptr[k + 1];
    A acc[N];
#pragma unroll
    for (int i = 0; i < N; ++i) acc[i] = A(0);
    if (vec) {
        const int c = (blockIdx.y * TW_GATHER_THREADS + threadIdx.x) * N;
        if (c >= Kc) return;
#pragma unroll 4
        for (int e = e0; e < e1; ++e) {
            const A a = to_acc<A, T>(vals[pos[e]]);
            A bv[N];
            load_vec<T, A>(B + (long long)rows[e] * Kc + c, bv);
#pragma unroll
            for (int i = 0; i < N; ++i) acc[i] += a * bv[i];
        }
        store_vec<T, A>(out + k * Kc + c, acc);
    } else {
        const int c0 = blockIdx.y * TW_GATHER_THREADS * N + threadIdx.x;
        for (int e = e0; e < e1; ++e) {
            const A a = to_acc<A, T>(vals[pos[e]]);
            const long long m = rows[e];
#pragma unroll
            for (int i = 0; i < N; ++i) {
                const int c = c0 + i * TW_GATHER_THREADS;
                if (c < Kc) acc[i] += a * to_acc<A, T>(B[m * Kc + c]);
            }
        }
#pragma unroll
        for (int i = 0; i < N; ++i) {
            const int c = c0 + i * TW_GATHER_THREADS;
            if (c < Kc) out[k * Kc + c] = from_acc<T, A>(acc[i]);
        }
    }
}

// ---------------------------------------------------------------------------
// twellpy_train_slots_spmm<T>: out = A @ B for the slot part of A, one warp per row.
//   vals (M, K) T; idx (M, K) int (-1 or out of [0, N) = skip); B (N, Kc) T; out (M, Kc) T
template <typename T>
__global__ void __launch_bounds__(32 * TW_WARPS)
twellpy_train_slots_spmm(const T* __restrict__ vals, const int* __restrict__ idx, const T* __restrict__ B,
                         T* __restrict__ out, long long M, int K, int N, int Kc, int vec) {
    typedef typename accum<T>::type A;
    const int lane = threadIdx.x & 31;
    const long long r = (long long)blockIdx.x * TW_WARPS + (threadIdx.x >> 5);
    if (r >= M) return;
    const long long base = r * (long long)K;
    T* outr = out + r * (long long)Kc;
    if (vec) {
        constexpr int NV = VecN<T>::N;
        for (int c = lane * NV; c < Kc; c += 32 * NV) {
            A acc[NV];
#pragma unroll
            for (int i = 0; i < NV; ++i) acc[i] = A(0);
            for (int s = 0; s < K; ++s) {
                const int k = idx[base + s];
                if (k < 0 || k >= N) continue;
                const A a = to_acc<A, T>(vals[base + s]);
                A bv[NV];
                load_vec<T, A>(B + (long long)k * Kc + c, bv);
#pragma unroll
                for (int i = 0; i < NV; ++i) acc[i] += a * bv[i];
            }
            store_vec<T, A>(outr + c, acc);
        }
    } else {
        for (int c = lane; c < Kc; c += 32) {
            A acc = A(0);
            for (int s = 0; s < K; ++s) {
                const int k = idx[base + s];
                if (k < 0 || k >= N) continue;
                acc += to_acc<A, T>(vals[base + s]) * to_acc<A, T>(B[(long long)k * Kc + c]);
            }
            outr[c] = from_acc<T, A>(acc);
        }
    }
}

// twellpy_train_slots_sddmm<T>: out[r, s] = X[r] . Y[idx[r, s]] (0 in padding).
//   X (M, D) T; Y (N, D) T; idx (M, K) int; out (M, K) T
template <typename T>
__global__ void __launch_bounds__(32 * TW_WARPS)
twellpy_train_slots_sddmm(const T* __restrict__ X, const T* __restrict__ Y, const int* __restrict__ idx,
                          T* __restrict__ out, long long M, int K, int N, int D, int vec) {
    typedef typename accum<T>::type A;
    const int lane = threadIdx.x & 31;
    const long long r = (long long)blockIdx.x * TW_WARPS + (threadIdx.x >> 5);
    if (r >= M) return;
    const long long base = r * (long long)K;
    const T* xr = X + r * (long long)D;
    for (int s = 0; s < K; ++s) {
        const int k = idx[base + s];
        if (k < 0 || k >= N) {
            if (lane == 0) out[base + s] = zero_value<T>();
            continue;
        }
        const A v = warp_dot<T, A>(xr, Y + (long long)k * D, D, vec, lane);
        if (lane == 0) out[base + s] = from_acc<T, A>(v);
    }
}

// ---------------------------------------------------------------------------
// twellpy_train_cast<TI, TO>: element-wise dtype conversion with one rounding
// step from the fp32 (fp64 for double) value; used instead of CuPy's astype
// so that bfloat16 works whatever CuPy's own bfloat16 support is.
//   in (n,) TI;  out (n,) TO
template <typename TI, typename TO>
__global__ void __launch_bounds__(256)
twellpy_train_cast(const TI* __restrict__ in, TO* __restrict__ out, long long n) {
    typedef typename accum<TI>::type A;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        out[i] = from_acc<TO, A>(to_acc<A, TI>(in[i]));
}

// ---------------------------------------------------------------------------
// Dense backup rows: the few rows wider than the ELL width. Their products with
// the weights are cuBLAS GEMMs over the R rows; the kernels below do the
// element-wise work around those GEMMs in one pass each (it used to be about a
// dozen CuPy calls per direction, whose launch cost outweighed the work).

namespace twellpy_train {
// Sum of v over the block, the same bits on every run: each thread's strided
// partial sum, a fixed shuffle tree per warp, then warp 0 adds the warp sums
// in order. Every thread of the block must call it; thread 0 gets the sum.
template <typename A>
__device__ __forceinline__ A block_sum_fixed(A v, A* scratch /* [32] */) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    A s = A(0);
    if (threadIdx.x == 0)
        for (int w = 0; w < (int)(blockDim.x >> 5); ++w) s += scratch[w];
    __syncthreads();  // scratch may be reused by the caller's next row
    return s;
}
}  // namespace twellpy_train

// twellpy_train_backup_fwd<T, GATED>: u and h of the backup rows, and |h| sums.
//   g      (R, H) T    ReLU values of the backup rows (non-zero bits = entry)
//   u_acc  (R, H) A    x[rows] @ w_up^T in the accumulator type (gated only)
//   u      (R, H) T    out (gated): u on the pattern, 0 elsewhere
//   h      (R, H) T    out (gated): h = g * u rounded to T (the down GEMM's input)
//   rows   (R,)   int  row number of each backup row
//   habs   (M,)   A    out: habs[rows[r]] = sum over the row of |h|
// One block per backup row (grid-stride over rows); for the non-gated FFN
// h is g itself and only habs is written (u_acc, u and h are not read).
template <typename T, int GATED>
__global__ void __launch_bounds__(256)
twellpy_train_backup_fwd(const T* __restrict__ g, const typename accum<T>::type* __restrict__ u_acc,
                         T* __restrict__ u, T* __restrict__ h, const int* __restrict__ rows, int R, int H,
                         typename accum<T>::type* __restrict__ habs) {
    typedef typename accum<T>::type A;
    __shared__ A scratch[32];
    for (int r = blockIdx.x; r < R; r += gridDim.x) {
        const long long base = (long long)r * H;
        A part = A(0);
        for (int c = threadIdx.x; c < H; c += blockDim.x) {
            const T gv = g[base + c];
            const bool on = nonzero(gv);
            if (GATED) {
                const T uv = on ? from_acc<T, A>(u_acc[base + c]) : zero_value<T>();
                const A hv = h_value<T, A, 1>(gv, uv);
                u[base + c] = uv;
                h[base + c] = on ? from_acc<T, A>(hv) : zero_value<T>();
                if (on) part += abs_acc(hv);
            } else if (on) {
                part += abs_acc(to_acc<A, T>(gv));
            }
        }
        const A total = block_sum_fixed<A>(part, scratch);
        if (threadIdx.x == 0) habs[rows[r]] = total;
    }
}

// twellpy_train_backup_bwd<T, GATED>: dh on the backup rows' pattern, then
// du and dg (gated) or dh itself (non-gated), each rounded once to T.
//   dh_acc (R, H) A    dy[rows] @ w_down in the accumulator type
//   g, u   (R, H) T    forward values (u gated only; 0 off the pattern)
//   l1s    double      l1 / M, added as l1s * sign(h) on the pattern when non-zero
//   da     (R, H) T    out: du (gated) or dh (non-gated); 0 off the pattern
//   db     (R, H) T    out (gated): dg; 0 off the pattern
//   h      (R, H) T    out (gated) or null: h = g * u rounded to T, 0 off the pattern
//                      (the backup rows' operand of the dw_down GEMM; the forward's h bits)
template <typename T, int GATED>
__global__ void __launch_bounds__(256)
twellpy_train_backup_bwd(const typename accum<T>::type* __restrict__ dh_acc, const T* __restrict__ g,
                         const T* __restrict__ u, double l1s, T* __restrict__ da, T* __restrict__ db,
                         long long n, T* __restrict__ h) {
    typedef typename accum<T>::type A;
    const A l1 = (A)l1s;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const T gv = g[i];
        if (!nonzero(gv)) {
            da[i] = zero_value<T>();
            if (GATED) db[i] = zero_value<T>();
            if (GATED && h != nullptr) h[i] = zero_value<T>();
            continue;
        }
        A d = dh_acc[i];
        const T uv = GATED ? u[i] : gv;
        if (GATED && h != nullptr) h[i] = from_acc<T, A>(h_value<T, A, GATED>(gv, uv));
        if (l1s != 0.0) d += l1 * sign_of<A>(h_value<T, A, GATED>(gv, uv));
        if (GATED) {
            da[i] = from_acc<T, A>(d * to_acc<A, T>(gv));
            db[i] = from_acc<T, A>(d * to_acc<A, T>(uv));
        } else {
            da[i] = from_acc<T, A>(d);
        }
    }
}

// twellpy_train_backup_exact<T, DUAL>: the backup rows' dense product summed
// again over each row's active neurons only, for the rows the GEMM left
// non-finite.
//   out    (R, D) A    in: a @ b (+ a2 @ b2) from the GEMM; out: those rows redone
//   g      (R, H) T    the backup rows' pattern (non-zero bits = active neuron)
//   a, a2  (R, H) T    left factors, 0 off the pattern (a2 read only when DUAL)
//   b, b2  (H, D) T    weights, row j = neuron j (b2 read only when DUAL)
// The GEMM also multiplies the zeros of inactive neurons, and 0 * NaN/Inf is
// NaN: a non-finite weight of a neuron that a row does not use would poison
// that row. Such a product always leaves a NaN in the row, so a row whose
// values are all finite is already exact and costs one read (the common
// case); any other row is recomputed here, neurons in ascending order, so an
// inactive neuron contributes exactly nothing (as in the ELL rows).
// One block per backup row (grid-stride over rows).
template <typename T, int DUAL>
__global__ void __launch_bounds__(256)
twellpy_train_backup_exact(typename accum<T>::type* __restrict__ out, const T* __restrict__ g,
                           const T* __restrict__ a, const T* __restrict__ a2, const T* __restrict__ b,
                           const T* __restrict__ b2, int R, int H, int D) {
    typedef typename accum<T>::type A;
    __shared__ int redo;
    for (int r = blockIdx.x; r < R; r += gridDim.x) {
        A* o = out + (long long)r * D;
        if (threadIdx.x == 0) redo = 0;
        __syncthreads();
        int mine = 0;
        for (int c = threadIdx.x; c < D; c += blockDim.x) mine |= !finite_acc(o[c]);
        if (mine) atomicOr(&redo, 1);
        __syncthreads();
        const int again = redo;
        __syncthreads();  // redo is reset for the next row only after every thread read it
        if (!again) continue;
        const long long base = (long long)r * H;
        for (int c = threadIdx.x; c < D; c += blockDim.x) {
            A s = A(0);
            for (int j = 0; j < H; ++j) {
                if (!nonzero(g[base + j])) continue;
                s = fma(to_acc<A, T>(a[base + j]), to_acc<A, T>(b[(long long)j * D + c]), s);
                if (DUAL) s = fma(to_acc<A, T>(a2[base + j]), to_acc<A, T>(b2[(long long)j * D + c]), s);
            }
            o[c] = s;
        }
    }
}

// twellpy_train_backup_wgrad_exact<T, GATED>: the backup rows' weight-gradient
// GEMM sums, redone over the active entries only where the GEMM left them
// non-finite (the twin of backup_exact for dw = a^T @ x).
//   base_a, base_b, base_h (H, D) A   in: da^T @ x[rows], db^T @ x[rows] (GATED),
//                                     h^T @ dy[rows]; out: non-finite elements redone
//   g, u   (R, H) T    the backup rows' g and u (u GATED only; non-zero g = entry)
//   da, db (R, H) T    du (or dh) and dg (GATED), 0 off the pattern
//   x, dy  (M, D) T;   rows (R,) int   row number of each backup row
// With unchecked inputs a NaN/Inf in x or dy of a backup row meets the zeros of
// that row's inactive neurons in the GEMM, and 0 * NaN/Inf is NaN: it would
// reach every neuron's gradient in that column. A finite element had no such
// product and is already exact (one read); a non-finite one is summed again
// over the rows where the neuron is active, rows in order.
// grid = (H, ceil(D / 256)), block = 256: one thread per (neuron, column).
template <typename T, int GATED>
__global__ void __launch_bounds__(256)
twellpy_train_backup_wgrad_exact(typename accum<T>::type* __restrict__ base_a,
                                 typename accum<T>::type* __restrict__ base_b,
                                 typename accum<T>::type* __restrict__ base_h, const T* __restrict__ g,
                                 const T* __restrict__ u, const T* __restrict__ da, const T* __restrict__ db,
                                 const T* __restrict__ x, const T* __restrict__ dy, const int* __restrict__ rows,
                                 int R, int H, int D) {
    typedef typename accum<T>::type A;
    const long long k = blockIdx.x;
    const int c = blockIdx.y * blockDim.x + threadIdx.x;
    if (c >= D) return;
    const long long o = k * D + c;
    const bool redo_a = !finite_acc(base_a[o]);
    const bool redo_b = GATED && !finite_acc(base_b[o]);
    const bool redo_h = !finite_acc(base_h[o]);
    if (!(redo_a || redo_b || redo_h)) return;
    A sa = A(0), sb = A(0), sh = A(0);
    for (int r = 0; r < R; ++r) {
        const long long e = (long long)r * H + k;
        const T gv = g[e];
        if (!nonzero(gv)) continue;
        const long long m = (long long)rows[r] * D + c;
        const A xv = to_acc<A, T>(x[m]);
        sa = fma(to_acc<A, T>(da[e]), xv, sa);
        if (GATED) sb = fma(to_acc<A, T>(db[e]), xv, sb);
        sh = fma(h_value<T, A, GATED>(gv, GATED ? u[e] : gv), to_acc<A, T>(dy[m]), sh);
    }
    if (redo_a) base_a[o] = sa;
    if (redo_b) base_b[o] = sb;
    if (redo_h) base_h[o] = sh;
}

// twellpy_train_scatter_rows<T>: dst[rows[r], :] = src[r, :] rounded once to T.
//   src (R, D) A (accumulator type); rows (R,) int; dst (M, D) T
template <typename T>
__global__ void __launch_bounds__(256)
twellpy_train_scatter_rows(const typename accum<T>::type* __restrict__ src, const int* __restrict__ rows,
                           T* __restrict__ dst, int R, int D) {
    typedef typename accum<T>::type A;
    const long long n = (long long)R * D;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const long long r = i / D, c = i - r * D;
        dst[(long long)rows[r] * D + c] = from_acc<T, A>(src[i]);
    }
}

// twellpy_train_transpose_dense<U>: out (cols, rows) = in (rows, cols)^T on raw
// bits (U is an unsigned type of the element's width), through a 32 x 33
// shared tile so that both the loads and the stores are coalesced.
// Block (32, 8); the grid strides over the tiles in both directions.
template <typename U>
__global__ void __launch_bounds__(256)
twellpy_train_transpose_dense(const U* __restrict__ in, U* __restrict__ out, long long rows, long long cols) {
    __shared__ U tile[32][33];
    const long long tiles_r = (rows + 31) / 32, tiles_c = (cols + 31) / 32;
    for (long long tr = blockIdx.y; tr < tiles_r; tr += gridDim.y) {
        for (long long tc = blockIdx.x; tc < tiles_c; tc += gridDim.x) {
            const long long r0 = tr * 32, c0 = tc * 32;
            const long long c = c0 + threadIdx.x;
            for (int j = threadIdx.y; j < 32; j += 8) {
                const long long r = r0 + j;
                if (r < rows && c < cols) tile[j][threadIdx.x] = in[r * cols + c];
            }
            __syncthreads();
            const long long oc = r0 + threadIdx.x;  // column of out = row of in
            for (int j = threadIdx.y; j < 32; j += 8) {
                const long long orow = c0 + j;
                if (orow < cols && oc < rows) out[orow * rows + oc] = tile[threadIdx.x][j];
            }
            __syncthreads();
        }
    }
}

// twellpy_train_transpose_pairs: twellpy_train_transpose_dense<unsigned short> with
// every global access a 32-bit word (two 16-bit elements): the loads read two
// neighbours of a row, the stores write two neighbours of an output row (two rows
// of the input, one column). A warp then moves 128 bytes a request instead of 64,
// and a block a 64 x 64 tile. The 65-element tile rows keep both phases free of
// shared-memory bank conflicts (word of element (i, j) = (65 i + j) / 2).
//   in   (rows, cols) 16-bit elements as words, rows and cols even, 4-byte aligned
//   out  (cols, rows) likewise
// Block (32, 8); the grid strides over the tiles in both directions.
__global__ void __launch_bounds__(256)
twellpy_train_transpose_pairs(const unsigned int* __restrict__ in, unsigned int* __restrict__ out, long long rows,
                              long long cols) {
    __shared__ unsigned short tile[64][65];
    const long long tiles_r = (rows + 63) / 64, tiles_c = (cols + 63) / 64;
    const long long in_words = cols / 2, out_words = rows / 2;  // words a row
    const int tx = threadIdx.x;
    for (long long tr = blockIdx.y; tr < tiles_r; tr += gridDim.y) {
        for (long long tc = blockIdx.x; tc < tiles_c; tc += gridDim.x) {
            const long long r0 = tr * 64, c0 = tc * 64;
            const long long cw = c0 / 2 + tx;  // this lane's word of a tile row
            for (int j = threadIdx.y; j < 64; j += 8) {
                const long long r = r0 + j;
                if (r < rows && cw < in_words) {
                    const unsigned int v = in[r * in_words + cw];
                    tile[j][2 * tx] = (unsigned short)(v & 0xffffu);  // the lower address holds the low half
                    tile[j][2 * tx + 1] = (unsigned short)(v >> 16);
                }
            }
            __syncthreads();
            const long long ow = r0 / 2 + tx;  // output word: input rows r0 + 2 tx and r0 + 2 tx + 1
            for (int j = threadIdx.y; j < 64; j += 8) {
                const long long o = c0 + j;
                if (o < cols && ow < out_words)
                    out[o * out_words + ow] = (unsigned int)tile[2 * tx][j] | ((unsigned int)tile[2 * tx + 1][j] << 16);
            }
            __syncthreads();
        }
    }
}

// twellpy_train_row_maps: where each row of a Hybrid goes, from the rows'
// non-zero counts and the chosen ELL width W (replaces a host computation and
// an upload between the forward's one synchronisation and its next kernels).
//   counts (M,)      int32  in: non-zeros per row
//   maps   (M + R,)  int32  out: [row_map (M,) | backup_rows (R,)]
//                           row_map[r] = k when row r is the k-th row with
//                           counts[r] > W (rows in order) and k < R, -1
//                           otherwise; backup_rows[k] = that row, and -1 for
//                           k at or past the number of wide rows. R is the
//                           number of wide rows when the caller has read the
//                           counts, or a capacity chosen before (the
//                           speculative training forward): a wide row with
//                           k >= R is mapped to -1 (the caller sees that
//                           overflow in its copy of the counts), never
//                           written past the buffer.
// One block of TW_MAP_THREADS threads; each round covers TW_MAP_ROWS
// consecutive rows per thread: per-thread flags, a warp scan, a scan of the
// warp totals and a carry between rounds, so positions come from prefix
// counts (deterministic, rows ascending) and M = 16384 takes two rounds.
// Row chunks (a forward that packs the gate output a chunk at a time): a launch
// maps rows row0 to row0 + n only; running (a device int, or null for 0) holds the
// wide rows of the earlier rows and is advanced by this launch's, so launches over
// consecutive chunks, in order, give one launch's maps. fill_rest = 1 (the last
// chunk) marks the room no wide row took.
#ifndef TW_MAP_THREADS
#define TW_MAP_THREADS 1024
#endif
#ifndef TW_MAP_ROWS
#define TW_MAP_ROWS 8
#endif
static_assert(TW_MAP_THREADS % 32 == 0 && TW_MAP_THREADS >= 32 && TW_MAP_THREADS <= 1024,
              "TW_MAP_THREADS must be a multiple of 32 in [32, 1024]");
static_assert(TW_MAP_ROWS >= 1 && TW_MAP_ROWS <= 32, "TW_MAP_ROWS must be in [1, 32]");
__global__ void __launch_bounds__(TW_MAP_THREADS)
twellpy_train_row_maps(const int* __restrict__ counts, int* __restrict__ maps, long long M, int W,
                       long long R, long long row0, long long n, int* __restrict__ running, int fill_rest) {
    __shared__ int warp_below[32];  // backup rows of lower warps in this round
    __shared__ int round_total;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n_warps = blockDim.x >> 5;
    const long long end = row0 + n;
    // backup rows of earlier chunks and rounds (the same in every thread)
    long long carry = running != nullptr ? *running : 0;
    for (long long base = row0; base < end; base += (long long)blockDim.x * TW_MAP_ROWS) {
        const long long r0 = base + (long long)threadIdx.x * TW_MAP_ROWS;
        unsigned wide = 0u;  // bit q: row r0 + q has more than W non-zeros
#pragma unroll
        for (int q = 0; q < TW_MAP_ROWS; ++q) {
            const long long r = r0 + q;
            if (r < end && counts[r] > W) wide |= 1u << q;
        }
        const int mine = __popc(wide);
        const int incl = warp_inclusive_sum(mine, lane);
        if (lane == 31) warp_below[warp] = incl;
        __syncthreads();
        if (warp == 0) {
            const int v = lane < n_warps ? warp_below[lane] : 0;
            const int v_incl = warp_inclusive_sum(v, lane);
            __syncwarp();
            if (lane < n_warps) warp_below[lane] = v_incl - v;
            if (lane == 31) round_total = v_incl;
        }
        __syncthreads();
        long long k = carry + warp_below[warp] + (incl - mine);
#pragma unroll
        for (int q = 0; q < TW_MAP_ROWS; ++q) {
            const long long r = r0 + q;
            if (r < end) {
                if ((wide >> q) & 1u) {
                    maps[r] = k < R ? (int)k : -1;
                    if (k < R) maps[M + k] = (int)r;
                    ++k;
                } else {
                    maps[r] = -1;
                }
            }
        }
        carry += round_total;
        __syncthreads();  // warp_below and round_total are rewritten next round
    }
    // room no wide row took (a capacity larger than needed): -1, never left unset;
    // carry is now the number of wide rows in every thread
    if (fill_rest)
        for (long long k = carry + threadIdx.x; k < R; k += blockDim.x) maps[M + k] = -1;
    if (running != nullptr) {
        __syncthreads();  // every thread has read *running
        if (threadIdx.x == 0) *running = (int)carry;
    }
}
