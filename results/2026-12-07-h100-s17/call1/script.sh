#!/usr/bin/env bash
# s17c call 1 (build/s17c/commit, clean tree; run by the session after the seventeenth, which got no
# device): the selection's new head_step and the queue, on gpt-oss-20b B32.
#  - scripts/select_variants.py --only queue --only aggregate (Triton JIT, bit-checked against the
#    shipped constants): queue_lag x queue_programs x block_w x head_step x warps against the two
#    launches apart; the aggregation's block_w x warps x head_step;
#  - the queue-subspace bundles of build/s17/bundles.sh (oracle-gated, kvgen.tuning.measure);
#  - kvgen bench --only round through build/registry-s17 (shipped defaults, the seven benched
#    families: qwen3-8b and gemma-2-9b B32 now run with shared pools), -s17h (route 0, head_step 8)
#    and -s17l4 (route 1, lag 4, 2 programs, block_w 256, head_step 8); gpt-oss-20b and qwen3.5 only;
#  - the selection GPU tests (queue-lag4-heads8 and apart-heads4 routes, the AOT libraries of s17l4).
set -uo pipefail
W=/tmp/w1; mkdir -p $W
pk(){ tar czf $OUT/call1.tgz -C $W .; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/kvgen_site .whl/*.whl 2>/dev/null
R=$PWD
export PYTHONPATH=/tmp/kvgen_site:$R PYTHONUNBUFFERED=1 KVGEN_COMMIT=$(cat build/s17c/commit)
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $W/gpu.txt
T0=$(date +%s); t(){ echo "$1 $(( $(date +%s)-T0 )) s" | tee -a $W/times.txt; }
left(){ echo $(( 585-($(date +%s)-T0) )); }
timeout 200 python3 scripts/select_variants.py --family gpt-oss-20b --batch 32 --only queue --only aggregate \
  > $W/variants-gpt-oss-20b-b32.json 2> $W/variants-gpt-oss-20b-b32.log; grep -v "^W" $W/variants-gpt-oss-20b-b32.log | tail -2; t variants; pk
for r in s17 s17h s17l4; do
  KVGEN_REGISTRY=$R/build/registry-$r timeout 120 python3 -m kvgen.bench run --out $W/round-$r --registry $R/build/registry-$r \
    --arch sm_90a --only round --no-report > $W/round-$r.log 2>&1; grep "^round" $W/round-$r.log | grep -v skipped; t $r; pk
done
l=$(left); [ $l -gt 30 ] && KVGEN_REGISTRY=$R/build/registry-s17l4 timeout $(( l < 150 ? l : 150 )) python3 -m pytest -q -p no:cacheprovider -m gpu \
  tests/gpu/test_select_gpu.py -k "round_sized or aot_library" > $W/select_tests.log 2>&1; tail -3 $W/select_tests.log; t tests; pk
for b in build/s17c/*.tar.xz; do
  [ -f "$b" ] || continue; l=$(left); [ $l -lt 20 ] && break
  n=$(basename $b .tar.xz); timeout $l python3 -m kvgen.tuning.measure $b --out $W/$n.jsonl > $W/$n.log 2>&1
  tail -1 $W/$n.log; t $n; pk
done
