"""The paged-decode GPU tests of tests/gpu/test_codec_gpu.py, run as plain calls with libraries built
on the build machine (build/dpcheck/bundle) instead of the module's nvcc fixture.
    python3 build/dpcheck/run_gpu.py [all|bad|short|race]"""
import json, sys, time, traceback
from pathlib import Path
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tests.gpu import test_codec_gpu as t

bundle = ROOT / "build" / "dpcheck" / "bundle"
libs = {(c["family"], c["config"]): bundle / c["artifact"]
        for c in json.loads((bundle / "bundle.json").read_text())["candidates"] if c["status"] != "failed"}
mode = sys.argv[1] if len(sys.argv) > 1 else "all"
cases = []
fams = t.VARIANT_FAMILIES if mode == "all" else ["qwen3-8b"]
for f in fams:
    for v in t.PAGED:
        if mode in ("all", "bad"):
            cases.append((f"bad {f} {t._variant_id(v)}", lambda f=f, v=v: t.test_paged_decode_skips_out_of_range_pairs_inside_a_cta(libs, f, v)))
        if mode in ("all", "short"):
            for where, loc in [("device", "host"), ("device", "device"), ("pinned", "device")]:
                cases.append((f"short {f} {t._variant_id(v)} {where}/{loc}", lambda f=f, v=v, w=where, l=loc:
                              t.test_paged_decode_with_a_short_last_cta_is_bit_exact(libs, f, v, w, l)))
        if mode == "all":
            cases.append((f"variant40 {f} {t._variant_id(v)}", lambda f=f, v=v: t.test_codec_variants_bit_exact(libs, f, v)))
        if mode == "race":
            cases.append((f"race {f} {t._variant_id(v)}", lambda f=f, v=v: t.roundtrip(t.variant_library(libs, f, v), f, "device", "device", 10)))
if mode == "all":
    for v in t.PAGED:
        cases.append((f"host518 {t._variant_id(v)}", lambda v=v: t.test_paged_decode_of_more_host_pairs_than_one_launch_takes(libs, v)))
cases = [c for c in cases if len(sys.argv) < 3 or sys.argv[2] in c[0]]
failed = 0
for name, fn in cases:
    start = time.time()
    try:
        fn()
        print(f"PASS {name} ({time.time() - start:.1f}s)", flush=True)
    except Exception:
        failed += 1
        print(f"FAIL {name}\n{traceback.format_exc()[-3000:]}", flush=True)
print(f"{len(cases) - failed} passed, {failed} failed", flush=True)
sys.exit(1 if failed else 0)
