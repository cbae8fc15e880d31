"""Build the paged-decode variant libraries of tests/gpu/test_codec_gpu.py (PAGED x VARIANT_FAMILIES,
the other tunables at their defaults) into build/dpcheck/bundle, as its variant_libraries fixture does."""
from pathlib import Path
from kvgen.build.job import load_spec_source
from kvgen.cli import discover_toolchains
from kvgen.lower.plan import default_params
from kvgen.tuning.candidates import Request, build_candidates
ROOT = Path(__file__).resolve().parents[2]
PAGED = [{"decode_load": load, "decode_pages": pages} for load in (1, 2) for pages in (2, 4)]
FAMILIES = ["qwen3-8b", "mistral-7b", "qwen3-8b-fp8", "deepseek-v4-csa"]
out = ROOT / "build" / "dpcheck"
requests = [Request(load_spec_source(ROOT / "specs" / f"{f}.yaml"), "codec", {**default_params("codec"), **v})
            for f in FAMILIES for v in PAGED]
built = build_candidates(requests, "sm_90a", out / "bundle", out / "cache", toolchains=discover_toolchains(), jobs=2)
for c in built:
    print(c.family, c.config, c.status, c.artifact)
