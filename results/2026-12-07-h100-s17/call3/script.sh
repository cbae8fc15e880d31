#!/usr/bin/env bash
# s17 call 3: rounds through build/registry-s17t (gpt-oss-20b, qwen3.5-397b-a17b with the select
# tuning files measured in call 1: qwen3.5's select at block_w 128, head_step 8) twice, the selection
# GPU tests on its AOT libraries, and compute-sanitizer memcheck of the mix-ceiling kernel.
set -uo pipefail
W=/tmp/w3; mkdir -p $W
pk(){ tar czf $OUT/call3.tgz -C $W .; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/kvgen_site .whl/*.whl 2>/dev/null
R=$PWD
export PYTHONPATH=/tmp/kvgen_site:$R PYTHONUNBUFFERED=1 KVGEN_COMMIT=$(cat build/s17c/commit)+select-tuning
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee $W/gpu.txt
T0=$(date +%s); t(){ echo "$1 $(( $(date +%s)-T0 )) s" | tee -a $W/times.txt; }
for i in 1 2; do
  KVGEN_REGISTRY=$R/build/registry-s17t timeout 90 python3 -m kvgen.bench run --out $W/round-s17t-$i --registry $R/build/registry-s17t \
    --arch sm_90a --only round --no-report > $W/round-s17t-$i.log 2>&1; grep "^round" $W/round-s17t-$i.log | grep -v "skipped\|failed"; t round$i; pk
done
KVGEN_REGISTRY=$R/build/registry-s17t timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_select_gpu.py \
  -k "aot_library" > $W/select_tests.log 2>&1; tail -2 $W/select_tests.log; t tests; pk
timeout 120 compute-sanitizer --tool memcheck --leak-check no python3 -c "
import torch
from kvgen.measure.mix import mix, mix_reference
for s, d in [(5, 18), (18, 5), (1100, 300), (300, 1100), (331776, 1179648)]:
    src = torch.randint(-2**31, 2**31 - 1, (3, s), dtype=torch.int32, device='cuda')
    out = mix(src, torch.empty(3, d, dtype=torch.int32, device='cuda'))
    assert torch.equal(out.cpu(), mix_reference(src.cpu(), d)), (s, d)
print('mix checked')
" > $W/sanitizer_mix.log 2>&1; tail -3 $W/sanitizer_mix.log; t sanitizer; pk
