#!/usr/bin/env bash
# One device-machine session: the GPU test-suite, then every benchmark, results under $OUT.
# Usage on the device (from the repo root):  bash benchmarks/gpu_session.sh [bench names...]
#   e.g. `bash benchmarks/gpu_session.sh quantize scaled_mm`; no names runs every benchmarks/bench_*.py.
set -u
. "$(dirname "$0")/_gpu_env.sh"
status=0
if [ "${SKIP_TESTS:-0}" != "1" ]; then
  python3 -m pytest -m gpu tests/gpu ${GPU_TEST_ARGS:-} -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
  status=${PIPESTATUS[0]}
fi
names=("$@")
if [ ${#names[@]} -eq 0 ]; then
  for f in benchmarks/bench_*.py; do names+=("$(basename "$f" .py | sed 's/^bench_//')"); done
fi
for name in "${names[@]}"; do
  echo "=== bench_$name"
  python3 "benchmarks/bench_$name.py" 2>&1 | tail -60 || status=1
done
exit $status
