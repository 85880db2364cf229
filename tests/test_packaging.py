"""The wheel ships every CUDA kernel and the benchmark scripts, and works installed.

Builds the wheel from this checkout, installs it with ``--no-deps`` into a
fresh virtual environment that borrows this interpreter's site-packages for
the dependencies (numpy, scipy, ...), and checks from *that* environment,
outside the checkout, that ``twellpy.backends._registry.kernel_dir()`` points
inside the installed package and holds every ``raw_kernels/*.cu`` file and
``common.cuh``, byte for byte.
"""
import json
import os
import subprocess
import sys
import sysconfig
import textwrap
import venv
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
KERNEL_FILES = sorted(p.name for p in (REPO / "raw_kernels").iterdir() if p.suffix in (".cu", ".cuh"))


def _build_wheel(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--wheel-dir", str(dest), str(REPO)]
    try:
        import hatchling  # noqa: F401  (the build backend: build offline when it is installed)

        cmd.insert(4, "--no-build-isolation")
    except ImportError:
        pass
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"pip wheel failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    wheels = list(dest.glob("twellpy-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    return _build_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory):
    """Python of a fresh venv with the wheel installed (and nothing else of twellpy)."""
    root = tmp_path_factory.mktemp("venv")
    env_dir = root / "env"
    venv.EnvBuilder(with_pip=False, symlinks=os.name != "nt").create(env_dir)
    py = env_dir / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    purelib = Path(subprocess.check_output(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip())
    # Borrow the dependencies of the running interpreter. A plain path line
    # (not site.addsitedir) does not run that folder's own .pth files, so an
    # editable install of this checkout cannot leak into the new venv.
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (purelib / "_twellpy_test_deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TWELLPY_KERNEL_DIR")}
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps",
                        "--no-index", str(wheel)], capture_output=True, text=True, env=env, timeout=600)
    if r.returncode != 0 and "no such option: --python" in r.stderr:  # pip < 22.3
        r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index",
                            "--prefix", str(env_dir), str(wheel)], capture_output=True, text=True,
                           env=env, timeout=600)
    assert r.returncode == 0, f"pip install failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return py, env, root


def test_wheel_contains_kernels_and_benchmarks(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in KERNEL_FILES:
        assert f"twellpy/raw_kernels/{f}" in names, f
    for p in sorted((REPO / "benchmarks").glob("*.py")):
        assert f"twellpy/_benchmarks/{p.name}" in names, p.name
    assert "twellpy/__main__.py" in names and "twellpy/cli.py" in names
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert "twellpy = twellpy.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_installed_wheel_finds_every_kernel(installed):
    py, env, root = installed
    probe = textwrap.dedent("""
        import json, twellpy
        from twellpy.backends import _registry
        d = _registry.kernel_dir()
        print(json.dumps({"package": twellpy.__file__, "kernel_dir": str(d),
                          "files": {p.name: p.read_bytes().hex() for p in sorted(d.iterdir())
                                    if p.suffix in (".cu", ".cuh")}}))
    """)
    r = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, env=env, cwd=root, timeout=300)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    site = Path(got["package"]).resolve().parent.parent
    assert REPO not in Path(got["package"]).resolve().parents, f"imported the checkout: {got['package']}"
    assert Path(got["kernel_dir"]).resolve() == site / "twellpy" / "raw_kernels"
    assert sorted(got["files"]) == KERNEL_FILES
    assert "common.cuh" in got["files"]
    for name, hexdata in got["files"].items():
        assert bytes.fromhex(hexdata) == (REPO / "raw_kernels" / name).read_bytes(), name


def test_installed_console_script_runs(installed):
    py, env, root = installed
    script = py.parent / ("twellpy.exe" if os.name == "nt" else "twellpy")
    assert script.exists(), f"console script missing from {py.parent}"
    r = subprocess.run([str(script), "info", "--json"], capture_output=True, text=True, env=env,
                       cwd=root, timeout=300)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["kernels"]["sources"] == [f for f in KERNEL_FILES if f.endswith(".cu")]
    assert Path(report["kernels"]["kernel_dir"]).parent == Path(report["package_dir"])
