#!/usr/bin/env bash
# Proof on the GPU machine that the pre-generated sm90 kernel wheel works with no compiler:
#   1. pip-install dist/kvgen_kernels_sm90-*.whl (built here with `kvgen wheel --arch sm_90a` and
#      carried in dist/) with --no-deps --target /tmp/kvgen_wheel_env; kvgen itself is imported
#      from this checkout;
#   2. run tests/gpu/test_wheel_gpu.py with a PATH that holds no nvcc (only gcc and nvidia-smi, for the
#      environment record), no $KVGEN_REGISTRY and no build/registry on the search path: the
#      libraries can only come from the installed wheel, found through its entry point;
#   3. write $OUT/wheel_proof.json (environment, wheel sha256, per-test outcomes) and keep the
#      junit XML beside it.
# The codec oracle reads the spec, which needs pydantic: if this Python lacks it, it is installed
# from the carried .whl/ directory into /tmp/kvgen_wheel_deps (offline).
# Exit status: 0 only if every test passed (compaction may skip, with its reason, if this
# checkout has no kvgen.runtime.compact).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}
mkdir -p "$OUT"
PY=$(command -v "${PYTHON:-python3}")
TARGET=/tmp/kvgen_wheel_env
DEPS=/tmp/kvgen_wheel_deps

shopt -s nullglob
wheels=(dist/kvgen_kernels_sm90-*.whl)
if [ "${#wheels[@]}" -ne 1 ]; then
  echo "need exactly one dist/kvgen_kernels_sm90-*.whl (found ${#wheels[@]}); on the build machine run:" >&2
  echo "  kvgen build --arch sm_90a && kvgen wheel --arch sm_90a --out dist" >&2
  exit 2
fi
WHEEL=${wheels[0]}

rm -rf "$TARGET"
if "$PY" -m pip --version >/dev/null 2>&1; then
  "$PY" -m pip install --quiet --disable-pip-version-check --no-deps --no-index --target "$TARGET" "$WHEEL"
  INSTALLER=pip
else
  # A --target install of a platlib wheel without .data is exactly an unzip: do that without pip.
  "$PY" -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" "$WHEEL" "$TARGET"
  chmod 755 "$TARGET"/kvgen_kernels_sm90/registry/*/*.so
  INSTALLER=unzip
fi

PYDANTIC=site
if ! env -u PYTHONPATH "$PY" -c "import pydantic" >/dev/null 2>&1; then
  if [ -d .whl ]; then
    rm -rf "$DEPS"
    # --no-deps: --target ignores what is installed, and typing_extensions (torch has it) is not in .whl/
    "$PY" -m pip install --quiet --disable-pip-version-check --no-deps --no-index --target "$DEPS" .whl/*.whl
    PYDANTIC=.whl
  else
    PYDANTIC=missing   # the codec tests skip (oracle needs the spec); lookup and compaction still run
  fi
fi

# A PATH with no CUDA compiler: a scratch bin directory holding only nvidia-smi and the C compiler.
BIN=$(mktemp -d)
trap 'rm -rf "$BIN"' EXIT
if command -v nvidia-smi >/dev/null; then ln -s "$(command -v nvidia-smi)" "$BIN/nvidia-smi"; fi
# Triton builds each kernel's small host launcher with the C compiler at run time (a Triton
# requirement, not kvgen's): the packer needs gcc and its assembler and linker, never nvcc.
for cc in gcc cc as ld; do
  if command -v "$cc" >/dev/null; then ln -s "$(command -v "$cc")" "$BIN/$cc"; fi
done

set +e
env -u KVGEN_REGISTRY PATH="$BIN" PYTHONPATH="$TARGET:$DEPS:$PWD" KVGEN_WHEEL_TARGET="$TARGET" \
  "$PY" -m pytest -q -p no:cacheprovider tests/gpu/test_wheel_gpu.py --junitxml "$OUT/wheel_proof_junit.xml"
rc=$?
set -e

env PATH="$BIN" PYTHONPATH="$DEPS:$PWD" "$PY" - "$WHEEL" "$TARGET" "$OUT/wheel_proof_junit.xml" "$rc" \
  "$INSTALLER" "$PYDANTIC" <<'EOF'
"""Summarize the junit XML into wheel_proof.json; exit 1 unless the proof is complete."""
import hashlib
import shutil
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from kvgen.measure.environment import environment, write_result

wheel, target, junit, rc, installer, pydantic = sys.argv[1:]
tests = []
for case in ET.parse(junit).getroot().iter("testcase"):
    outcome, message = "passed", ""
    for kind in ("failure", "error", "skipped"):
        node = case.find(kind)
        if node is not None:
            outcome, message = kind, (node.get("message") or "")[:2000]
    tests.append({"name": case.get("name"), "outcome": outcome, "seconds": float(case.get("time") or 0),
                  "message": message})
optional = ("compaction",)   # may skip with a reason when kvgen.runtime.compact is absent
blocking = [t for t in tests if t["outcome"] != "passed"
            and not (t["outcome"] == "skipped" and any(word in t["name"] for word in optional))]
data = {
    "proof": "kvgen-kernels-sm90 wheel installed with pip --no-deps --target, no nvcc on PATH",
    "environment": environment(),
    "wheel": {"file": Path(wheel).name, "bytes": Path(wheel).stat().st_size,
              "sha256": hashlib.sha256(Path(wheel).read_bytes()).hexdigest()},
    "installed_to": target, "installer": installer, "pydantic": pydantic,
    "nvcc_on_path": shutil.which("nvcc") is not None,
    "pytest_rc": int(rc), "tests": tests, "ok": int(rc) == 0 and bool(tests) and not blocking,
}
print(f"wrote {write_result('wheel_proof', data)}: ok={data['ok']}, "
      f"{sum(t['outcome'] == 'passed' for t in tests)}/{len(tests)} passed")
sys.exit(0 if data["ok"] else 1)
EOF
