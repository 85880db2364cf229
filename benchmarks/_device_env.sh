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
# Work stealing (pytest-xdist >= 3.2): a worker busy in one slow test no longer holds the tests
# queued behind it; idle workers take them (the suite went from 172-181 s to 119 s).
XDIST_DIST=$(python -c "import xdist; print('--dist worksteal' if tuple(map(int, xdist.__version__.split('.')[:2])) >= (3, 2) else '')" 2>/dev/null)
# gpu_memory_log FILE: per-process GPU memory every 0.5 s in the background (stop: kill $!), to
# tell which process held the memory when a test fails to allocate
gpu_memory_log() {
  nvidia-smi --query-compute-apps=timestamp,pid,used_memory --format=csv,noheader -lms 500 > "$1" 2>&1 &
}
