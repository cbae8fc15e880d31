#!/usr/bin/env bash
# s17c call 2: the whole kvgen bench run through build/registry-s17 (the codec's mix ceilings,
# compaction's same-size copy, rounds of every family with shared pools where the cache is larger
# than the GPU), then the queue sweep of qwen3.5-397b-a17b B32.
set -uo pipefail
W=/tmp/w2; mkdir -p $W
pk(){ tar czf $OUT/call2.tgz -C $W .; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/kvgen_site .whl/*.whl 2>/dev/null
R=$PWD
export PYTHONPATH=/tmp/kvgen_site:$R PYTHONUNBUFFERED=1 KVGEN_COMMIT=$(cat build/s17c/commit)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $W/gpu.txt
T0=$(date +%s); t(){ echo "$1 $(( $(date +%s)-T0 )) s" | tee -a $W/times.txt; }
left(){ echo $(( 585-($(date +%s)-T0) )); }
KVGEN_REGISTRY=$R/build/registry-s17 timeout 400 python3 -m kvgen.bench run --out $W/bench \
  --registry $R/build/registry-s17 --arch sm_90a --no-report > $W/bench.log 2>&1; grep -v "^W" $W/bench.log | tail -40; t bench; pk
l=$(left); [ $l -gt 40 ] && timeout $l python3 scripts/select_variants.py --family qwen3.5-397b-a17b --batch 32 --only queue \
  --only aggregate > $W/variants-qwen3.5-397b-a17b-b32.json 2> $W/variants-qwen3.5-397b-a17b-b32.log; t variants-qwen3.5; pk
