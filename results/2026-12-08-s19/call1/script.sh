#!/usr/bin/env bash
# s19 call 1: the whole kvgen bench run through build/registry-s19 (the seven benched families at
# this session's starting code and tuning files; byte-identical to s18's registry-s18full).
set -uo pipefail
W=/tmp/w1; mkdir -p $W
pk(){ tar czf $OUT/call1.tgz -C $W .; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/kvgen_site .whl/*.whl 2>/dev/null
R=$PWD; REG=$R/build/registry-s19
export PYTHONPATH=/tmp/kvgen_site:$R PYTHONUNBUFFERED=1 KVGEN_COMMIT=$(git rev-parse HEAD 2>/dev/null || echo dd97215) KVGEN_REGISTRY=$REG
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee $W/gpu.txt
T0=$(date +%s); t(){ echo "$1 $(( $(date +%s)-T0 )) s" | tee -a $W/times.txt; }
timeout 400 python3 -m kvgen.bench run --out $W/bench --registry $REG --arch sm_90a --no-report > $W/bench.log 2>&1
grep -v "^W" $W/bench.log | tail -40 | cut -c1-200; t bench; pk
