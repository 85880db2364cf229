// ffn_pack.cu -- helpers of the fused FFN: TwELL packing of an activation and
// the element-wise steps of the dense path.
#include "common.cuh"

// twellpy_ffn_pack<T>: dense (M, N) -> TwELL slots, one warp per (row, tile).
//   src       (M, N)            row stride lds   activation (stored entries = non-zero bit patterns)
//   values    (M, n_tiles, S)   value dtype      written in full (padding value 0)
//   indices   (M, n_tiles, S)   int32            global column, -1 in padding
//   counts    (M, n_tiles)      int32            stored entries = min(true count, S)
//   row_max   (M,)              int32            largest true tile count of the row (zeroed by the caller)
// Entries are packed in column order: the slot of an entry is the number of
// non-zeros before it in the tile (warp ballot + popc, no atomics), so the
// output is deterministic. Grid: x = ceil(M * n_tiles / warps per block) blocks.
template <typename T>
__global__ void twellpy_ffn_pack(const T* __restrict__ src, long long lds, int M, int N,
                                 int tile, int slots, int n_tiles,
                                 T* __restrict__ values, int* __restrict__ indices,
                                 int* __restrict__ counts, int* __restrict__ row_max) {
    const int lane = threadIdx.x & 31;
    const long long wid = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (wid >= (long long)M * n_tiles) return;
    const long long row = wid / n_tiles;
    const int t = (int)(wid - row * n_tiles);
    const int c_begin = t * tile;
    const int c_end = min(N, c_begin + tile);
    const T* s = src + row * lds;
    T* vout = values + wid * slots;
    int* iout = indices + wid * slots;
    int found = 0;  // true count so far (identical in every lane)
    for (int c0 = c_begin; c0 < c_end; c0 += 32) {
        const int col = c0 + lane;
        T v = twellpy::zero_value<T>();
        bool nz = false;
        if (col < c_end) {
            v = s[col];
            nz = twellpy::nonzero(v);
        }
        const unsigned ball = __ballot_sync(0xffffffffu, nz);
        const int pos = found + __popc(ball & ((1u << lane) - 1u));
        if (nz && pos < slots) {
            vout[pos] = v;
            iout[pos] = col;
        }
        found += __popc(ball);
    }
    const int stored = min(found, slots);
    for (int p = stored + lane; p < slots; p += 32) {
        vout[p] = twellpy::zero_value<T>();
        iout[p] = -1;
    }
    if (lane == 0) {
        counts[wid] = stored;
        if (found > 0) atomicMax(&row_max[row], found);  // max is order independent
    }
}

// Grid-stride element-wise loop over n elements of T. When every pointer is 16-byte
// aligned (aligned), vec_step(i) handles 16-byte vector i and scalar_step the tail;
// otherwise scalar_step(i) handles every element. Vectors: the scalar loop reached about
// a third of HBM bandwidth (0.48 ms for W1-16k's 16384 x 5632 bf16 h on an H100,
// 2026-12-06). The two steps compute the same bits.
template <typename T, typename VecStep, typename ScalarStep>
__device__ __forceinline__ void elementwise16(long long n, bool aligned, VecStep vec_step, ScalarStep scalar_step) {
    constexpr int VEC = twellpy::vec_of<T>::n;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long stride = (long long)gridDim.x * blockDim.x;
    long long tail = 0;
    if (aligned) {
        const long long nv = n / VEC;
        for (long long i = first; i < nv; i += stride) vec_step(i);
        tail = nv * VEC;
    }
    for (long long i = tail + first; i < n; i += stride) scalar_step(i);
}

__device__ __forceinline__ bool aligned16(const void* a, const void* b, const void* c) {
    return ((reinterpret_cast<unsigned long long>(a) | reinterpret_cast<unsigned long long>(b) |
             reinterpret_cast<unsigned long long>(c)) & 15ull) == 0ull;
}

// twellpy_ffn_gate_mul<T>: h = relu(g) * u element-wise, fp32 math.
//   g, u, h   (n,) contiguous    relu(NaN) = NaN (relu_active), so NaN propagates;
//                                h may be u (each element is read before it is written)
template <typename T>
__global__ void twellpy_ffn_gate_mul(const T* g, const T* u, T* h, long long n) {
    typedef typename twellpy::accum<T>::type A;
    constexpr int VEC = twellpy::vec_of<T>::n;
    const uint4* gv = reinterpret_cast<const uint4*>(g);
    const uint4* uv = reinterpret_cast<const uint4*>(u);
    uint4* hv = reinterpret_cast<uint4*>(h);
    elementwise16<T>(
        n, aligned16(g, u, h),
        [&](long long i) {
            A ga[VEC], ua[VEC];
            twellpy::unpack16<T, A>(__ldcs(gv + i), ga);
            twellpy::unpack16<T, A>(__ldcs(uv + i), ua);
            uint4 out;
            T* e = reinterpret_cast<T*>(&out);
#pragma unroll
            for (int k = 0; k < VEC; ++k) e[k] = twellpy::from_acc<T, A>((ga[k] <= A(0)) ? A(0) : ga[k] * ua[k]);
            __stcs(hv + i, out);
        },
        [&](long long i) {
            const A gi = twellpy::to_acc<A, T>(g[i]);
            h[i] = twellpy::from_acc<T, A>((gi <= A(0)) ? A(0) : gi * twellpy::to_acc<A, T>(u[i]));
        });
}

// twellpy_ffn_relu<T>: h = relu(g) element-wise (NaN kept).
//   g, h      (n,) contiguous; h may be g
template <typename T>
__global__ void twellpy_ffn_relu(const T* g, T* h, long long n) {
    typedef typename twellpy::accum<T>::type A;
    constexpr int VEC = twellpy::vec_of<T>::n;
    const uint4* gv = reinterpret_cast<const uint4*>(g);
    uint4* hv = reinterpret_cast<uint4*>(h);
    elementwise16<T>(
        n, aligned16(g, h, h),
        [&](long long i) {
            uint4 out = __ldcs(gv + i);
            T* e = reinterpret_cast<T*>(&out);
#pragma unroll
            for (int k = 0; k < VEC; ++k)
                if (twellpy::to_acc<A, T>(e[k]) <= A(0)) e[k] = twellpy::zero_value<T>();
            __stcs(hv + i, out);
        },
        [&](long long i) {
            h[i] = (twellpy::to_acc<A, T>(g[i]) <= A(0)) ? twellpy::zero_value<T>() : g[i];
        });
}

#ifndef FFN_ROWPACK_UNROLL
#define FFN_ROWPACK_UNROLL 4
#endif
// 1: 16-bit values tested two at a time on 32-bit words (twellpy::relu_bits16) and the warp
// scan cut short where no lane, or no lane twice, is active; 0: value by value, the scan every
// step. Same lists either way (CPU emulation of every 16-bit pattern; a GPU test compares the
// two). On since an H100 run (2026-12-07): 0.086/0.082 -> 0.081/0.081 ms at W1-16k, every round.
#ifndef FFN_ROWPACK_WORDS
#define FFN_ROWPACK_WORDS 1
#endif

// relu_active of the values of a 16-byte vector, as bits (bit i: value i), with the answer of
// the value-by-value test as compiled (-ftz): that test converts to float exactly and compares
// with setp.gtu.ftz.f32, which flushes a float denormal to zero. A bfloat16 denormal stays a
// float denormal, so it is not active (LEAST = the smallest normal, 0x0080); a half denormal
// becomes a normal float, so it is (LEAST = 1). float and double keep the value test.
template <typename T> __device__ __forceinline__ unsigned relu_active_bits(const uint4& raw) {
    typedef typename twellpy::accum<T>::type A;
    const T* e = reinterpret_cast<const T*>(&raw);
    unsigned mask = 0u;
#pragma unroll
    for (int i = 0; i < 16 / (int)sizeof(T); ++i)
        if (!(twellpy::to_acc<A, T>(e[i]) <= A(0))) mask |= 1u << i;
    return mask;
}
#if FFN_ROWPACK_WORDS
template <> __device__ __forceinline__ unsigned relu_active_bits<__nv_bfloat16>(const uint4& raw) {
    return twellpy::relu_bits16<twellpy::BF16_INF, 0x0080u>(raw);
}
template <> __device__ __forceinline__ unsigned relu_active_bits<__half>(const uint4& raw) {
    return twellpy::relu_bits16<twellpy::HALF_INF, 1u>(raw);
}
#endif

// twellpy_ffn_rowpack<T>: per-row list of the ReLU-active entries of g
// (relu_active: > 0 or NaN), one warp per row, column order.
//   g          (M, H)     row stride ldg    gate pre-activation
//   list_idx   (M, capr)  int32             column of the k-th active entry, k < min(count, capr)
//   list_val   (M, capr)  accum type        its gate value (float; double for double data)
//   row_count  (M,)       int32             true number of active entries of the row
//   total      (1,)       uint64            optional (may be null): += active entries of all rows
// Only live entries are written (no padding: this is an internal work list).
// Each lane loads FFN_ROWPACK_UNROLL 16-byte vectors per step, so a warp has
// 4 * 512 bytes in flight; positions come from a warp prefix count, no atomics.
// Requires H % (16 / sizeof(T)) == 0 and 16-byte aligned rows.
// Grid: x = ceil(M / warps per block).
template <typename T>
__global__ void twellpy_ffn_rowpack(const T* __restrict__ g, long long ldg, int M, int H, int capr,
                                    int* __restrict__ list_idx,
                                    typename twellpy::accum<T>::type* __restrict__ list_val,
                                    int* __restrict__ row_count,
                                    unsigned long long* __restrict__ total) {
    typedef typename twellpy::accum<T>::type A;
    constexpr int VEC = 16 / (int)sizeof(T);
    const int lane = threadIdx.x & 31;
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= M) return;
    const T* grow = g + row * ldg;
    int* lidx = list_idx + row * capr;
    A* lval = list_val + row * capr;
    int found = 0;
    constexpr int U = FFN_ROWPACK_UNROLL;
    for (int base = 0; base < H; base += 32 * VEC * U) {
        uint4 raw[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int col = base + (u * 32 + lane) * VEC;
            raw[u] = (col < H) ? __ldcs(reinterpret_cast<const uint4*>(grow + col)) : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int col = base + (u * 32 + lane) * VEC;
            const T* e = reinterpret_cast<const T*>(&raw[u]);
            const unsigned mask = col < H ? relu_active_bits<T>(raw[u]) : 0u;
            int step;
            int pos = found + twellpy::warp_exclusive_count<(FFN_ROWPACK_WORDS != 0)>(__popc(mask), lane, step);
            if (mask != 0u) {
#pragma unroll
                for (int i = 0; i < VEC; ++i) {
                    if (mask & (1u << i)) {
                        if (pos < capr) {
                            lidx[pos] = col + i;
                            lval[pos] = twellpy::to_acc<A, T>(e[i]);
                        }
                        ++pos;
                    }
                }
            }
            found += step;
        }
    }
    if (lane == 0) {
        row_count[row] = found;
        // integer sums are order independent: deterministic
        if (total != nullptr) atomicAdd(total, (unsigned long long)found);
    }
}
