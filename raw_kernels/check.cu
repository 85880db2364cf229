// check.cu -- input validation on the device.
//
// The finiteness check of every public entry point (check_finite=True) used
// three CuPy passes (mask, compare, any) plus their temporaries; at W1-16k
// that cost more than the sparse FFN step itself. This kernel decides it in
// one read of the input, on the bit pattern (independent of -ftz).
#include "common.cuh"

#ifndef CHECK_BLOCK
#define CHECK_BLOCK 256          // threads per block
#endif

// ---------------------------------------------------------------------------
// twellpy_count_nonfinite<U>: number of NaN/Inf elements of a float array,
// read as unsigned words U of the element's width (uint16 for bf16/fp16,
// uint32 for fp32, uint64 for fp64).
//   data      (n,)   U       the array's elements, contiguous
//   n                        number of elements
//   exp_mask                 the format's exponent bits: an element is NaN
//                            or Inf exactly when all of them are set
//   aligned                  1: data is 16-byte aligned (bulk read in 16-byte
//                            vectors), 0: element by element
//   count     (1,)   uint64  in/out: zeroed by the caller; incremented by the
//                            number of non-finite elements
// Grid-stride; any grid. The count is an integer sum, so the result does
// not depend on the order of the atomics.
// ---------------------------------------------------------------------------
template <typename U>
__global__ void __launch_bounds__(CHECK_BLOCK)
twellpy_count_nonfinite(const U* __restrict__ data, long long n, unsigned long long exp_mask, int aligned,
                        unsigned long long* __restrict__ count) {
    constexpr int PER = 16 / sizeof(U);
    const U mask = (U)exp_mask;
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long tid = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long n_vec = aligned ? n / PER : 0;
    unsigned long long mine = 0;
    const uint4* vecs = reinterpret_cast<const uint4*>(data);
    for (long long i = tid; i < n_vec; i += stride) {
        const uint4 v = vecs[i];
        const U* e = reinterpret_cast<const U*>(&v);
#pragma unroll
        for (int k = 0; k < PER; ++k) mine += ((e[k] & mask) == mask) ? 1u : 0u;
    }
    for (long long i = n_vec * PER + tid; i < n; i += stride) mine += ((data[i] & mask) == mask) ? 1u : 0u;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mine += __shfl_xor_sync(twellpy::FULL_MASK, mine, o);
    if ((threadIdx.x & 31) == 0 && mine) atomicAdd(count, mine);
}

// ---------------------------------------------------------------------------
// twellpy_nonfinite_ledger: publish one call's NaN/Inf count straight into
// pinned host memory, from inside a CUDA graph. A checked decode-size call
// replayed as a graph used to queue a device-to-host copy and record an event
// after every replay, and query those events on later calls: about 12 us a
// call back to back, which made the checked M = 128 call slower than dense.
// The graph now carries this one-thread kernel; the host reads the word
// without any CUDA call (H100: the check's cost at M = 128 fell to 4 us).
//   count  (1,)  uint64  the call's count (written by an earlier kernel)
//   seq    (1,)  uint64  in/out: number of calls published so far (device-
//                        resident, owned by one ledger)
//   ring   (R,)  uint64  pinned host words (device view of them): slot
//                        seq % R gets (seq mod 2^24) << 40 | min(count,
//                        2^40 - 1), so the host can tell the call the slot
//                        now holds from the one R calls earlier
// One thread; launch <<<1, 32>>> on the stream of the call (stream order
// makes the seq the host assigned at launch the one the kernel reads).
// ---------------------------------------------------------------------------
__global__ void twellpy_nonfinite_ledger(const unsigned long long* __restrict__ count,
                                        unsigned long long* __restrict__ seq,
                                        volatile unsigned long long* ring, int ring_size) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    const unsigned long long call = *seq;
    const unsigned long long cap = (1ull << 40) - 1;
    const unsigned long long n = *count < cap ? *count : cap;
    // one aligned 8-byte store: the host never sees half of a word
    ring[call % (unsigned long long)ring_size] = ((call & 0xFFFFFFull) << 40) | n;
    __threadfence_system();  // push the store towards the host before the kernel ends
    *seq = call + 1;
}
