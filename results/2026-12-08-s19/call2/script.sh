#!/usr/bin/env bash
# s19 call 2 (NOT RUN: no device was lent this session; rebuild build/registry-s19 first, the compact
# ABI is 4 since): (1) the GPU selection tests against build/registry-s19 (qwen3-8b now ships a b32
# selection variant); (2) qwen3-8b B32 selection, main library vs variant, alternating (select_ab.py);
# (3) kvgen bench run --only round through registry-s19 (the round takes the variant).
set -uo pipefail
W=/tmp/w2; mkdir -p $W
pk(){ tar czf $OUT/call2.tgz -C $W .; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/kvgen_site .whl/*.whl 2>/dev/null
R=$PWD; REG=$R/build/registry-s19; S=$R/results/2026-12-08-s19/call2
export PYTHONPATH=/tmp/kvgen_site:$R PYTHONUNBUFFERED=1 KVGEN_COMMIT=$(git rev-parse HEAD 2>/dev/null || echo dd97215) KVGEN_REGISTRY=$REG
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee $W/gpu.txt
T0=$(date +%s); t(){ echo "$1 $(( $(date +%s)-T0 )) s" | tee -a $W/times.txt; }
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_select_gpu.py -k "size_dispatched or aot_library or byte_identical" > $W/tests.log 2>&1; tail -3 $W/tests.log; t tests; pk
timeout 90 python3 $S/select_ab.py $REG $W/select_ab.json > $W/select_ab.log 2>&1; tail -8 $W/select_ab.log; t ab; pk
timeout 150 python3 -m kvgen.bench run --out $W/round --registry $REG --arch sm_90a --only round --no-report > $W/round.log 2>&1
grep "^round" $W/round.log | cut -c1-150; t round; pk
