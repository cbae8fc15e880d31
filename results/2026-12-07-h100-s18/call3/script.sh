#!/usr/bin/env bash
# s18 call 3: (1) the compaction bundles with the new pipeline tunables (load_ahead, index_ahead),
# oracle-gated, buckets b1 and b32; (2) store flavours of decode's write-heavy mix (stores.py).
set -uo pipefail
W=/tmp/w3; mkdir -p $W
pk(){ tar czf $OUT/call3.tgz -C $W .; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/kvgen_site .whl/*.whl 2>/dev/null
R=$PWD
export PYTHONPATH=/tmp/kvgen_site:$R PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $W/gpu.txt
T0=$(date +%s); t(){ echo "$1 $(( $(date +%s)-T0 )) s" | tee -a $W/times.txt; }
for f in qwen3-8b gpt-oss-20b qwen3.5-397b-a17b; do
  timeout 240 python3 -m kvgen.tuning.measure build/s18/ct-$f.tar.xz --out $W/ct-$f.jsonl > $W/ct-$f.log 2>&1; tail -1 $W/ct-$f.log; t ct-$f; pk
done
timeout 150 python3 results/2026-12-07-h100-s18/call1/stores.py $W/stores.json > $W/stores.log 2>&1; grep "kind" $W/stores.log | cut -c1-160; t stores; pk
