#!/usr/bin/env bash
# s18 call 2, the same warm machine as call 1: qwen3-8b's compaction at batch 1 through
# build/registry-s17 twice with the scattered page table (call 1 ran it contiguous).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/kvgen_site .whl/*.whl 2>/dev/null
export PYTHONPATH=/tmp/kvgen_site:$PWD
for i in 1 2; do
  timeout 60 python3 -m kvgen.bench.compact --batches 1 --registry build/registry-s17 2>&1 | grep "fraction_of_copy"
done
