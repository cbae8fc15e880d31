#!/usr/bin/env bash
# s18 call 4: build/registry-s18 (qwen3-8b, gpt-oss-20b, qwen3.5-397b-a17b at this session's tuned
# select and compaction): kvgen bench compact + round twice, the compaction GPU tests on the
# registry's families; the expanding mix kernel at other shapes (mix_shapes.py).
set -uo pipefail
W=/tmp/w4; mkdir -p $W
pk(){ tar czf $OUT/call4.tgz -C $W .; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/kvgen_site .whl/*.whl 2>/dev/null
R=$PWD; REG=$R/build/registry-s18
export PYTHONPATH=/tmp/kvgen_site:$R PYTHONUNBUFFERED=1 KVGEN_COMMIT=$(cat build/registry-s18/commit 2>/dev/null || echo s18) KVGEN_REGISTRY=$REG
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $W/gpu.txt
T0=$(date +%s); t(){ echo "$1 $(( $(date +%s)-T0 )) s" | tee -a $W/times.txt; }
for i in 1 2; do
  timeout 150 python3 -m kvgen.bench run --out $W/bench-$i --registry $REG --arch sm_90a --only compact,round --no-report \
    > $W/bench-$i.log 2>&1; grep -E "^(round|compact)|fraction_of_copy" $W/bench-$i.log | cut -c1-220 | grep -v skipped | head -20; t bench$i; pk
done
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_compact_gpu.py \
  -k "compaction_equals_oracle or cuda_graph" > $W/compact_tests.log 2>&1; tail -2 $W/compact_tests.log; t tests; pk
timeout 120 python3 results/2026-12-07-h100-s18/call4/mix_shapes.py $W/mix_shapes.json > $W/mix_shapes.log 2>&1
grep kind $W/mix_shapes.log | cut -c1-140; t mix; pk
