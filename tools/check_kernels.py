"""Compile every declared CUDA kernel with NVRTC, without a GPU.

Run by CI (``.ci/run``). For each ``raw_kernels/*.cu`` file it compiles every
instantiation declared through ``twellpy.backends._registry.declare`` (files
with no declaration are compiled bare, which still catches syntax errors) for
sm_90a, sm_80 and sm_75 (Turing, where the sm_80+ load paths switch off),
with the same options the run-time registry uses. Any compile error makes the
script exit 1; register spills are reported.

Usage: ``python tools/check_kernels.py [--arch 90a 80 75] [--strict-spills] [--files ffn_long.cu ...]``
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import re
import sys
from pathlib import Path


def _cuda_include_dirs():
    dirs = []
    try:
        import nvidia.cu13  # noqa: F401  (nvidia-cuda-runtime >= 13 layout)
        for p in nvidia.cu13.__path__:
            inc = Path(p) / "include"
            if inc.is_dir():
                dirs.append(str(inc))
    except Exception:
        pass
    try:
        import nvidia.cuda_runtime as rt  # older layout
        for p in rt.__path__:
            inc = Path(p) / "include"
            if inc.is_dir():
                dirs.append(str(inc))
    except Exception:
        pass
    for cand in ("/usr/local/cuda/include",):
        if Path(cand, "cuda_fp16.h").exists():
            dirs.append(cand)
    return dirs


def _import_backends():
    """Import every twellpy.backends.cuda* module so their declare() calls run."""
    import twellpy.backends as pkg

    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name.startswith("cuda"):
            importlib.import_module(f"twellpy.backends.{info.name}")


_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '([^']+)'")


def compile_one(nvrtc, source, filename, names, options):
    prog = nvrtc.createProgram(source, filename, (), ())
    for n in names:
        nvrtc.addNameExpression(prog, n)
    ok = True
    try:
        nvrtc.compileProgram(prog, list(options) + ["--ptxas-options=-v"])
    except Exception:
        ok = False
    log = nvrtc.getProgramLog(prog)
    spills = []
    entry = None
    for line in log.splitlines():
        m = _ENTRY.search(line)
        if m:
            entry = m.group(1)
        m = _SPILL.search(line)
        if m and (int(m.group(1)) or int(m.group(2))):
            spills.append((entry, int(m.group(1)), int(m.group(2))))
    return ok, log, spills


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", nargs="+", default=["90a", "80", "75"])
    ap.add_argument("--strict-spills", action="store_true", help="fail on any register spill")
    ap.add_argument("--files", nargs="+", help="only these raw_kernels/ files (e.g. ffn_long.cu)")
    args = ap.parse_args(argv)

    from cupy_backends.cuda.libs import nvrtc

    # Runnable as ``python tools/check_kernels.py`` from a checkout (no PYTHONPATH needed).
    repo_root = str(Path(__file__).resolve().parent.parent)
    if repo_root not in sys.path:
        sys.path.insert(0, repo_root)
    from twellpy.backends import _registry as reg

    _import_backends()
    decl = reg.declared()
    includes = tuple(f"-I{d}" for d in _cuda_include_dirs())
    files = sorted(p.name for p in reg.kernel_dir().glob("*.cu"))
    if args.files:
        unknown = sorted(set(args.files) - set(files))
        if unknown:
            ap.error(f"no such kernel file in {reg.kernel_dir()}: {', '.join(unknown)}")
        files = [f for f in files if f in args.files]
    n_fail = n_ok = 0
    all_spills = []
    print(f"NVRTC {nvrtc.getVersion()}; {len(files)} source files; arch {args.arch}")
    for fname in files:
        src = reg.module_source(fname)  # what get_kernel hands NVRTC
        groups = decl.get(fname) or [((), {})]
        for names, defines in groups:
            for arch in args.arch:
                opts = reg.nvrtc_options(defines, arch=arch) + includes
                ok, log, spills = compile_one(nvrtc, src, fname, names, opts)
                tag = f"{fname} sm_{arch} {defines or ''} [{len(names)} kernels]"
                if ok:
                    n_ok += 1
                    print(f"  ok    {tag}")
                else:
                    n_fail += 1
                    print(f"  FAIL  {tag}\n{log}")
                for s in spills:
                    all_spills.append((fname, arch) + s)
    for fname, arch, entry, st, ld in all_spills:
        print(f"  SPILL {fname} sm_{arch} {entry}: {st} bytes stores, {ld} bytes loads")
    print(f"compiled {n_ok} ok, {n_fail} failed, {len(all_spills)} spilling kernels")
    if n_fail or (args.strict_spills and all_spills):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
