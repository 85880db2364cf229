#!/usr/bin/env bash
# Download the Dask wheels the device image lacks into .whl/ (for device runs with carry=[".whl"]).
# The image (Python 3.12) already has click, cloudpickle, fsspec, jinja2, msgpack, packaging,
# psutil, pyyaml, sortedcontainers, toolz, pandas, numba, nvidia-ml-py (pynvml) and cuda-core.
# dask/distributed are pinned to what dask-cuda 26.10 requires (rapids-dask-dependency 26.10:
# dask==2026.7.1); rapids-dask-dependency itself and bokeh are not needed (no dashboard).
# Usage (repo root, on the development machine):  bash benchmarks/fetch_dask_wheels.sh
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
PY=${PYTHON:-python3}
"$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl \
  dask==2026.7.1 distributed==2026.7.1 dask-cuda==26.10.0 \
  tornado==6.6.1 tblib==3.2.2 zict==3.0.0 partd==1.4.2 locket==1.0.0
ls -la .whl
du -sh .whl
