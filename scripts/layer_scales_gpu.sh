#!/usr/bin/env bash
# Per-layer second-level scales on the GPU (issue 16, item 4), one command, a few minutes; every
# step runs whatever the previous one did, and writes its log under $OUT.
#
#   scripts/layer_scales_gpu.sh [BUNDLE]      BUNDLE: libraries built on the build machine
#                                             (default build/device/scales)
#
# BUNDLE/registry  the test family tests/specs/per-layer-scales.yaml (K and V per layer):
#   kvgen --specs tests/specs build --family per-layer-scales --arch sm_90a --registry BUNDLE/registry
# BUNDLE/shipped   shipped families rebuilt with this tree's codec headers (per-buffer constants):
#   kvgen build --family deepseek-v4-csa,glm-5,deepseek-v3,qwen3-8b,qwen3-8b-fp8 --arch sm_90a --registry BUNDLE/shipped
#
# 1. tests/gpu/test_layer_scales_gpu.py: multi-layer pages with a distinct (G, Q) per layer and
#    buffer, encoded and decoded through the C ABI byte for byte like the oracle.
# 2. tests/gpu/test_codec_gpu.py::test_encode_decode_bit_exact on BUNDLE/shipped: the per-buffer path
#    still writes the oracle's bytes with the changed headers (families not in it skip).
# 3. kvgen bench run --only codec: BUNDLE/shipped ("tuned") against the carried build/registry
#    ("default", built from the headers before this change) on the same inputs; tuned_vs_default in
#    bench.json gives speedup = default_ms / tuned_ms per kernel (about 1.0: no regression).
set -u
bundle=${1:-build/device/scales}
out=${OUT:-/tmp/layer-scales-gpu}
py=${PYTHON:-python}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}

step() {  # name, command...
  local name=$1
  shift
  "$@" > "$out/$name.log" 2>&1
  echo "$name: exit $?" | tee -a "$out/summary.txt"
}

step layer_scales env KVGEN_LAYER_SCALES_REGISTRY="$bundle/registry" timeout 300 \
  "$py" -m pytest -q -p no:cacheprovider tests/gpu/test_layer_scales_gpu.py --junitxml="$out/layer_scales.xml"
step codec_shipped env KVGEN_REGISTRY="$bundle/shipped" timeout 400 \
  "$py" -m pytest -q -p no:cacheprovider tests/gpu/test_codec_gpu.py -k test_encode_decode_bit_exact \
  --junitxml="$out/codec_shipped.xml"
step bench_codec timeout 300 "$py" -m kvgen.cli bench run --only codec --registry "$bundle/shipped" \
  --default-registry build/registry --families qwen3-8b,qwen3-8b-fp8,deepseek-v4-csa --hot-gib 0.5 \
  --no-peers --no-round --no-report --out "$out/bench"
tail -n 3 "$out"/*.log > "$out/tails.txt" 2>&1
exit 0
