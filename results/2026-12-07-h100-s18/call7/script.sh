#!/usr/bin/env bash
# s18 call 7: the whole kvgen bench run through build/registry-s18full (the seven benched families
# at this session's code and tuning files).
set -uo pipefail
W=/tmp/w7; mkdir -p $W
pk(){ tar czf $OUT/call7.tgz -C $W .; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/kvgen_site .whl/*.whl 2>/dev/null
R=$PWD; REG=$R/build/registry-s18full
export PYTHONPATH=/tmp/kvgen_site:$R PYTHONUNBUFFERED=1 KVGEN_COMMIT=$(cat $REG/commit) KVGEN_REGISTRY=$REG
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $W/gpu.txt
T0=$(date +%s); t(){ echo "$1 $(( $(date +%s)-T0 )) s" | tee -a $W/times.txt; }
timeout 330 python3 -m kvgen.bench run --out $W/bench --registry $REG --arch sm_90a --no-report > $W/bench.log 2>&1
grep -v "^W" $W/bench.log | tail -40 | cut -c1-200; t bench; pk
