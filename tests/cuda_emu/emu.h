// emu.h -- run CUDA kernels of raw_kernels/ on the CPU, one OS thread per CUDA thread.
//
// For tests only (tests/test_kernel_emulation.py): it executes the real kernel
// source, so index arithmetic, barriers, warp shuffles and shared-memory use
// are checked on a machine without a GPU. It is not a performance model.
//
// What it emulates:
//   * blocks run one after another; the threads of a block run concurrently
//     (std::thread each), so __syncthreads / __syncwarp are real barriers
//     (std::barrier) and a missing one can show up as a wrong result;
//   * warp shuffles and ballots exchange values through per-warp slots between
//     two barrier phases (every lane of the warp must take part, as the
//     kernels' full-mask calls require);
//   * static __shared__ arrays become function statics (one block at a time),
//     extern __shared__ the block's dynamic buffer, poisoned with 0xCD bytes;
//   * a thread that returns early leaves its barriers (arrive_and_drop).
//   * cp.async copies happen at the wait_group that completes their group;
//   * a full-mask warp operation that a returned lane (or a block ending
//     mid-warp) cannot join stops the test with a message (undefined on a GPU);
// What it does not: -ftz (denormals), memory-model subtleties, timing.
// The test turns `__shared__` into `static` and `extern __shared__ T x[];`
// into a pointer to the dynamic buffer before compiling (see the test).
#pragma once
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return uint4{a, b, c, d}; }

namespace emu {
struct Warp {
    std::barrier<> bar;
    uint64_t slot[32];
    int lanes;                  // threads of the block in this warp (32 unless the block ends mid-warp)
    std::atomic<int> gone{0};   // lanes that have returned from the kernel
    explicit Warp(int n) : bar(n), lanes(n) {}
};
struct Block {
    std::barrier<> bar;
    std::vector<std::unique_ptr<Warp>> warps;
    std::vector<unsigned char> dyn;
    Block(int n, size_t smem) : bar(n), dyn(smem + 16, 0xCD) {
        for (int w = 0; w * 32 < n; ++w) warps.emplace_back(new Warp(std::min(32, n - 32 * w)));
    }
};
inline thread_local Block* cur = nullptr;
inline thread_local dim3 tidx, bidx;
inline thread_local int linear = 0;   // x + y * blockDim.x + ...: warps are runs of 32 of these
inline dim3 bdim, gdim;
inline int lane() { return linear & 31; }
inline Warp& warp() { return *cur->warps[linear >> 5]; }
// A full-mask warp operation needs all 32 lanes: one that a lane has left by
// returning (or that a block ending mid-warp cannot fill) is undefined on the
// GPU, where it may hang or read garbage. The emulation's barriers would let it
// through, so it stops here with a message (detected when the lane has already
// returned by the time another arrives, which is how such a bug usually runs).
inline void require_full_warp(unsigned mask, const char* op) {
    Warp& w = warp();
    if (mask != 0xffffffffu) return;
    const int gone = w.gone.load(std::memory_order_acquire);
    if (w.lanes < 32 || gone > 0) {
        std::fprintf(stderr, "emu: %s with a full mask in block (%u, %u, %u), warp %d: %s\n", op, bidx.x, bidx.y,
                     bidx.z, linear >> 5, w.lanes < 32 ? "the block ends inside this warp" : "a lane has returned");
        std::abort();
    }
}
inline void* dynamic_smem() {   // 16-byte aligned start
    auto p = reinterpret_cast<uintptr_t>(cur->dyn.data());
    return reinterpret_cast<void*>((p + 15) & ~uintptr_t(15));
}
template <typename T> inline uint64_t to_bits(T v) { uint64_t b = 0; std::memcpy(&b, &v, sizeof(T)); return b; }
template <typename T> inline T from_bits(uint64_t b) { T v; std::memcpy(&v, &b, sizeof(T)); return v; }
template <typename T> inline T exchange(T v, int src) {
    Warp& w = warp();
    w.slot[lane()] = to_bits(v);
    w.bar.arrive_and_wait();
    const T out = from_bits<T>(w.slot[src & 31]);
    w.bar.arrive_and_wait();
    return out;
}

// Launch: blocks in order, the threads of a block together.
template <typename F, typename... Args>
void launch(F kernel, dim3 grid, dim3 block, size_t smem, Args... args) {
    gdim = grid;
    bdim = block;
    const int n = (int)(block.x * block.y * block.z);
    for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
            for (unsigned bx = 0; bx < grid.x; ++bx) {
                Block blk(n, smem);
                std::vector<std::thread> threads;
                threads.reserve(n);
                for (int t = 0; t < n; ++t)
                    threads.emplace_back([&, t] {
                        cur = &blk;
                        bidx = dim3(bx, by, bz);
                        linear = t;
                        tidx = dim3((unsigned)t % block.x, ((unsigned)t / block.x) % block.y,
                                    (unsigned)t / (block.x * block.y));
                        kernel(args...);
                        warp().gone.fetch_add(1, std::memory_order_release);
                        warp().bar.arrive_and_drop();   // done: later barriers need not wait for it
                        blk.bar.arrive_and_drop();
                    });
                for (auto& th : threads) th.join();
            }
}

// cp.async (construct.cu's ring): copies are queued per thread and performed
// when a wait_group leaves their group behind, so a kernel that reads a slot
// before waiting for it reads stale data here (an earlier chunk), as it may on the GPU.
struct AsyncCopy {
    void* dst;
    const void* src;
    bool fill;  // false: 16 zero bytes
};
inline thread_local std::vector<std::vector<AsyncCopy>> async_groups;  // committed, oldest first
inline thread_local std::vector<AsyncCopy> async_open;                 // issued since the last commit
inline void copy_async_16(void* dst, const void* src, bool fill) { async_open.push_back({dst, src, fill}); }
inline void copy_async_commit() {
    async_groups.push_back(std::move(async_open));
    async_open.clear();
}
inline void copy_async_wait(int pending) {
    while ((int)async_groups.size() > pending) {
        for (const AsyncCopy& c : async_groups.front()) {
            if (c.fill) std::memcpy(c.dst, c.src, 16);
            else std::memset(c.dst, 0, 16);
        }
        async_groups.erase(async_groups.begin());
    }
}
}  // namespace emu

#define threadIdx (emu::tidx)
#define blockIdx (emu::bidx)
#define blockDim (emu::bdim)
#define gridDim (emu::gdim)
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)

inline void __syncthreads() { emu::cur->bar.arrive_and_wait(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
    emu::require_full_warp(mask, "__syncwarp");
    emu::warp().bar.arrive_and_wait();
}
template <typename T> inline T __shfl_sync(unsigned mask, T v, int src, int = 32) {
    emu::require_full_warp(mask, "__shfl_sync");
    return emu::exchange(v, src);
}
template <typename T> inline T __shfl_xor_sync(unsigned mask, T v, int m, int = 32) {
    emu::require_full_warp(mask, "__shfl_xor_sync");
    return emu::exchange(v, emu::lane() ^ m);
}
template <typename T> inline T __shfl_up_sync(unsigned mask, T v, unsigned d, int = 32) {
    emu::require_full_warp(mask, "__shfl_up_sync");
    const int src = emu::lane() - (int)d;
    const T got = emu::exchange(v, src < 0 ? emu::lane() : src);
    return src < 0 ? v : got;
}
inline unsigned __ballot_sync(unsigned mask, int pred) {
    emu::require_full_warp(mask, "__ballot_sync");
    emu::Warp& w = emu::warp();
    w.slot[emu::lane()] = pred ? 1u : 0u;
    w.bar.arrive_and_wait();
    unsigned m = 0;
    for (int l = 0; l < 32; ++l)
        if (w.slot[l] == 1u) m |= 1u << l;
    w.bar.arrive_and_wait();
    return m;
}
inline int __any_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) != 0u; }
inline int __all_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) == 0xffffffffu; }
// lanes holding the same value (every lane of the warp takes part)
template <typename T> inline unsigned __match_any_sync(unsigned mask, T v) {
    emu::require_full_warp(mask, "__match_any_sync");
    emu::Warp& w = emu::warp();
    w.slot[emu::lane()] = emu::to_bits(v);
    w.bar.arrive_and_wait();
    unsigned m = 0;
    for (int l = 0; l < 32; ++l)
        if (w.slot[l] == w.slot[emu::lane()]) m |= 1u << l;
    w.bar.arrive_and_wait();
    return m;
}
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __clz(int v) { return v == 0 ? 32 : __builtin_clz((unsigned)v); }
inline int __popcll(unsigned long long v) { return __builtin_popcountll(v); }
inline int __ffs(int v) { return __builtin_ffs(v); }
// byte n of the result is byte (s >> 4n) & 7 of the 8 bytes {x (bytes 0-3), y (bytes 4-7)};
// the sign-replicate mode (selector bit 3) is not emulated: no kernel uses it
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const unsigned long long both = (unsigned long long)y << 32 | x;
    unsigned r = 0;
    for (int n = 0; n < 4; ++n) {
        const unsigned sel = (s >> (4 * n)) & 15u;
        if (sel & 8u) {
            std::fprintf(stderr, "emu: __byte_perm: sign-replicate selectors are not emulated\n");
            std::abort();
        }
        r |= (unsigned)((both >> (8 * sel)) & 0xffu) << (8 * n);
    }
    return r;
}
template <typename T> inline T __ldg(const T* p) { return *p; }
template <typename T> inline T __ldcs(const T* p) { return *p; }
template <typename T> inline void __stcs(T* p, T v) { *p = v; }
template <typename T> inline T __ldcg(const T* p) { return *p; }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __threadfence_system() { std::atomic_thread_fence(std::memory_order_seq_cst); }
inline void __nanosleep(unsigned) {}
template <typename T> inline T atomicAdd(T* p, T v) { return std::atomic_ref<T>(*p).fetch_add(v); }
inline int atomicOr(int* p, int v) { return std::atomic_ref<int>(*p).fetch_or(v); }
inline unsigned atomicOr(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_or(v); }
inline int atomicMax(int* p, int v) {
    std::atomic_ref<int> a(*p);
    int old = a.load();
    while (old < v && !a.compare_exchange_weak(old, v)) {}
    return old;
}

// float and int helpers as CUDA spells them (fma must stay single precision)
// fma(float, float, float): <cmath> already declares the single-precision overload globally
using std::fma;
inline unsigned __float_as_uint(float f) { return emu::from_bits<unsigned>(emu::to_bits(f)); }
inline float __uint_as_float(unsigned u) { return emu::from_bits<float>(emu::to_bits(u)); }
inline int __float_as_int(float f) { return emu::from_bits<int>(emu::to_bits(f)); }
inline long long __double_as_longlong(double d) { return emu::from_bits<long long>(emu::to_bits(d)); }
using std::max;
using std::signbit;
using std::isnan;
using std::isinf;
using std::min;
inline long long min(long long a, int b) { return a < b ? a : (long long)b; }
inline long long min(int a, long long b) { return a < b ? (long long)a : b; }
inline long long max(long long a, int b) { return a > b ? a : (long long)b; }
inline long long max(int a, long long b) { return a > b ? (long long)a : b; }
