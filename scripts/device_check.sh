#!/usr/bin/env bash
# Everything kvgen checks and measures on the GPU machine, in two batches (one device call each):
#
#   bash scripts/device_check.sh tests   # gpu-marked tests (codec, compaction, packer, scorer,
#                                        # device NVFP4 arithmetic), compute-sanitizer, wheel proof
#   bash scripts/device_check.sh sanitize-bad
#                                        # deliberately bad host and device indices (codec page pairs,
#                                        # compaction moves, page table entries) under compute-sanitizer:
#                                        # tests pass and "ERROR SUMMARY: 0 errors" -> $OUT/sanitize_bad.log
#   bash scripts/device_check.sh select  # the selection and the packer on the GPU (JIT and the
#                                        # registry's AOT libraries) against the oracle, the AOT
#                                        # libraries under compute-sanitizer, and kvgen bench's round
#                                        # -> $OUT/select_*.log, $OUT/bench.json
#   bash scripts/device_check.sh bench   # kvgen bench run: codec, compaction and scorer benchmarks
#                                        # in one process, ceilings measured once -> $OUT/bench.json
#   bash scripts/device_check.sh ncu [FAMILY...]
#                                        # Nsight Compute (clock control off) of one encode and one
#                                        # decode per family -> $OUT/ncu_codec.csv
#   bash scripts/device_check.sh tune BUNDLE.tar.xz [DONE.jsonl]
#                                        # kvgen.tuning.measure: every candidate of a bundle (kvgen tune
#                                        # --build-only) checked and timed -> $OUT/measurements.jsonl;
#                                        # DONE.jsonl (an earlier, cut-off run) is continued, not redone
#
# Needs, carried from the build machine: build/registry (kvgen build --arch sm_90a), dist/ (kvgen
# wheel --arch sm_90a) and .whl/ (pydantic wheels; the GPU image has no pydantic). Optional for
# bench: build/registry-default (KVGEN_TUNING=off kvgen build --arch sm_90a --registry
# build/registry-default), then tuned vs default is measured too. Writes logs and JSON under $OUT
# (results/ when unset); the report (report.md + PNGs) is written there only if matplotlib is
# installed, else afterwards with: python -m kvgen.bench report DIR. The commit recorded is
# $KVGEN_COMMIT, else git's (set it where the copy has no .git). Never fails fast: every step runs and reports.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ! python3 -c "import pydantic" >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/kvgen_site .whl/*.whl
  export PYTHONPATH="/tmp/kvgen_site:$PWD"
else
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
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

run_sanitize_bad() {
  # The kernels must skip every out-of-range index (tests/gpu/test_bounds_gpu.py checks the bytes and
  # the errors); memcheck checks that no access left the memory the kernels were given.
  timeout 480 compute-sanitizer --tool memcheck --print-limit 10 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/gpu/test_bounds_gpu.py 2>&1 | tee "$OUT/sanitize_bad.log" | grep -E "passed|failed|FAILED|ERROR SUMMARY|Invalid" \
    | tail -15
}

run_select() {
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_select_gpu.py tests/gpu/test_compact_gpu.py \
    --junitxml "$OUT/select_tests.xml" 2>&1 | tee "$OUT/select_tests.log" | grep -E "passed|failed|FAILED|Error" | tail -15
  timeout 200 compute-sanitizer --tool memcheck --print-limit 10 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/gpu/test_select_gpu.py tests/gpu/test_compact_gpu.py \
    -k "past_a_row or needs_no_triton or (aot_library_equals and qwen3-8b-) or whatever_the_offsets or packer_on_gpu" \
    2>&1 | tee "$OUT/select_sanitizer.log" | grep -E "passed|failed|FAILED|ERROR SUMMARY|Invalid" | tail -5
  timeout 200 python3 -m kvgen.bench run --out "$OUT" --registry build/registry --arch sm_90a --only round \
    2>&1 | grep -v "^W" | tee "$OUT/bench.log" | tail -15
}

run_bench() {
  local default=()
  if [ -f build/registry-default/sm_90a/manifest.json ]; then
    default=(--default-registry build/registry-default)
  fi
  timeout 560 python3 -m kvgen.bench run --out "$OUT" --registry build/registry --arch sm_90a \
    ${default[@]+"${default[@]}"} 2>&1 | grep -v "^W" | tee "$OUT/bench.log" | tail -15
}

run_ncu() {
  local families=("$@")
  [ "${#families[@]}" -gt 0 ] || families=(qwen3-8b qwen3-8b-fp8)
  for family in "${families[@]}"; do
    timeout 150 ncu --clock-control none -k 'regex:encode_kernel|decode_kernel' -c 2 --csv --page details \
      --section SpeedOfLight --section ComputeWorkloadAnalysis --section Occupancy --section WarpStateStats \
      --section LaunchStats --section InstructionStats --section MemoryWorkloadAnalysis \
      python3 scripts/ncu_codec.py "$family" 2>&1 | grep -v "^==PROF==" | sed "s/^/$family,/" >> "$OUT/ncu_codec.csv"
  done
  grep -E "Compute \(SM\) Throughput|DRAM Throughput|Memory Throughput|Achieved Occupancy|Issue Slots Busy" \
    "$OUT/ncu_codec.csv" | cut -c1-160 | head -40
}

run_tune() {
  local bundle=$1 done=${2:-}
  if [ -n "$done" ]; then cp "$done" "$OUT/measurements.jsonl"; fi
  timeout 540 python3 -m kvgen.tuning.measure "$bundle" --out "$OUT/measurements.jsonl" 2>&1 | tee "$OUT/tune.log" | tail -40
}

case "${1:-}" in
  tests) run_tests ;;
  sanitize-bad) run_sanitize_bad ;;
  select) run_select ;;
  bench) run_bench ;;
  ncu) shift; run_ncu "$@" ;;
  tune) shift; run_tune "$@" ;;
  *) echo "usage: $0 tests|sanitize-bad|select|bench|ncu [FAMILY...]|tune BUNDLE [DONE.jsonl]" >&2; exit 2 ;;
esac
