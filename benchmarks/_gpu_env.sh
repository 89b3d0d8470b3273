# Sourced by the device-session scripts: import paths, unbuffered output, the results folder, versions.
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/benchmarks/results}"
export OUT
mkdir -p "$OUT"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name(0))'
