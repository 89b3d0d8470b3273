# Sourced by the device-session scripts: import paths, unbuffered output, the results folder, versions.
# Wheels carried in .whl (pytest-xdist, execnet: see README's device notes) are installed to /tmp/site so
# the GPU tests can compile their kernels in parallel worker processes (PYTEST_WORKERS, default 8).
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/benchmarks/results}"
export OUT
mkdir -p "$OUT"
# pytest arguments that spread the GPU tests over worker processes when xdist is importable
XDIST_ARGS=""
if python3 -c 'import xdist' 2>/dev/null; then XDIST_ARGS="-n ${PYTEST_WORKERS:-8}"; fi
export XDIST_ARGS
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(0))'
