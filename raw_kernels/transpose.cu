// transpose.cu -- slot lists (M, K) -> CSR of the transpose (n_cols, M).
//
// Deterministic counting sort in three steps:
//   1. twellpy_transpose_count: per row chunk c and column j, how many entries
//      of the chunk's rows have column j -> chunk_counts (n_chunks, n_cols).
//      Integer atomics: the totals do not depend on the order.
//   2. indptr = exclusive prefix sum of the column totals (cupy); the cursor of
//      (chunk c, column j) = indptr[j] + entries of column j in chunks < c
//      (twellpy_transpose_scan, at the end of this file).
//   3. twellpy_transpose_fill: block c walks its rows IN ORDER (a block barrier
//      between rows); the entries of one row have distinct columns, so every
//      cursor is bumped at most once per row and the output position of an
//      entry is fixed: within each output row the entries are sorted by
//      source row. (The bump uses atomicAdd only so that a malformed input
//      with a repeated column cannot write out of bounds.)
#include "common.cuh"

#ifndef TRANSPOSE_BLOCK
#define TRANSPOSE_BLOCK 256      // threads per block
#endif

using namespace twellpy;

// ---------------------------------------------------------------------------
// twellpy_transpose_count: column histogram per row chunk.
//   indices       (M, K)              int32  column, -1 = padding (out of range skipped)
//   chunk_counts  (n_chunks, n_cols)  int32  in/out: zero-filled by the caller
// chunk of row r = r / chunk_rows. One thread per slot, grid-stride over M*K.
// ---------------------------------------------------------------------------
__global__ void __launch_bounds__(TRANSPOSE_BLOCK)
twellpy_transpose_count(const int* __restrict__ indices, int* __restrict__ chunk_counts,
                        long long M, int K, int n_cols, int chunk_rows) {
    const long long total = M * K;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const int col = indices[i];
        if (col >= 0 && col < n_cols) {
            const long long chunk = (i / K) / chunk_rows;
            atomicAdd(chunk_counts + chunk * n_cols + col, 1);
        }
    }
}

// ---------------------------------------------------------------------------
// twellpy_transpose_fill<T>: place every entry at its cursor.
//   values    (M, K)              T      slot values
//   indices   (M, K)              int32  column, -1 = padding
//   cursor    (n_chunks, n_cols)  int32  in/out: start positions (step 2), advanced here
//   out_col   (nnz,)              int32  out: source row of each entry (CSR column of A.T)
//   out_data  (nnz,)              T      out
// Block c handles rows [c*chunk_rows, min(M, (c+1)*chunk_rows)); grid.x = n_chunks.
// ---------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(TRANSPOSE_BLOCK)
twellpy_transpose_fill(const T* __restrict__ values, const int* __restrict__ indices,
                       int* __restrict__ cursor, int* __restrict__ out_col, T* __restrict__ out_data,
                       int M, int K, int n_cols, int chunk_rows) {
    const int chunk = blockIdx.x;
    const int r_begin = chunk * chunk_rows;  // launcher keeps n_chunks * chunk_rows < 2^31 + chunk_rows
    const int r_end = min(M, r_begin + chunk_rows);
    int* __restrict__ cur = cursor + (long long)chunk * n_cols;
    for (int r = r_begin; r < r_end; ++r) {
        const long long base = (long long)r * K;
        for (int s = threadIdx.x; s < K; s += blockDim.x) {
            const int col = indices[base + s];
            if (col >= 0 && col < n_cols) {
                const int p = atomicAdd(cur + col, 1);
                out_col[p] = r;
                out_data[p] = values[base + s];
            }
        }
        __syncthreads();  // row r is placed before row r+1 takes a cursor
    }
}

// ---------------------------------------------------------------------------
// twellpy_transpose_scan: the start offset of every (block, column) of a
// counting sort (this file's and the training transpose's), in one pass: cursor[b, c] = indptr[c] + sum of counts[b', c]
// over b' < b. A block of 32 x TW_TR_SEGS threads owns 32 columns; each warp
// sums one segment of the block axis, the segment sums are scanned in shared
// memory, then each warp writes its segment's running offsets. Integer sums
// in a fixed order: the same result on every run.
//   counts  (nb, N)  int32  entries per (block, column) from a count pass
//   indptr  (N+1,)   int32  column starts of the transpose
//   cursor  (nb, N)  int32  out
template <int SEGS>
__global__ void __launch_bounds__(32 * SEGS)
twellpy_transpose_scan(const int* __restrict__ counts, const int* __restrict__ indptr, int nb, int N,
                      int* __restrict__ cursor) {
    __shared__ int seg_sum[SEGS][32];
    const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
    const int c = blockIdx.x * 32 + tx;
    const int per = (nb + SEGS - 1) / SEGS;
    const int b0 = min(nb, ty * per), b1 = min(nb, b0 + per);
    int s = 0;
    if (c < N) {
#pragma unroll 4
        for (int b = b0; b < b1; ++b) s += counts[(long long)b * N + c];
    }
    seg_sum[ty][tx] = s;
    __syncthreads();
    if (c >= N) return;
    int run = indptr[c];
    for (int k = 0; k < ty; ++k) run += seg_sum[k][tx];
#pragma unroll 4
    for (int b = b0; b < b1; ++b) {
        const long long i = (long long)b * N + c;
        const int v = counts[i];
        cursor[i] = run;
        run += v;
    }
}
