# Sourced by the device scripts: Dask's GPU tests and benchmarks need the wheels from
# benchmarks/fetch_dask_wheels.sh (carry=[".whl"]), because the device has no package index.
# Sets PYTHONPATH to the source tree, with the installed wheels in front when there are any.
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy_cache}
# A fresh machine compiles every kernel again (about a minute, several under a sanitizer).
# `device_suite.sh warm` returns CuPy's cache as $OUT/cupy_cache.tgz; unpacked here as
# .cupy_cache/ (git-ignored) and passed with carry=[".cupy_cache"], it seeds the cache.
if [[ -d .cupy_cache && ! -e $CUPY_CACHE_DIR ]]; then
  mkdir -p "$CUPY_CACHE_DIR" && cp -r .cupy_cache/. "$CUPY_CACHE_DIR/"
fi
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:. || echo "Dask wheels did not install"
fi
# Bytecode: every pytest process (each xdist worker) imports torch, JAX, Dask, CuPy and the
# 40 test modules. Where PYTHONDONTWRITEBYTECODE is set, or the fresh copy of the tree has no
# __pycache__, each compiles them from source again and pytest re-rewrites every test
# module's asserts: on the CPU machine a bare collection of the GPU suite took 17 s cold and
# 6 s with the bytecode cached (90 s, 50 s of it in compile(), while the machine was busy).
# That is only part of the ~200 s a memcheck pass spent before its first test (2026-12-05;
# run_times.py's phases now split the rest), but it is paid by every worker. One cache
# directory that every process writes and reads; warm_bytecode fills it with one
# collection before a many-worker pass.
echo "python bytecode: PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE:-unset} PYTHONPYCACHEPREFIX=${PYTHONPYCACHEPREFIX:-unset} (now: cache in ${TWELLPY_PYCACHE:-/tmp/twellpy_pycache})"
unset PYTHONDONTWRITEBYTECODE
export PYTHONPYCACHEPREFIX=${TWELLPY_PYCACHE:-/tmp/twellpy_pycache}
warm_bytecode() {  # warm_bytecode [pytest arguments]: one collection, timed
  local t0=$SECONDS
  python -m pytest --collect-only -q -p no:cacheprovider "$@" > /dev/null 2>&1
  echo "bytecode warm-up (one collection of $*): $((SECONDS - t0)) s"
}
# Work stealing (pytest-xdist >= 3.2): a worker busy in one slow test no longer holds the tests
# queued behind it; idle workers take them (the suite went from 172-181 s to 119 s).
XDIST_DIST=$(python -c "import xdist; print('--dist worksteal' if tuple(map(int, xdist.__version__.split('.')[:2])) >= (3, 2) else '')" 2>/dev/null)
# gpu_memory_log FILE: per-process GPU memory every 0.5 s in the background (stop: kill $!), to
# tell which process held the memory when a test fails to allocate
gpu_memory_log() {
  nvidia-smi --query-compute-apps=timestamp,pid,used_memory --format=csv,noheader -lms 500 > "$1" 2>&1 &
}
