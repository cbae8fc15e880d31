#!/usr/bin/env bash
# Everything kvgen checks and measures on the GPU machine, in two batches (one device call each):
#
#   bash scripts/device_check.sh tests   # gpu-marked tests (codec, compaction, packer, scorer,
#                                        # device NVFP4 arithmetic), compute-sanitizer, wheel proof
#   bash scripts/device_check.sh bench   # codec, compaction and scorer benchmarks with ceilings
#
# Needs, carried from the build machine: build/registry (kvgen build --arch sm_90a), dist/ (kvgen
# wheel --arch sm_90a) and .whl/ (pydantic wheels; the GPU image has no pydantic). Writes logs and
# JSON under $OUT (results/ when unset). Never fails fast: every step runs and reports.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ! python3 -c "import pydantic" >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/kvgen_site .whl/*.whl
  export PYTHONPATH="/tmp/kvgen_site:$PWD"
else
  export PYTHONPATH="$PWD"
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

run_tests() {
  timeout 420 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu tests/test_nvfp4_block.py \
    --junitxml "$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|FAILED|Error" | tail -25
  # One family per hot dtype through compute-sanitizer (memcheck), plus one compaction family.
  timeout 240 compute-sanitizer --tool memcheck --print-limit 5 python3 -m pytest -q -p no:cacheprovider \
    tests/gpu/test_codec_gpu.py -k "device-host-40 and (qwen3-8b- or mistral-7b or qwen3-8b-fp8)" \
    2>&1 | tee "$OUT/sanitizer.log" | tail -3
  timeout 240 compute-sanitizer --tool memcheck --print-limit 5 python3 -m pytest -q -p no:cacheprovider \
    tests/gpu/test_compact_gpu.py -k "qwen3-8b and not graph" 2>&1 | tee -a "$OUT/sanitizer.log" | tail -3
  timeout 180 bash scripts/wheel_proof.sh 2>&1 | tail -3
}

run_bench() {
  timeout 200 python3 benchmarks/bench_codec.py 2>&1 | grep -v "^W" | tee "$OUT/bench.log" | tail -5
  timeout 150 python3 benchmarks/bench_compact.py 2>&1 | tee -a "$OUT/bench.log" | tail -5
  timeout 150 python3 benchmarks/bench_score.py 2>&1 | tee -a "$OUT/bench.log" | tail -5
}

case "${1:-}" in
  tests) run_tests ;;
  bench) run_bench ;;
  *) echo "usage: $0 tests|bench" >&2; exit 2 ;;
esac
