# Sourced by the device scripts: Dask's GPU tests and benchmarks need the wheels from
# benchmarks/fetch_dask_wheels.sh (carry=[".whl"]), because the device has no package index.
# Sets PYTHONPATH to the source tree, with the installed wheels in front when there are any.
export PYTHONPATH=. PYTHONUNBUFFERED=1 CUPY_CACHE_DIR=${CUPY_CACHE_DIR:-/tmp/cupy_cache}
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:. || echo "Dask wheels did not install"
fi
