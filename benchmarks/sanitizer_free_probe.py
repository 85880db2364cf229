"""Does device memory freed by a process come back while compute-sanitizer watches it?

Two rounds of alloc/free, each printing the GPU's used memory after every step. Run plain and
under ``compute-sanitizer --tool memcheck``:

* ``own frame``: 1 GiB made and filled in this function, deleted, CuPy's pool released. Memory
  came back under memcheck (session 22, H100: flat at 763 MiB).
* ``cp.full``: 512 MiB from ``cp.full`` (a Python function of CuPy whose local variable holds
  the array while it launches the fill kernel), deleted, with CuPy's pool off (the test suite's
  allocator under ``TWELLPY_SANITIZE=1``). Under memcheck each round kept its 512 MiB, with
  and without a device synchronisation (session 23, H100: 761 -> 3835 -> 6907 MiB).

The difference is consistent with memcheck keeping a reference to the Python frames that were
live at each CUDA call (for its host backtraces), so the locals of those frames outlive the
call. ``test_dropping_an_ffn_waits_for_its_last_call_on_another_stream`` fails under memcheck
for the same reason: the FFN plan stays referenced from frames of its own calls, which
nothing in Python refers to (``gc.get_referrers``), and its ``__del__`` never runs.
"""
import subprocess

import cupy as cp


def used_mib():
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout
    return int(out.split()[0])


def own_frame_rounds(n=20):
    pool = cp.get_default_memory_pool()
    seen = []
    for i in range(n):
        a = cp.empty((1 << 30) + i * 4096, dtype=cp.uint8)  # a new size each round: a cudaMalloc
        a.fill(1)
        cp.cuda.Device().synchronize()
        del a
        pool.free_all_blocks()
        seen.append(used_mib())
    return seen


def cupy_full_rounds(n=6, sync=False):
    seen = []
    for _ in range(n):
        a = cp.full((1 << 29,), 0xFF, dtype=cp.uint8)
        if sync:
            cp.cuda.get_current_stream().synchronize()
        del a
        seen.append(used_mib())
    return seen


def main():
    print("own frame, 1 GiB rounds (MiB used after each):", own_frame_rounds(), flush=True)
    previous = cp.cuda.get_allocator()
    cp.cuda.set_allocator(None)  # plain cudaMalloc/cudaFree, as the suite under TWELLPY_SANITIZE=1
    try:
        for sync in (False, True):
            print(f"cp.full, 512 MiB rounds, sync={sync} (MiB used after each):", cupy_full_rounds(sync=sync),
                  flush=True)
    finally:
        cp.cuda.set_allocator(previous)


if __name__ == "__main__":
    main()
