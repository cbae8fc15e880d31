"""``kvgen demo`` on the GPU with the generated kernels of the registry (``--device cuda --small``).

The small run keeps every layer of both families (the registry's libraries are built for 36 and
61 layers) and a 6 MiB pinned cold tier (4 cold pages of either family), with a disk tier below
it, so offload, spill, read-back and onboard all happen. What must hold:
- the report names the generated codec of the registry for both families, and the generated score,
  pack and compact kernels for eviction (no silent fallback to the oracle);
- every onboarded page is bit-exact: the cold blobs equal the oracle's ``encode`` of the original
  pages, the restored pages equal the oracle's ``decode(encode(original))``;
- independently of the demo's own checks, pages encoded by the generated codec into pinned host
  memory and decoded back equal ``kvgen.reference.codec.encode_records`` / ``decode_records`` of the
  same pages (second test);
- the same error properties as the CPU test (tests/test_demo.py states the tolerances).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
import torch

from kvgen import demo
from kvgen.artifacts.manifest import manifest_path, read_manifest
from kvgen.demo.codecs import open_codec, pairs_tensor
from kvgen.demo.synthetic import CacheGeometry, KVGenerator
from kvgen.demo.tiers import ColdTier, HotPool
from kvgen.lower.layout import family_layout
from kvgen.reference.codec import decode_records, encode_records
from kvgen.spec.schema import load_spec

from ..conftest import SPECS_DIR
from .conftest import ARCH, REGISTRY

pytestmark = pytest.mark.gpu


def require_registry() -> None:
    """Skip, naming the command that builds it, unless the registry holds both families."""
    path = manifest_path(REGISTRY, ARCH)
    if not path.is_file():
        pytest.skip(f"no registry at {path}; run: kvgen build --arch {ARCH} (and carry build/registry)")
    manifest = read_manifest(path, verify=False)
    for family in demo.CODEC_FAMILIES:
        if manifest.family(family) is None:
            pytest.skip(f"{family} not in {path}; run: kvgen build --arch {ARCH} --family {family}")


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    return parser.parse_args(argv)


def gpu_args(*extra: str) -> argparse.Namespace:
    return parse(["--device", "cuda", "--small", "--registry", str(REGISTRY), "--arch", ARCH, *extra])


def test_demo_small_runs_the_generated_kernels_bit_exact(tmp_path: Path) -> None:
    require_registry()
    out = tmp_path / "demo.json"
    assert demo.run(gpu_args("--out", str(out), "--disk", str(tmp_path / "disk"))) == 0
    report = json.loads(out.read_text())
    assert report["backend"] == "generated (registry)" and report["timer"] == "cuda events"
    for family in report["codec"]:
        name = family["family"]
        layout = family_layout(load_spec(SPECS_DIR / f"{name}.yaml"))
        lc = layout.lifecycles[0]
        b, checks, scenario = family["bytes"], family["checks"], family["scenario"]
        assert family["backend"] == "generated (registry)" and family["arch"] == ARCH
        assert Path(family["library"]).resolve().parent == (REGISTRY / ARCH).resolve()
        assert family["layers"] == len(lc.layers), "the GPU runs every layer"
        assert b["codec_cold_page_bytes"] == b["cold_page_bytes"] == lc.cold_page_bytes
        assert b["cold_over_hot"] == lc.cold_page_bytes / lc.hot_page_bytes
        assert scenario["cold_memory"] == "pinned host"
        assert checks["cold_bytes_equal_oracle"], f"{name}: generated cold blobs differ from the oracle's"
        assert checks["restored_equal_oracle_decode"], f"{name}: restored pages != oracle decode(encode())"
        assert checks["pages_checked"] == scenario["pages_onboarded"] > 0
        assert scenario["spilled_to_disk"] > 0 and scenario["read_from_disk"] > 0
        a = family["attention"]["both"]
        assert math.isfinite(a["rel_l2"]) and a["rel_l2"] < 0.5 and a["cos_mean"] > 0.9
        t = family["transfer"]
        assert t["timer"] == "cuda events" and t["pages"] > 0
        assert all(t[k] > 0 for k in ("encode_to_cold_ms", "decode_from_cold_ms", "raw_copy_to_host_ms",
                                      "raw_copy_from_host_ms"))
    ev = report["eviction"]
    assert ev["backend"]["score"].startswith("generated CuTe DSL"), ev["backend"]
    assert ev["backend"]["pack"].startswith("generated Triton"), ev["backend"]
    assert ev["backend"]["compact"].startswith("generated CUDA"), ev["backend"]
    rows = sorted(ev["budgets"], key=lambda r: r["budget"])
    errors = [r["rel_l2"] for r in rows]
    assert all(math.isfinite(e) for e in errors)
    assert all(later <= earlier for earlier, later in zip(errors, errors[1:])), errors
    for row in rows:
        assert row["kept_rows_equal_original"], f"budget {row['budget']}: compaction kept other rows"
        assert row["rounds"] >= 1 and row["round_ms_median"] > 0


@pytest.mark.parametrize("family", demo.CODEC_FAMILIES)
def test_generated_codec_round_trip_equals_the_reference(family: str) -> None:
    """One 3-page request (last page partly filled) on scattered hot pages, encoded into pinned
    slots by the generated codec, decoded into other hot pages; compared with kvgen.reference."""
    require_registry()
    spec_path = SPECS_DIR / f"{family}.yaml"
    spec = load_spec(spec_path)
    layout = family_layout(spec)
    lc = layout.lifecycles[0]
    geometry = CacheGeometry.from_spec(spec, layout)
    device = torch.device("cuda")
    hot = HotPool(geometry, 8, device)
    config = demo.config_from_args(gpu_args())
    codec, where = open_codec(config, spec_path, family, layout, hot.pools)
    assert where["backend"] == "generated (registry)"
    try:
        sources, slots, targets = [6, 1, 3], [2, 0, 3], [0, 7, 4]
        tokens = 3 * spec.tokens_per_block - 5
        hot.write(sources, KVGenerator(geometry, 11, device).paged(3, tokens), geometry.buffers)
        cold = ColdTier(4, lc.cold_page_bytes, pinned=True)
        codec.encode(cold.storage, pairs_tensor(slots, sources))
        torch.cuda.synchronize()
        record_bytes = layout.record.bytes
        src = torch.tensor(sources, device=device)
        records = []
        for j, layer in enumerate(lc.layers):
            buffers = {b.name: hot.pools[layer][i][src] for i, b in enumerate(layout.record.buffers)}
            want = encode_records(layout.record, buffers, {})
            got = cold.storage[slots][:, j * record_bytes:(j + 1) * record_bytes].to(device)
            assert torch.equal(got, want), f"{family} layer {layer}: encoded bytes differ from the reference"
            records.append(want)
        codec.decode(cold.storage, pairs_tensor(targets, slots))
        torch.cuda.synchronize()
        dst = torch.tensor(targets, device=device)
        for j, layer in enumerate(lc.layers):
            decoded, _ = decode_records(layout.record, records[j], spec.dtype)
            for i, b in enumerate(layout.record.buffers):
                got = hot.pools[layer][i][dst].reshape(len(targets), -1).view(torch.uint8)
                want = decoded[b.name].reshape(len(targets), -1).view(torch.uint8)
                assert torch.equal(got, want), f"{family} layer {layer} {b.name}: decode differs from the reference"
    finally:
        codec.close()
