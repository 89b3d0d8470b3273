#!/usr/bin/env bash
# The tuning pass on a device machine, in calls that each fit the 10-minute limit of one device command.
# Usage (repo root):  bash benchmarks/gpu_tune_session.sh 1|2
#   1: GPU tests of the kernels whose variants and tables changed without a GPU (encoder smoothing and
#      reciprocal epilogues, weight-only chunks/inplace/gemv, blockwise variants, silu), then the
#      weight-only sweep (TUNE_BUDGET_S 250) and the SiLU-quant table sweep (110 s).
#   2: the blockwise FP8 sweep (180 s), the encoder profile + GEMM/attention sweep (180 s) and the decode
#      (M <= 16) rowwise scaled-mm sweep (120 s).
# Each call stays under 600 s (budgets plus start-up). Results (JSON + logs) go to $OUT (default
# benchmarks/results). Afterwards move the winners into the tables (kernels/weight_only.py _DISPATCH,
# scaled_mm.py CONFIGS / BLOCKWISE_CONFIGS, encoder.py ENCODER_CONFIGS, silu_quant.py SILU_QUANT_CONFIGS)
# and run benchmarks/gpu_session.sh for the acceptance numbers.
set -u
. "$(dirname "$0")/_gpu_env.sh"
status=0
case "${1:-1}" in
  1)
    timeout 140 python3 -m pytest -m gpu -q -p no:cacheprovider -x $XDIST_ARGS \
      tests/gpu/test_encoder_gpu.py tests/kernels/test_weight_only_variants.py \
      tests/kernels/test_scaled_mm_blockwise_variants.py 2>&1 | tee "$OUT/gpu_tune_tests.log" | tail -15
    status=${PIPESTATUS[0]}
    TUNE_BUDGET_S=${TUNE_BUDGET_S:-250} timeout 300 python3 benchmarks/tune_weight_only.py 2>&1 | tail -60 || status=1
    TUNE_BUDGET_S=110 timeout 140 python3 benchmarks/tune_silu_quant.py 2>&1 | tail -12 || status=1
    ;;
  2)
    TUNE_BUDGET_S=180 timeout 215 python3 benchmarks/tune_scaled_mm.py 2>&1 | tail -30 || status=1
    TUNE_BUDGET_S=180 timeout 220 python3 benchmarks/tune_encoder.py 2>&1 | tail -70 || status=1
    TUNE_BUDGET_S=120 timeout 150 python3 benchmarks/tune_scaled_mm_decode.py 2>&1 | tail -20 || status=1
    ;;
  *) echo "usage: $0 1|2" >&2; exit 2 ;;
esac
exit $status
