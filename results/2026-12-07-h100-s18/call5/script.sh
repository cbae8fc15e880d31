#!/usr/bin/env bash
# s18 call 5, the same warm machine as call 3: compute-sanitizer memcheck of the compaction GPU
# tests of every pipeline shape (tests/gpu/test_compact_gpu.py::test_pipelines_equal_oracle,
# libraries compiled on the device from compact.cu.j2).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/kvgen_site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/kvgen_site:$PWD
mkdir -p $OUT/call5; nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/call5/gpu.txt
timeout 280 compute-sanitizer --tool memcheck --leak-check no python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/gpu/test_compact_gpu.py -k "pipelines_equal_oracle" > $OUT/call5/sanitizer_pipelines.log 2>&1
tail -4 $OUT/call5/sanitizer_pipelines.log
