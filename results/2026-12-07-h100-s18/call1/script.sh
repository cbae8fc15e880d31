#!/usr/bin/env bash
# s18 call 1: (1) store flavours of a write-heavy mix (issue 13's decode gap), (2) Nsight Compute of
# qwen3-8b's compaction at batch 1 and 8 (issue 14: where batch 1 loses its 10 %), (3) compaction at
# batch 1 with a contiguous page table, (4) the aggregation subspace bundles (select, 3 families).
set -uo pipefail
W=/tmp/w1; mkdir -p $W
pk(){ tar czf $OUT/call1.tgz -C $W .; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/kvgen_site .whl/*.whl 2>/dev/null
R=$PWD; D=$R/results/2026-12-07-h100-s18/call1
export PYTHONPATH=/tmp/kvgen_site:$R PYTHONUNBUFFERED=1 KVGEN_COMMIT=$(git rev-parse HEAD 2>/dev/null || echo s18)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $W/gpu.txt
T0=$(date +%s); t(){ echo "$1 $(( $(date +%s)-T0 )) s" | tee -a $W/times.txt; }
timeout 150 python3 $D/stores.py $W/stores.json > $W/stores.log 2>&1; grep -v "^\s*$" $W/stores.log | grep "kind" | cut -c1-200; t stores; pk
for f in gpt-oss-20b qwen3.5-397b-a17b qwen3-8b; do
  timeout 100 python3 -m kvgen.tuning.measure build/s18/agg-$f.tar.xz --out $W/agg-$f.jsonl > $W/agg-$f.log 2>&1; tail -1 $W/agg-$f.log; t agg-$f; pk
done
REG=$R/build/registry-s17
for b in 1 8; do
  timeout 150 ncu --clock-control none -k regex:compact_kernel --launch-skip 2 --launch-count 1 --set full \
    --metrics sm__cycles_active.max,sm__cycles_active.min,sm__cycles_active.avg,launch__waves_per_multiprocessor \
    --csv --page raw python3 -m kvgen.bench.compact --batches $b --registry $REG > $W/ncu-compact-b$b.csv 2> $W/ncu-compact-b$b.err
  tail -2 $W/ncu-compact-b$b.err; wc -l $W/ncu-compact-b$b.csv; t ncu-b$b; pk
done
timeout 90 python3 -m kvgen.bench.compact --batches 1 --registry $REG --page-table contiguous > $W/compact-contig.log 2>&1
tail -3 $W/compact-contig.log; t contig; pk
