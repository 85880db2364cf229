"""The kernel registry and the NVRTC check (CPU-runnable; one GPU test).

These run without a GPU: CuPy imports fine and NVRTC (pip package) compiles
for sm_90a / sm_80 on any machine.
"""
from __future__ import annotations

import importlib.util
import os
import re
import threading
from pathlib import Path

import numpy as np
import pytest

from twellpy._array import bfloat16
from twellpy.backends import _registry as reg

ROOT = Path(__file__).resolve().parent.parent
CONTAINER_FILES = ["check.cu", "construct.cu", "convert.cu", "spmm.cu", "transpose.cu"]


def _check_kernels_module():
    spec = importlib.util.spec_from_file_location("check_kernels", ROOT / "tools" / "check_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def declared():
    """Every declaration, after importing all CUDA backend modules."""
    _check_kernels_module()._import_backends()
    return reg.declared()


def _global_functions(source):
    return set(re.findall(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s*)?(\w+)\s*\(", source))


def test_ctype_names():
    assert reg.ctype(np.float32) == "float"
    assert reg.ctype(np.float64) == "double"
    assert reg.ctype(np.float16) == "__half"
    assert reg.ctype(bfloat16) == "__nv_bfloat16"
    with pytest.raises(TypeError, match="no CUDA type"):
        reg.ctype(np.int8)


def test_every_kernel_file_has_declarations(declared):
    files = sorted(p.name for p in reg.kernel_dir().glob("*.cu"))
    assert set(CONTAINER_FILES) <= set(files)
    missing = [f for f in files if not any(names for names, _ in declared.get(f, ()))]
    assert not missing, f"kernel files without any declared instantiation: {missing}"


@pytest.mark.parametrize("fname", CONTAINER_FILES)
def test_declared_names_exist_and_are_prefixed(declared, fname):
    kernels = _global_functions(reg.read_source(fname))
    assert kernels, f"no __global__ function found in {fname}"
    names = [n for group, _ in declared[fname] for n in group]
    assert names
    for n in names:
        base = n.split("<")[0].strip()
        assert base.startswith("twellpy_"), n
        assert base in kernels, f"{n} is declared but {fname} defines only {sorted(kernels)}"
    # every kernel of the file is instantiated at least once
    assert {n.split("<")[0].strip() for n in names} == kernels


def test_container_dtypes_declared_for_every_value_type(declared):
    names = [n for group, _ in declared["spmm.cu"] for n in group]
    for ct in ("float", "double", "__half", "__nv_bfloat16"):
        assert any(f"twellpy_twell_spmm<{ct}," in n for n in names), ct
    casts = [n for group, _ in declared["convert.cu"] for n in group if n.startswith("twellpy_cast")]
    assert len(casts) == 12  # every ordered pair of distinct value types


def _define_default(fname, macro):
    m = re.search(rf"#ifndef {macro}\s*\n#define {macro} (\d+)", reg.read_source(fname))
    assert m, f"{macro} is not a #ifndef tunable in {fname}"
    return int(m.group(1))


def test_launch_sizes_within_launch_bounds():
    from twellpy.backends import cuda

    assert cuda.CONSTRUCT_WARPS <= _define_default("construct.cu", "CONSTRUCT_WARPS")
    assert cuda.CONVERT_WARPS <= _define_default("convert.cu", "CONVERT_WARPS")
    assert cuda.ELEMENTWISE_BLOCK <= _define_default("convert.cu", "CONVERT_BLOCK")
    assert cuda.ELEMENTWISE_BLOCK <= _define_default("transpose.cu", "TRANSPOSE_BLOCK")
    assert cuda.SPMM_WARPS <= _define_default("spmm.cu", "SPMM_WARPS")
    assert cuda.SPMM_MAX_ITERS in (1, 2, 4, 8)
    assert cuda._CHECK_BLOCK <= _define_default("check.cu", "CHECK_BLOCK")


def test_spmm_rows_threads_reach_kernel_and_launch_from_one_define_set(declared, monkeypatch):
    """The row-block SpMM's block size is compiled in (SPMM_ROWS_THREADS) from the
    same define set the launch reads, declarations included."""
    from twellpy.backends import cuda

    defs = cuda._spmm_rows_defines()
    assert defs == {"SPMM_ROWS_THREADS": cuda.SPMM_ROWS_THREADS}
    rows = [d for names, d in declared["spmm.cu"] if any("twell_spmm_rows" in n for n in names)]
    assert rows and all(d == defs for d in rows)
    assert all(not any("twell_spmm_rows" in n for n in names)
               for names, d in declared["spmm.cu"] if d != defs)
    # the standalone default of spmm.cu agrees too
    assert _define_default("spmm.cu", "SPMM_ROWS_THREADS") == cuda.SPMM_ROWS_THREADS
    assert cuda._spmm_rows_plan(4096, np.float32)[3] == cuda.SPMM_ROWS_THREADS
    monkeypatch.setattr(cuda, "SPMM_DEFINES", {"SPMM_ROWS_THREADS": 256})
    assert cuda._spmm_rows_defines()["SPMM_ROWS_THREADS"] == 256
    assert cuda._spmm_rows_plan(4096, np.float32)[3] == 256


def test_ffn_min_blocks_always_passed(declared):
    """Every ffn_sparse.cu compile names FFN_MIN_BLOCKS; declarations use the
    budget run time picks for their NV (1 for NV = 8)."""
    from twellpy.backends import cuda_ffn

    assert _define_default("ffn_sparse.cu", "FFN_MIN_BLOCKS") == cuda_ffn.DEFAULT_MIN_BLOCKS
    groups = declared["ffn_sparse.cu"]
    assert groups and all("FFN_MIN_BLOCKS" in d for _, d in groups)
    nv8 = [d["FFN_MIN_BLOCKS"] for names, d in groups for n in names if n.split(",")[1].strip() == "8"]
    assert nv8 and all(mb == cuda_ffn._default_min_blocks(8) == 1 for mb in nv8)
    for mb in (1, 2, 3):
        assert cuda_ffn._sparse_defines(min_blocks=mb) == {"FFN_MIN_BLOCKS": mb}
    assert cuda_ffn._sparse_defines(True, 2) == {"FFN_L2_EVICT_LAST": 1, "FFN_MIN_BLOCKS": 2}


def test_ffn_declarations_use_the_run_time_defines(declared):
    """A warm-up compile of the declarations must be the module run time loads:
    every declared define set is one _sparse_defines produces (no per-group
    extras that would make the run-time lookup a different compile)."""
    from twellpy.backends import cuda_ffn

    for names, d in declared["ffn_sparse.cu"]:
        assert d == cuda_ffn._sparse_defines("FFN_L2_EVICT_LAST" in d, d["FFN_MIN_BLOCKS"]), (names, d)


@pytest.mark.parametrize("fname", CONTAINER_FILES)
def test_kernel_files_only_include_cuda_headers_and_common(fname):
    includes = re.findall(r'#include\s*[<"]([^>"]+)[>"]', reg.read_source(fname))
    assert includes == ["common.cuh"], includes


def test_every_kernel_has_a_header_comment():
    """Each __global__ is preceded by a comment naming it and its arrays' shapes."""
    for fname in CONTAINER_FILES:
        src = reg.read_source(fname)
        for name in _global_functions(src):
            head = src[:src.index(f"{name}(")]
            start = head.rfind(f"// {name}")
            assert start >= 0, f"{fname}: {name} lacks a header comment"
            comment = "\n".join(ln for ln in head[start:].splitlines() if ln.startswith("//"))
            assert re.search(r"\((\w+|\d)[\w+*, ]*\)\s+(T|U|int32|int64|uint64|S|D)\b", comment), \
                f"{fname}: the comment of {name} lists no array shapes"


def test_module_source_changes_with_the_headers(tmp_path, monkeypatch):
    """CuPy's disk cache keys on the source text, not on included files: the source
    handed to NVRTC carries the headers' digest, so a changed common.cuh recompiles."""
    for p in reg.kernel_dir().iterdir():
        if p.suffix in (".cu", ".cuh"):
            (tmp_path / p.name).write_bytes(p.read_bytes())
    monkeypatch.setenv("TWELLPY_KERNEL_DIR", str(tmp_path))
    before = reg.module_source("check.cu")
    assert before.startswith(reg.read_source("check.cu"))
    assert before != reg.read_source("check.cu")
    reg._headers_digest.cache_clear()
    assert reg.module_source("check.cu") == before  # same headers, same text, same cache entry
    common = tmp_path / "common.cuh"
    common.write_text(common.read_text() + "\n// one more line\n")
    reg._headers_digest.cache_clear()
    after = reg.module_source("check.cu")
    assert after != before and after.startswith(reg.read_source("check.cu"))
    reg._headers_digest.cache_clear()


def test_get_kernel_compiles_the_source_with_the_headers_digest(monkeypatch):
    """The registry hands NVRTC module_source (with the digest), on sm_90 with sm_90a."""
    seen = []

    class FakeModule:
        def __init__(self, code, options, name_expressions):
            seen.append((code, options, name_expressions))

        def compile(self):
            pass

        def get_function(self, name):
            return ("kernel", name)

    class FakeDevice:
        id = 0
        compute_capability = "90"

        def __init__(self, dev=None):
            pass

    class FakeCupy:
        RawModule = FakeModule

        class cuda:
            Device = FakeDevice

    monkeypatch.setattr(reg, "cupy_module", lambda: FakeCupy)
    monkeypatch.setattr(reg, "_CACHE", {})
    k = reg.get_kernel("check.cu", "twellpy_fake_name", FAKE_DEFINE=3)
    assert k == ("kernel", "twellpy_fake_name")
    assert len(seen) == 1
    code, options, names = seen[0]
    assert code == reg.module_source("check.cu") and names == ("twellpy_fake_name",)
    assert "-DFAKE_DEFINE=3" in options and options[-1] == "-arch=sm_90a"
    assert reg.get_kernel("check.cu", "twellpy_fake_name", FAKE_DEFINE=3) is k  # memoized
    assert len(seen) == 1


@pytest.mark.parametrize("fname", ["check.cu", "convert.cu", "transpose.cu"])
def test_small_files_compile_and_every_name_resolves(declared, fname):
    """Fast NVRTC check (sm_80) that every declared name expression lowers to a symbol."""
    from cupy_backends.cuda.libs import nvrtc

    ck = _check_kernels_module()
    names = [n for group, defs in declared[fname] if not defs for n in group]
    opts = list(reg.nvrtc_options({}, arch="80")) + [f"-I{d}" for d in ck._cuda_include_dirs()]
    prog = nvrtc.createProgram(reg.read_source(fname), fname, (), ())
    for n in names:
        nvrtc.addNameExpression(prog, n)
    nvrtc.compileProgram(prog, opts)
    lowered = {n: nvrtc.getLoweredName(prog, n) for n in names}
    assert all(v.startswith("_Z") for v in lowered.values()), lowered


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TWELLPY_CI_COMPILES_KERNELS") == "1",
                    reason="CI compiles every kernel for sm_90a, sm_80 and sm_75 in its own stage (.ci/run)")
def test_check_kernels_main_returns_zero():
    """Every declared kernel of every file compiles for sm_90a and sm_80 (about 2-3 minutes)."""
    assert _check_kernels_module().main(["--arch", "90a", "80"]) == 0


@pytest.mark.gpu
def test_get_kernel_is_thread_safe_and_memoized():
    import cupy as cp

    # A define set nobody else uses forces a fresh compile inside the race.
    defines = {"TRANSPOSE_BLOCK": 128}
    start = threading.Barrier(12)
    got, errors = [], []

    def worker():
        try:
            start.wait()
            got.append(reg.get_kernel("transpose.cu", "twellpy_transpose_count", **defines))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(got) == 12 and all(k is got[0] for k in got)
    assert reg.get_kernel("transpose.cu", "twellpy_transpose_count", **defines) is got[0]
    # and the kernel runs: histogram of columns [0, 1, 1, -1] in one chunk
    idx = cp.asarray(np.array([[0, 1], [1, -1]], np.int32))
    counts = cp.zeros((1, 3), np.int32)
    got[0]((1,), (128,), (idx, counts, np.int64(2), np.int32(2), np.int32(3), np.int32(2)))
    assert cp.asnumpy(counts).tolist() == [[1, 2, 0]]


def test_training_row_loop_constants_and_setting():
    """The launcher's TW_XREG copy decides when vec = 2 may run (the row must fit the
    lane's vectors), so it must equal the kernel's default; TWELLPY_TRAIN_ROWS parses to
    off, the defaults, or a define set of the known tunables, and names the bad ones."""
    from twellpy.backends import cuda_train as ct

    assert ct.ROW_XREG == _define_default("train_ffn.cu", "TW_XREG")
    # the by-neuron launcher sizes blocks up to DH_THREADS: the kernel's launch bound
    assert ct.DH_THREADS == _define_default("train_ffn.cu", "TW_DH_THREADS")
    assert ct._by_neuron_nv(8 * 512, 2) == 1 and ct._by_neuron_nv(8 * 513, 2) == 2
    assert ct._by_neuron_nv(8 * 1024, 2) == 2 and ct._by_neuron_nv(8 * 1025, 2) is None
    for macro in ct._ROW_TUNABLES:
        _define_default("train_ffn.cu", macro)  # each is a #ifndef tunable of the file
    assert ct._rows_setting("0") is None
    assert ct._rows_setting("1") == {}
    assert ct._rows_setting("TW_SLOT_BATCH=1, TW_XSRC_SMEM=1") == {"TW_SLOT_BATCH": 1, "TW_XSRC_SMEM": 1}
    for bad in ("2", "TW_XREG=4", "TW_SLOT_BATCH=x", ""):
        with pytest.raises(ValueError, match="TWELLPY_TRAIN_ROWS"):
            ct._rows_setting(bad)
    saved = ct.ROWS
    try:
        ct.ROWS = {}
        assert ct._row_vec(1, 2048, 2) == 2 and ct._row_vec(1, 2056, 2) == 1 and ct._row_vec(0, 64, 2) == 0
        assert ct._row_vec(1, 1024, 4) == 2 and ct._row_vec(1, 1028, 4) == 1
        ct.ROWS = None
        assert ct._row_vec(1, 2048, 2) == 1
    finally:
        ct.ROWS = saved
