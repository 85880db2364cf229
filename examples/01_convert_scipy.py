"""01 -- Convert a scipy.sparse matrix to ELL, TwELL and Hybrid, and back, exactly.

What it shows
* ``from_scipy`` accepts any scipy.sparse array or matrix: duplicates are
  summed and explicit zeros dropped, so the matrix is unchanged;
* a TwELL tile holding more non-zeros than ``slots`` never loses data: the
  row goes to a dense backup row (default), or ``overflow="raise"`` raises
  ``TileOverflowError`` naming a sufficient ``slots``;
* conversions between formats, storage sizes, ``save``/``load``;
* moving a container to the GPU and to cupyx, when a GPU is present.

Run: ``python examples/01_convert_scipy.py [--small] [--device cpu|cuda]``
"""
import argparse
import os
import tempfile

import numpy as np
import scipy.sparse as sp

import twellpy as tw
from twellpy import gpu_available


def make_matrix(m, n, density, seed):
    """A CSR with unsorted columns, duplicate entries, explicit zeros and one
    dense ("hot") row -- everything a converter can get wrong."""
    rng = np.random.default_rng(seed)
    base = sp.random_array((m, n), density=density, format="coo", rng=rng, dtype=np.float32)
    rows, cols, vals = [base.row], [base.col], [base.data]
    k = max(1, base.nnz // 50)  # duplicates: scipy sums them
    pick = rng.integers(0, base.nnz, size=k)
    rows.append(base.row[pick]), cols.append(base.col[pick]), vals.append(np.ones(k, np.float32))
    rows.append(np.array([0, 1])), cols.append(np.array([0, 1])), vals.append(np.zeros(2, np.float32))
    hot = m // 2  # a row with half of its columns set
    hot_cols = rng.choice(n, size=n // 2, replace=False)
    rows.append(np.full(hot_cols.size, hot)), cols.append(hot_cols)
    vals.append(rng.standard_normal(hot_cols.size).astype(np.float32))
    rows, cols, vals = np.concatenate(rows), np.concatenate(cols), np.concatenate(vals)
    # Build the CSR arrays by hand: scipy's own conversions would sum the
    # duplicates and sort the columns, and we want them left in.
    order = np.argsort(rows, kind="stable")
    indptr = np.zeros(m + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=m), out=indptr[1:])
    return sp.csr_matrix((vals[order], cols[order].astype(np.int32), indptr), shape=(m, n))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny sizes (what the tests run)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="where to try the GPU part (auto: when a GPU is present)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not gpu_available():
        raise SystemExit("--device cuda: no usable CUDA GPU")
    m, n, density = (300, 700, 0.02) if args.small else (20000, 5632, 0.005)

    csr = make_matrix(m, n, density, seed=0)
    # The truth: duplicates summed as scipy's sum_duplicates sums them (which
    # from_scipy uses), zeros are zeros. Not csr.toarray(): it adds the
    # duplicates of an entry in another order, and a float32 sum of three or
    # more terms can then differ in the last bit.
    canonical = csr.copy()
    canonical.sum_duplicates()
    dense = canonical.toarray()
    true_nnz = int(np.count_nonzero(dense))
    print(f"scipy input: {csr.shape} {csr.dtype}, {csr.nnz} stored entries "
          f"(duplicates: {not csr.has_canonical_format}), {true_nnz} true non-zeros")

    containers = {
        "ell": tw.ELL.from_scipy(csr),
        "twell": tw.TwELL.from_scipy(csr, tile=256, slots=32),
        "hybrid": tw.Hybrid.from_scipy(csr, width="auto"),
    }
    csr_bytes = csr.data.nbytes + csr.indices.nbytes + csr.indptr.nbytes
    print(f"{'format':8s} {'nnz':>9s} {'bytes':>12s}  repr")
    print(f"{'csr':8s} {csr.nnz:9d} {csr_bytes:12d}  (scipy input)")
    for name, A in containers.items():
        assert A.nnz == true_nnz, (name, A.nnz, true_nnz)
        assert np.array_equal(A.toarray(), dense), name
        back = A.to_scipy("csr")
        assert (back != sp.csr_array(dense)).nnz == 0, name
        print(f"{name:8s} {A.nnz:9d} {A.nbytes:12d}  {A!r}")
    print(f"the hot row {m // 2} is kept exactly in TwELL's dense backup rows: "
          f"{containers['twell'].n_backup} backup row(s)")

    # Every format converts to every other, exactly.
    for src in containers.values():
        for fmt in containers:
            assert np.array_equal(src.asformat(fmt).toarray(), dense), (src.format, fmt)
    print("all format -> format conversions are exact")

    # overflow="raise" refuses instead of using backup rows, and says what would fit.
    try:
        tw.TwELL.from_scipy(csr, tile=256, slots=32, overflow="raise")
        raise AssertionError("expected TileOverflowError")
    except tw.TileOverflowError as e:
        print(f"overflow='raise': {e}")

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "h.npz")
        tw.save(path, containers["twell"])
        again = tw.load(path)
        assert np.array_equal(again.toarray(), dense) and again.slots == 32
        print(f"saved and loaded {path!r}: {os.path.getsize(path)} bytes, identical")

    if args.device != "cpu" and gpu_available():
        G = containers["twell"].to_device("cuda")
        cx = G.to_cupyx("csr")
        assert np.array_equal(G.to_device("cpu").toarray(), dense)
        print(f"on the GPU: {G!r}; as cupyx: {type(cx).__name__} with {cx.nnz} entries")
    else:
        print("CPU only: skipped to_device('cuda') / to_cupyx")
    print("01 OK")


if __name__ == "__main__":
    main()
