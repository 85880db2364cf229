// transpose.cu -- slot lists (M, K) -> CSR of the transpose (n_cols, M).
//
// Deterministic counting sort in three steps (the launcher does step 2 with
// cupy):
//   1. twellpy_transpose_count: per row chunk c and column j, how many entries
//      of the chunk's rows have column j -> chunk_counts (n_chunks, n_cols).
//      Integer atomics: the totals do not depend on the order.
//   2. indptr = exclusive prefix sum of the column totals; the cursor of
//      (chunk c, column j) = indptr[j] + entries of column j in chunks < c.
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
