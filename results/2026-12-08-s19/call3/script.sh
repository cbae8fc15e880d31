#!/usr/bin/env bash
# s19 call 3 (NOT RUN: no device was lent this session): compaction's new tail_split tunable.
# (1) The oracle-gated tuning measurements of three bundles (tail_split 1/2/4 around each family's
# shipped shape, buckets b1 and b32), built on the CPU machine at the commit that runs this with
#   kvgen tune --family qwen3-8b --op compact --arch sm_90a --build-only -j 2 \
#       --fix threads=256,tile_tokens=32,load_ahead=1,index_ahead=0 --bundle build/s19/tail-qwen3-8b
#   kvgen tune --family gpt-oss-20b --op compact --arch sm_90a --build-only -j 2 \
#       --fix threads=128,slices=2,load_ahead=1,index_ahead=1 --bundle build/s19/tail-gpt-oss-20b
#   kvgen tune --family qwen3.5-397b-a17b --op compact --arch sm_90a --build-only -j 2 \
#       --fix threads=256,slices=8,load_ahead=1,index_ahead=0 --bundle build/s19/tail-qwen3.5-397b-a17b
#   mkdir -p build/s19x && cp build/s19/*.tar.xz build/s19x/     # carry build/s19x (the .tar.xz only)
# (2) the GPU tests of the split (tests/gpu/test_compact_gpu.py -k tail_split).
set -uo pipefail
W=/tmp/w3; mkdir -p $W
pk(){ tar czf $OUT/call3.tgz -C $W .; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/kvgen_site .whl/*.whl 2>/dev/null
R=$PWD
export PYTHONPATH=/tmp/kvgen_site:$R PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee $W/gpu.txt
T0=$(date +%s); t(){ echo "$1 $(( $(date +%s)-T0 )) s" | tee -a $W/times.txt; }
for f in qwen3-8b gpt-oss-20b qwen3.5-397b-a17b; do
  timeout 150 python3 -m kvgen.tuning.measure build/s19x/tail-$f.tar.xz --out $W/tail-$f.jsonl > $W/tail-$f.log 2>&1; tail -1 $W/tail-$f.log; t tail-$f; pk
done
python3 - <<'PY' | tee $W/summary.txt
import json, glob
for path in sorted(glob.glob("/tmp/w3/tail-*.jsonl")):
    for line in open(path):
        r = json.loads(line)
        print(r["family"], r["bucket"], r["config"].replace("load_ahead=", "la").replace("index_ahead=", "ia"), r["status"], round(r.get("median_ms") or -1, 4))
PY
pk
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_compact_gpu.py -k "tail_split" > $W/tests.log 2>&1; tail -3 $W/tests.log; t tests; pk
