"""Does device memory freed by a process come back while compute-sanitizer watches it?

Allocates and frees 1 GiB twenty times (through CuPy's pool, released each time) and prints the
GPU's used memory after each round. Run plain and under ``compute-sanitizer --tool memcheck``.
"""
import subprocess

import cupy as cp


def used_mib():
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout
    return int(out.split()[0])


def main():
    pool = cp.get_default_memory_pool()
    seen = []
    for i in range(20):
        a = cp.empty((1 << 30) + i * 4096, dtype=cp.uint8)  # a new size each round: a cudaMalloc
        a.fill(1)
        cp.cuda.Device().synchronize()
        del a
        pool.free_all_blocks()
        seen.append(used_mib())
    print("GPU memory used after each alloc/free round (MiB):", seen)


if __name__ == "__main__":
    main()
