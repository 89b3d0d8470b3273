#!/usr/bin/env bash
# One device-machine session: the GPU test-suite, then every benchmark, results under $OUT.
# Usage on the device (from the repo root):  bash benchmarks/gpu_session.sh [bench names...]
#   e.g. `bash benchmarks/gpu_session.sh quantize scaled_mm:250`; no names runs every benchmarks/bench_*.py.
#   NAME:SECONDS bounds one benchmark's time (so that a call fits the device's 10-minute limit);
#   SKIP_TESTS=1 skips the tests, TEST_TIMEOUT_S bounds them (default 300).
set -u
. "$(dirname "$0")/_gpu_env.sh"
status=0
if [ "${SKIP_TESTS:-0}" != "1" ]; then
  timeout "${TEST_TIMEOUT_S:-300}" python3 -m pytest -m gpu tests/gpu tests/kernels $XDIST_ARGS ${GPU_TEST_ARGS:-} \
    -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
  status=${PIPESTATUS[0]}
fi
names=("$@")
if [ ${#names[@]} -eq 0 ]; then
  for f in benchmarks/bench_*.py; do names+=("$(basename "$f" .py | sed 's/^bench_//')"); done
fi
for spec in "${names[@]}"; do
  name="${spec%%:*}"
  limit=600
  [ "$spec" != "$name" ] && limit="${spec#*:}"
  echo "=== bench_$name (limit ${limit} s)"
  timeout "$limit" python3 "benchmarks/bench_$name.py" 2>&1 | tail -60
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
done
exit $status
