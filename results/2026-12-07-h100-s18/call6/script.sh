#!/usr/bin/env bash
# s18 call 6: rounds on one machine, alternating build/registry-s18o (this code, the tuning files of
# 22f5514: s17's select and compaction entries) and build/registry-s18 (this session's entries).
set -uo pipefail
W=/tmp/w6; mkdir -p $W
pk(){ tar czf $OUT/call6.tgz -C $W .; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/kvgen_site .whl/*.whl 2>/dev/null
R=$PWD
export PYTHONPATH=/tmp/kvgen_site:$R PYTHONUNBUFFERED=1 KVGEN_COMMIT=$(cat build/registry-s18/commit)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $W/gpu.txt
T0=$(date +%s); t(){ echo "$1 $(( $(date +%s)-T0 )) s" | tee -a $W/times.txt; }
for reg in s18o s18 s18o s18; do
  REG=$R/build/registry-$reg
  KVGEN_REGISTRY=$REG timeout 80 python3 -m kvgen.bench run --out $W/ab-$reg-$(date +%s) --registry $REG --arch sm_90a \
    --only round --no-report > $W/ab-$reg.log 2>&1; grep "^round" $W/ab-$reg.log | grep "B=32" | cut -c1-100; t $reg; pk
done
