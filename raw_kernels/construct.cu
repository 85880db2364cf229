// construct.cu -- dense -> TwELL / ELL and CSR -> TwELL / ELL construction.
//
// Layouts (docs/internals.md): TwELL values/indices (M, n_tiles, S), counts
// (M, n_tiles); ELL values/indices (M, W). Padding slots hold value 0 and
// index -1 and are always written, so the output bits depend only on the input.
// Slot positions come from warp prefix counts (__ballot_sync/__popc,
// __match_any_sync), never from atomics: the result is deterministic and the
// entries of one (row, tile) / one row are sorted by column.
//
// Non-zero is decided on the bit pattern (twellpy::nonzero): -0.0 is zero,
// NaN and denormals are non-zero (CuPy compiles with -ftz=true).
//
// VEC is the number of consecutive elements one lane loads at once: 16 bytes
// (16 / sizeof(T)) when the launcher has checked alignment (N % VEC == 0,
// tile % VEC == 0, 16-byte aligned base pointer), 1 otherwise.
#include "common.cuh"

#ifndef CONSTRUCT_WARPS
#define CONSTRUCT_WARPS 8            // most warps per block (launch bound; launchers may use fewer)
#endif
#ifndef CONSTRUCT_UNROLL
#define CONSTRUCT_UNROLL 2           // 32*VEC-element chunks a warp loads before processing (H200 sweep:
                                     // 2 beat 4 and 8 at a whole W1 row per warp, 0.115 vs 0.139 ms)
#endif
#ifndef CONSTRUCT_MIN_BLOCKS
#define CONSTRUCT_MIN_BLOCKS 1       // resident blocks per SM of dense_to_twell's register budget (launch bound)
#endif
#ifndef CONSTRUCT_PREFETCH
#define CONSTRUCT_PREFETCH 0         // 1: a lane issues the loads of its next CONSTRUCT_UNROLL chunks before it
#endif                               // packs the current ones, so loads stay in flight while it packs
#ifndef CONSTRUCT_FAST_PREFIX
#define CONSTRUCT_FAST_PREFIX 1      // 1: slot positions from two ballots when no lane holds two non-zeros of a
#endif                               // chunk (the usual case at ~1% density), the warp scan otherwise
#ifndef CONSTRUCT_ASYNC_DEPTH
#define CONSTRUCT_ASYNC_DEPTH 4      // >= 2: 16-byte vector inputs are read through a per-warp ring of this many
#endif                               // chunks filled by cp.async (sm_80+), DEPTH - 1 chunks in flight per lane
                                     // without holding registers; 0: loads into registers (CONSTRUCT_UNROLL).
                                     // W1 sweep, 2026-12-05: depth 4 with the two-ballot prefix beat the
                                     // register loop by 9% on an H200 (62% of copy) and 6% on an H100 (77%)
#ifndef CONSTRUCT_STREAM_LOADS
#define CONSTRUCT_STREAM_LOADS 1     // 1: read x with evict-first (ld.global.cs) loads: it is read once,
#endif                               // and the slots it produces are what should stay in L2

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
// cp.async and L2 cache policies are sm_80+: older GPUs run the register path whatever the variant asks
#undef CONSTRUCT_ASYNC_DEPTH
#define CONSTRUCT_ASYNC_DEPTH 0
#endif

static_assert(CONSTRUCT_WARPS >= 1 && CONSTRUCT_WARPS <= 32, "CONSTRUCT_WARPS out of range");
static_assert(CONSTRUCT_UNROLL >= 1 && CONSTRUCT_UNROLL <= 16, "CONSTRUCT_UNROLL out of range");
static_assert(CONSTRUCT_ASYNC_DEPTH == 0 || (CONSTRUCT_ASYNC_DEPTH >= 2 && CONSTRUCT_ASYNC_DEPTH * CONSTRUCT_WARPS <= 96),
              "CONSTRUCT_ASYNC_DEPTH: 0, or 2.. with the ring (DEPTH * warps * 512 bytes) within 48 KB of static shared memory");

using namespace twellpy;

// Read-once load of VEC elements (see CONSTRUCT_STREAM_LOADS).
template <typename T, int VEC>
__device__ __forceinline__ vec_t<T, VEC> load_stream(const T* __restrict__ p) {
#if CONSTRUCT_STREAM_LOADS
    if (VEC * sizeof(T) == 16) {
        const uint4 r = __ldcs(reinterpret_cast<const uint4*>(p));
        return *reinterpret_cast<const vec_t<T, VEC>*>(&r);
    }
#endif
    return load_vec<T, VEC>(p);
}

// Bit k set when element k of the vector is non-zero.
template <typename T, int VEC>
__device__ __forceinline__ unsigned nonzero_bits(const vec_t<T, VEC>& w) {
    if (sizeof(T) == 2 && VEC == 8) {
        // Two 16-bit values per word at once: adding 0x7fff to the magnitude
        // sets bit 15 of a half exactly when it is non-zero (no carry crosses
        // halves: 0x7fff + 0x7fff < 0x10000). 5 operations per 2 values.
        const uint4 r = *reinterpret_cast<const uint4*>(&w);
        const unsigned q[4] = {r.x, r.y, r.z, r.w};
        unsigned bits = 0u;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const unsigned t = (q[i] & 0x7fff7fffu) + 0x7fff7fffu;
            bits |= (((t >> 15) & 1u) | ((t >> 30) & 2u)) << (2 * i);
        }
        return bits;
    }
    unsigned bits = 0u;
#pragma unroll
    for (int k = 0; k < VEC; ++k) bits |= (nonzero(w.v[k]) ? 1u : 0u) << k;
    return bits;
}

// Element k of a register vector for a run-time k, by a chain of selects (an
// indexed register array would go to local memory).
template <typename T, int VEC>
__device__ __forceinline__ T vec_element(const vec_t<T, VEC>& w, int k) {
    T out = w.v[0];
#pragma unroll
    for (int j = 1; j < VEC; ++j)
        if (k == j) out = w.v[j];
    return out;
}

// NaN or +-Inf: every exponent bit set (decided on the bits, like nonzero()).
__device__ __forceinline__ bool nonfinite(float v) {
    return (__float_as_uint(v) & 0x7f800000u) == 0x7f800000u;
}
__device__ __forceinline__ bool nonfinite(double v) {
    return (__double_as_longlong(v) & 0x7ff0000000000000ll) == 0x7ff0000000000000ll;
}
__device__ __forceinline__ bool nonfinite(__half v) { return (__half_as_ushort(v) & 0x7c00u) == 0x7c00u; }
__device__ __forceinline__ bool nonfinite(__nv_bfloat16 v) {
    return (__bfloat16_as_ushort(v) & 0x7f80u) == 0x7f80u;
}

// Prefix count over the warp of the (lane, k)-ordered non-zero bits: `below` =
// non-zeros of lower lanes, `total` = non-zeros of the whole warp.
template <int VEC>
__device__ __forceinline__ void warp_bit_prefix(unsigned bits, int lane, int& below, int& total) {
    const unsigned lt = lanes_below(lane);
    below = 0;
    total = 0;
#pragma unroll
    for (int k = 0; k < VEC; ++k) {
        const unsigned m = __ballot_sync(FULL_MASK, (bits >> k) & 1u);
        below += __popc(m & lt);
        total += __popc(m);
    }
}

// Position of a chunk within the warp's span: tile t, chunk `part` of that tile.
// Stepped by one chunk at a time, so the loop divides nothing at run time.
struct ChunkPos {
    int t;
    int part;
};

__device__ __forceinline__ void next_chunk(ChunkPos& p, int chunks_per_tile) {
    if (++p.part == chunks_per_tile) {
        p.part = 0;
        ++p.t;
    }
}

// Column of this lane's first element of the chunk at `p`; false when the
// vector lies past the tile's end or past N (it is then not read).
template <int VEC>
__device__ __forceinline__ bool lane_column(ChunkPos p, int lane, int tile, int N, int& col) {
    const int in_tile = p.part * (32 * VEC) + lane * VEC;
    col = p.t * tile + in_tile;
    return in_tile < tile && col < N;
}

// Loads chunks [c, c + CONSTRUCT_UNROLL) of the span (zeros past c_end, past the
// tile's end and past N); `p` is the position of chunk c.
template <typename T, int VEC>
__device__ __forceinline__ void load_chunks(vec_t<T, VEC> (&buf)[CONSTRUCT_UNROLL], const T* __restrict__ xrow,
                                            int c, int c_end, ChunkPos p, int chunks_per_tile, int tile, int N,
                                            int lane) {
#pragma unroll
    for (int u = 0; u < CONSTRUCT_UNROLL; ++u) {
        int col;
        if (c + u < c_end && lane_column<VEC>(p, lane, tile, N, col)) {
            buf[u] = load_stream<T, VEC>(xrow + col);
        } else {
#pragma unroll
            for (int k = 0; k < VEC; ++k) buf[u].v[k] = zero_value<T>();
        }
        next_chunk(p, chunks_per_tile);
    }
}

// 16-byte global -> shared copy that completes asynchronously (cp.async, sm_80+);
// `fill` false writes 16 zero bytes and reads nothing. `policy` is an L2 cache
// policy (read_once_policy) or 0 for none. Without __CUDA_ARCH__ (the CPU
// emulation of tests/cuda_emu) the copy happens at the wait (emu.h), so a
// read before its wait sees stale data there too.
__device__ __forceinline__ void copy_async_16(uint4* smem_dst, const void* gmem_src, bool fill,
                                              unsigned long long policy) {
#ifdef __CUDA_ARCH__
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem_dst));
    const unsigned long long src = static_cast<unsigned long long>(__cvta_generic_to_global(gmem_src));
#if CONSTRUCT_STREAM_LOADS
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(dst), "l"(src),
                 "r"(fill ? 16 : 0), "l"(policy)
                 : "memory");
#else
    (void)policy;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(fill ? 16 : 0)
                 : "memory");
#endif
#else
    (void)policy;
    emu::copy_async_16(smem_dst, gmem_src, fill);
#endif
}

// Evict-first L2 policy for the input, which is read once (as ld.global.cs does
// in the register path): the slots it produces are what should stay in L2.
__device__ __forceinline__ unsigned long long read_once_policy() {
    unsigned long long p = 0;
#if defined(__CUDA_ARCH__) && CONSTRUCT_STREAM_LOADS
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(p));
#endif
    return p;
}

__device__ __forceinline__ void copy_async_commit() {
#ifdef __CUDA_ARCH__
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#else
    emu::copy_async_commit();
#endif
}

// Waits until at most PENDING of this thread's committed copy groups are unfinished.
template <int PENDING>
__device__ __forceinline__ void copy_async_wait() {
#ifdef __CUDA_ARCH__
    asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING) : "memory");
#else
    emu::copy_async_wait(PENDING);
#endif
}

// What a warp carries from chunk to chunk of its span.
struct PackState {
    int run;        // non-zeros seen so far in the current tile (true count)
    int local_max;  // largest true tile count among the warp's tiles
    bool bad;       // this lane saw a NaN / Inf
};

// Packs one chunk (this lane's VEC elements of it in `w`) at position `at`.
template <typename T, int VEC>
__device__ __forceinline__ void pack_chunk(const vec_t<T, VEC>& w, ChunkPos at, PackState& st, T* __restrict__ values,
                                           int* __restrict__ indices, int* __restrict__ counts, int row, int tile,
                                           int slots, int n_tiles, int chunks_per_tile, int lane) {
    const int col = at.t * tile + at.part * (32 * VEC) + lane * VEC;
    if (at.part == 0) st.run = 0;
    // Activations are ~99% zeros: count per lane, one warp prefix count,
    // then visit only the set bits (most lanes skip the loop). NaN and Inf
    // are non-zero bit patterns, so the finiteness test runs there too.
    unsigned bits = nonzero_bits<T, VEC>(w);
    int pos, total;
#if CONSTRUCT_FAST_PREFIX
    const unsigned has = __ballot_sync(FULL_MASK, bits != 0u);
    if (__ballot_sync(FULL_MASK, (bits & (bits - 1u)) != 0u) == 0u) {  // uniform: one bit per lane at most
        pos = st.run + __popc(has & lanes_below(lane));
        total = __popc(has);
    } else
#endif
    {
        const int mine = __popc(bits);
        const int incl = warp_inclusive_sum(mine, lane);
        total = __shfl_sync(FULL_MASK, incl, 31);
        pos = st.run + incl - mine;
    }
    const long long base = ((long long)row * n_tiles + at.t) * slots;
    while (bits) {
        const int k = __ffs(bits) - 1;
        bits &= bits - 1u;
        const T v = vec_element<T, VEC>(w, k);
        st.bad |= nonfinite(v);
        if (pos < slots) {
            values[base + pos] = v;
            indices[base + pos] = col + k;
        }
        ++pos;
    }
    st.run += total;
    if (at.part == chunks_per_tile - 1) {  // tile finished: padding, count, max
        const int stored = min(st.run, slots);
        const T zero = zero_value<T>();
        for (int s = stored + lane; s < slots; s += 32) {
            values[base + s] = zero;
            indices[base + s] = -1;
        }
        if (lane == 0) counts[(long long)row * n_tiles + at.t] = stored;
        st.local_max = max(st.local_max, st.run);
    }
}

// ---------------------------------------------------------------------------
// twellpy_dense_to_twell<T, VEC>: one pass over the dense input.
//   x        (M, N)             T      dense input, C order
//   values   (M, n_tiles, S)    T      out: first min(count, S) non-zeros of each (row, tile)
//   indices  (M, n_tiles, S)    int32  out: global column, -1 in padding
//   counts   (M, n_tiles)       int32  out: min(true count, S)
//   row_max  (M,)               int32  out: largest TRUE tile count of the row (may exceed S);
//                                      zero-filled by the caller when n_groups > 1
//   nonfinite (1,)              int32  in/out: zero-filled by the caller; set to 1 when x holds
//                                      a NaN or Inf (the finiteness check fused into the pass)
// Warp w owns (row = w / n_groups, tiles [g*tpw, (g+1)*tpw) of that row) with
// g = w % n_groups, n_groups = ceil(n_tiles / tpw). grid.x = ceil(M*n_groups / warps per block).
// row_max of a row split over several warps is combined with atomicMax, whose
// result (a max of integers) does not depend on the order.
// ---------------------------------------------------------------------------
template <typename T, int VEC>
__global__ void __launch_bounds__(CONSTRUCT_WARPS * 32, CONSTRUCT_MIN_BLOCKS)
twellpy_dense_to_twell(const T* __restrict__ x, T* __restrict__ values, int* __restrict__ indices,
                       int* __restrict__ counts, int* __restrict__ row_max, int* __restrict__ nonfinite_flag,
                       int M, int N, int tile, int slots, int n_tiles, int tpw, int n_groups) {
    const long long warp = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (warp >= (long long)M * n_groups) return;  // uniform over the warp
    const int row = (int)(warp / n_groups);
    const int group = (int)(warp - (long long)row * n_groups);
    const int t_begin = group * tpw;
    const int t_end = min(n_tiles, t_begin + tpw);
    const T* __restrict__ xrow = x + (long long)row * N;
    const int chunk = 32 * VEC;
    // A tile wider than the row is the row (n_tiles = 1, the same columns): walking it
    // whole would visit (tile - N) / chunk empty chunks. Rounded up without tile + chunk - 1,
    // which overflows int for a tile within one chunk of 2^31 (the loop then ran zero times).
    tile = min(tile, N);
    const int chunks_per_tile = (tile - 1) / chunk + 1;
    const int c_begin = t_begin * chunks_per_tile;
    const int c_end = t_end * chunks_per_tile;

    PackState st = {0, 0, false};
#if CONSTRUCT_ASYNC_DEPTH
    if constexpr (VEC * sizeof(T) == 16) {
        // Ring of DEPTH chunks per warp; each lane reads back only the 16 bytes it
        // copied, so no barrier is needed. Chunk i lives in slot i % DEPTH, and the
        // copy of chunk i + DEPTH - 1 goes into the slot chunk i - 1 was read from.
        constexpr int DEPTH = CONSTRUCT_ASYNC_DEPTH;
        __shared__ uint4 ring[CONSTRUCT_WARPS * DEPTH * 32];
        uint4* const mine = ring + (threadIdx.x >> 5) * DEPTH * 32 + lane;
        const unsigned long long policy = read_once_policy();
        const int n = c_end - c_begin;
        ChunkPos p_copy = {t_begin, 0};  // position of the next chunk to copy
        int i_copy = 0, slot_copy = 0;   // its index in the span and its slot (i_copy % DEPTH)
        auto copy_next = [&]() {
            int col = 0;
            const bool fill = i_copy < n && lane_column<VEC>(p_copy, lane, tile, N, col);
            copy_async_16(mine + slot_copy * 32, fill ? xrow + col : xrow, fill, policy);
            copy_async_commit();  // one group per chunk, empty ones too, so the counts below hold
            next_chunk(p_copy, chunks_per_tile);
            ++i_copy;
            slot_copy = slot_copy == DEPTH - 1 ? 0 : slot_copy + 1;
        };
        for (int i = 0; i < DEPTH - 1; ++i) copy_next();
        ChunkPos p = {t_begin, 0};
        int slot_read = 0;  // i % DEPTH
        for (int i = 0; i < n; ++i) {
            copy_async_wait<DEPTH - 2>();  // groups 0..i are complete
            const uint4 raw = mine[slot_read * 32];
            slot_read = slot_read == DEPTH - 1 ? 0 : slot_read + 1;
            copy_next();                   // chunk i + DEPTH - 1, into the slot chunk i - 1 was read from
            pack_chunk<T, VEC>(*reinterpret_cast<const vec_t<T, VEC>*>(&raw), p, st, values, indices, counts, row,
                               tile, slots, n_tiles, chunks_per_tile, lane);
            next_chunk(p, chunks_per_tile);
        }
        copy_async_wait<0>();  // no copy outlives the warp
    } else
#endif
    {
        ChunkPos p = {t_begin, 0};  // position of chunk c0
        vec_t<T, VEC> buf[CONSTRUCT_UNROLL];
        load_chunks<T, VEC>(buf, xrow, c_begin, c_end, p, chunks_per_tile, tile, N, lane);
        for (int c0 = c_begin; c0 < c_end; c0 += CONSTRUCT_UNROLL) {
#if CONSTRUCT_PREFETCH
            // The next group's loads go out before this group is packed.
            ChunkPos p_next = p;
#pragma unroll
            for (int u = 0; u < CONSTRUCT_UNROLL; ++u) next_chunk(p_next, chunks_per_tile);
            vec_t<T, VEC> ahead[CONSTRUCT_UNROLL];
            load_chunks<T, VEC>(ahead, xrow, c0 + CONSTRUCT_UNROLL, c_end, p_next, chunks_per_tile, tile, N, lane);
#endif
#pragma unroll
            for (int u = 0; u < CONSTRUCT_UNROLL; ++u) {
                if (c0 + u >= c_end) break;  // uniform
                pack_chunk<T, VEC>(buf[u], p, st, values, indices, counts, row, tile, slots, n_tiles,
                                   chunks_per_tile, lane);
                next_chunk(p, chunks_per_tile);
            }
#if CONSTRUCT_PREFETCH
#pragma unroll
            for (int u = 0; u < CONSTRUCT_UNROLL; ++u) buf[u] = ahead[u];
#else
            if (c0 + CONSTRUCT_UNROLL < c_end)  // p is now the next group's position
                load_chunks<T, VEC>(buf, xrow, c0 + CONSTRUCT_UNROLL, c_end, p, chunks_per_tile, tile, N, lane);
#endif
        }
    }
    const int local_max = st.local_max;
    const bool bad = st.bad;
    const bool warp_bad = __any_sync(FULL_MASK, bad);
    if (lane == 0) {
        if (n_groups == 1) row_max[row] = local_max;
        else atomicMax(row_max + row, local_max);
        if (warp_bad) atomicOr(nonfinite_flag, 1);  // a flag: the result does not depend on order
    }
}

// ---------------------------------------------------------------------------
// twellpy_dense_row_nnz<T, VEC>: non-zeros per row.
//   x          (M, N)   T      dense input
//   row_nnz    (M,)     int32  out
//   nonfinite  (1,)     int32  in/out: zero-filled by the caller; set to 1 when x holds NaN/Inf
// One warp per row; grid.x = ceil(M / warps per block).
// ---------------------------------------------------------------------------
template <typename T, int VEC>
__global__ void __launch_bounds__(CONSTRUCT_WARPS * 32)
twellpy_dense_row_nnz(const T* __restrict__ x, int* __restrict__ row_nnz, int* __restrict__ nonfinite_flag,
                      int M, int N) {
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= M) return;
    const T* __restrict__ xrow = x + row * N;
    const int chunk = 32 * VEC;
    int mine = 0;
    bool bad = false;
    for (int c0 = 0; c0 < N; c0 += chunk * CONSTRUCT_UNROLL) {
        vec_t<T, VEC> buf[CONSTRUCT_UNROLL];
#pragma unroll
        for (int u = 0; u < CONSTRUCT_UNROLL; ++u) {
            const int col = c0 + u * chunk + lane * VEC;
            if (col < N) buf[u] = load_vec<T, VEC>(xrow + col);
            else {
#pragma unroll
                for (int k = 0; k < VEC; ++k) buf[u].v[k] = zero_value<T>();
            }
        }
#pragma unroll
        for (int u = 0; u < CONSTRUCT_UNROLL; ++u) {
            unsigned bits = nonzero_bits<T, VEC>(buf[u]);
            mine += __popc(bits);
            while (bits) {  // NaN / Inf are non-zero: only set elements need the test
                const int k = __ffs(bits) - 1;
                bits &= bits - 1u;
                bad |= nonfinite(vec_element<T, VEC>(buf[u], k));
            }
        }
    }
    mine = warp_sum(mine);
    const bool warp_bad = __any_sync(FULL_MASK, bad);
    if (lane == 0) {
        row_nnz[row] = mine;
        if (warp_bad) atomicOr(nonfinite_flag, 1);
    }
}

// ---------------------------------------------------------------------------
// twellpy_dense_to_ell<T, VEC>: dense -> ELL of width W.
//   x        (M, N)   T      dense input
//   row_nnz  (M,)     int32  in: non-zeros per row (from twellpy_dense_row_nnz)
//   values   (M, W)   T      out
//   indices  (M, W)   int32  out, -1 in padding
// Rows with row_nnz > W are written as padding only (the caller keeps them
// elsewhere). One warp per row; grid.x = ceil(M / warps per block).
// ---------------------------------------------------------------------------
template <typename T, int VEC>
__global__ void __launch_bounds__(CONSTRUCT_WARPS * 32)
twellpy_dense_to_ell(const T* __restrict__ x, const int* __restrict__ row_nnz, T* __restrict__ values,
                     int* __restrict__ indices, int M, int N, int width) {
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= M) return;
    const T zero = zero_value<T>();
    const long long base = row * (long long)width;
    int run = 0;
    if (row_nnz[row] <= width) {
        const T* __restrict__ xrow = x + row * N;
        const int chunk = 32 * VEC;
        for (int c0 = 0; c0 < N && run < width; c0 += chunk * CONSTRUCT_UNROLL) {
            vec_t<T, VEC> buf[CONSTRUCT_UNROLL];
#pragma unroll
            for (int u = 0; u < CONSTRUCT_UNROLL; ++u) {
                const int col = c0 + u * chunk + lane * VEC;
                if (col < N) buf[u] = load_vec<T, VEC>(xrow + col);
                else {
#pragma unroll
                    for (int k = 0; k < VEC; ++k) buf[u].v[k] = zero;
                }
            }
#pragma unroll
            for (int u = 0; u < CONSTRUCT_UNROLL; ++u) {
                const int col = c0 + u * chunk + lane * VEC;
                const unsigned bits = nonzero_bits<T, VEC>(buf[u]);
                int below, total;
                warp_bit_prefix<VEC>(bits, lane, below, total);
                int pos = run + below;
#pragma unroll
                for (int k = 0; k < VEC; ++k) {
                    if ((bits >> k) & 1u) {
                        if (pos < width) {
                            values[base + pos] = buf[u].v[k];
                            indices[base + pos] = col + k;
                        }
                        ++pos;
                    }
                }
                run += total;
            }
        }
    }
    for (int s = min(run, width) + lane; s < width; s += 32) {
        values[base + s] = zero;
        indices[base + s] = -1;
    }
}

// ---------------------------------------------------------------------------
// twellpy_csr_to_twell<T>: CSR (sorted, unique columns per row) -> TwELL.
//   indptr   (M+1,)            int64  row pointers
//   cols     (nnz,)            int32  column of each entry
//   data     (nnz,)            T      value of each entry (all entries are kept)
//   values   (M, n_tiles, S)   T      out
//   indices  (M, n_tiles, S)   int32  out, -1 in padding
//   counts   (M, n_tiles)      int32  out: min(true count, S)
//   row_max  (M,)              int32  out: largest true tile count of the row
//   bad      (1,)              int32  in/out: incremented per entry whose column is out of
//                                     [0, n_cols) or not strictly increasing (entry skipped)
// One warp per row; grid.x = ceil(M / warps per block). The slot of an entry is
// the number of earlier entries of its row in the same tile (__match_any_sync).
// ---------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(CONSTRUCT_WARPS * 32)
twellpy_csr_to_twell(const long long* __restrict__ indptr, const int* __restrict__ cols,
                     const T* __restrict__ data, T* __restrict__ values, int* __restrict__ indices,
                     int* __restrict__ counts, int* __restrict__ row_max, int* __restrict__ bad,
                     int M, int n_cols, int tile, int slots, int n_tiles) {
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= M) return;
    const unsigned lt = lanes_below(lane);
    const long long crow = row * n_tiles;
    for (int t = lane; t < n_tiles; t += 32) counts[crow + t] = 0;
    __syncwarp();

    const long long start = indptr[row], end = indptr[row + 1];
    int carry_tile = -1, carry_count = 0;  // open tile continued from the previous chunk
    int prev_col = -1;                     // last column of the previous chunk
    for (long long e0 = start; e0 < end; e0 += 32) {
        const long long e = e0 + lane;
        const bool in = e < end;
        const int col = in ? cols[e] : 0x7fffffff;
        int before = __shfl_up_sync(FULL_MASK, col, 1);
        if (lane == 0) before = prev_col;
        const bool ok = in && col > before && col < n_cols;  // col > before >= -1 also gives col >= 0
        const unsigned okmask = __ballot_sync(FULL_MASK, ok);
        const unsigned badmask = __ballot_sync(FULL_MASK, in && !ok);
        if (badmask && lane == 0) atomicAdd(bad, __popc(badmask));
        const int t = ok ? col / tile : -1;
        const unsigned same = __match_any_sync(FULL_MASK, t) & okmask;
        const int pos = __popc(same & lt) + (t == carry_tile ? carry_count : 0);
        if (ok) {
            if (pos < slots) {
                const long long dst = (crow + t) * slots + pos;
                values[dst] = data[e];
                indices[dst] = col;
            }
            // The last entry of its tile in this chunk records the running count;
            // a later chunk continuing the tile overwrites it (ordered by __syncwarp).
            if ((same >> lane) == 1u) counts[crow + t] = pos + 1;
        }
        if (okmask) {
            const int hi = 31 - __clz(okmask);
            carry_tile = __shfl_sync(FULL_MASK, t, hi);
            carry_count = __shfl_sync(FULL_MASK, pos, hi) + 1;
        }
        prev_col = __shfl_sync(FULL_MASK, col, 31);  // only used when the chunk was full
        __syncwarp();
    }
    // Padding, clamped counts and the row's largest true count.
    int best = 0;
    for (int t = 0; t < n_tiles; ++t) {
        const int c = counts[crow + t];
        __syncwarp();
        const int stored = min(c, slots);
        const long long base = (crow + t) * slots;
        for (int s = stored + lane; s < slots; s += 32) {
            values[base + s] = zero_value<T>();
            indices[base + s] = -1;
        }
        if (lane == 0 && c > slots) counts[crow + t] = slots;
        best = max(best, c);
    }
    if (lane == 0) row_max[row] = best;
}

// ---------------------------------------------------------------------------
// twellpy_csr_to_ell<T>: CSR (sorted, unique columns per row) -> ELL of width W.
//   indptr   (M+1,)   int64
//   cols     (nnz,)   int32
//   data     (nnz,)   T
//   values   (M, W)   T      out
//   indices  (M, W)   int32  out, -1 in padding
//   row_nnz  (M,)     int32  out: true entries of the row (rows with more than W are padding)
//   bad      (1,)     int32  in/out: entries with a column out of range or not increasing
// One warp per row; grid.x = ceil(M / warps per block).
// ---------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(CONSTRUCT_WARPS * 32)
twellpy_csr_to_ell(const long long* __restrict__ indptr, const int* __restrict__ cols,
                   const T* __restrict__ data, T* __restrict__ values, int* __restrict__ indices,
                   int* __restrict__ row_nnz, int* __restrict__ bad, int M, int n_cols, int width) {
    const long long row = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int lane = threadIdx.x & 31;
    if (row >= M) return;
    const long long start = indptr[row], end = indptr[row + 1];
    const long long n = end - start;
    const long long base = row * (long long)width;
    int stored = 0;
    if (n <= width) {
        for (long long e0 = start; e0 < end; e0 += 32) {
            const long long e = e0 + lane;
            const bool in = e < end;
            const int col = in ? cols[e] : 0x7fffffff;
            int before = __shfl_up_sync(FULL_MASK, col, 1);
            if (lane == 0) before = e0 > start ? cols[e0 - 1] : -1;
            const bool ok = in && col > before && col < n_cols;
            const unsigned badmask = __ballot_sync(FULL_MASK, in && !ok);
            if (badmask && lane == 0) atomicAdd(bad, __popc(badmask));
            if (in) {
                const long long dst = base + (e - start);
                values[dst] = ok ? data[e] : zero_value<T>();
                indices[dst] = ok ? col : -1;
            }
        }
        stored = (int)n;
    } else {
        // Too wide for the ELL part: only validate the columns.
        for (long long e0 = start; e0 < end; e0 += 32) {
            const long long e = e0 + lane;
            const bool in = e < end;
            const int col = in ? cols[e] : 0x7fffffff;
            const int before = in ? (e > start ? cols[e - 1] : -1) : -1;
            const unsigned badmask = __ballot_sync(FULL_MASK, in && !(col > before && col < n_cols));
            if (badmask && lane == 0) atomicAdd(bad, __popc(badmask));
        }
    }
    for (int s = stored + lane; s < width; s += 32) {
        values[base + s] = zero_value<T>();
        indices[base + s] = -1;
    }
    if (lane == 0) row_nnz[row] = (int)n;
}
