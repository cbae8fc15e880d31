"""The real templates over every shipped spec: generated/ is current, rendering is deterministic,
every family's generated CUDA compiles for every target, SM100-family code uses the hardware
FP4/FP8 conversions (checked in the SASS) while sm_90a uses none, decode_pages compiles its
double-buffered decode (the next record in flight) without spills, and decode_min_blocks caps
decode's registers alone.

Compiles are device-only (`nvcc -cubin`: ptxas validates every kernel) so the whole grid of
families x targets stays within a few minutes on two cores; `kvgen build` links the same sources
into the shared libraries.
"""

from __future__ import annotations

import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvgen.build.nvcc import default_nvcc_candidates, find_toolchains, gencode, parse_ptxas, toolchain_for
from kvgen.build.pipeline import check_generated
from kvgen.kernels import INCLUDE_DIRS
from kvgen.render.source import render_family
from kvgen.spec.schema import load_spec
from kvgen.tuning.costmodel.features import parse_sass

from .conftest import ROOT, SPECS_DIR

SPECS = sorted(SPECS_DIR.glob("*.yaml"))
TARGETS = ("sm_90a", "sm_100a", "sm_103a", "sm_107a")


def test_generated_is_current():
    stale = check_generated(SPECS, ROOT / "generated")
    assert stale == [], f"generated/ is stale; run: kvgen build --render-only ({stale})"


@pytest.mark.parametrize("path", SPECS[:4], ids=[p.stem for p in SPECS[:4]])
def test_render_is_deterministic(path):
    spec = load_spec(path)
    assert render_family(spec) == render_family(spec)


@pytest.fixture(scope="module")
def toolchains():
    found = find_toolchains(default_nvcc_candidates())
    if not found:
        pytest.skip("no nvcc found")
    return found


def _cubin(source: Path, arch: str, toolchains, out: Path) -> tuple[str, str]:
    toolchain = toolchain_for(arch, toolchains)
    cmd = [toolchain.nvcc, "-cubin", "-O3", "-std=c++17", "--fmad=false", "-gencode", gencode(arch), *[f"-I{d}" for d in INCLUDE_DIRS],
           "-o", str(out), str(source)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    return source.parent.name, proc.stderr if proc.returncode else ""


def test_every_family_compiles_for_every_target(tmp_path, toolchains):
    sources = sorted((ROOT / "generated").glob("*/*.cu"))
    assert sources, "generated/ holds no CUDA sources"
    jobs = [(src, arch) for src in sources for arch in TARGETS]
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(
            lambda job: _cubin(job[0], job[1], toolchains, tmp_path / f"{job[0].parent.name}-{job[0].stem}-{job[1]}.cubin"),
            jobs))
    failures = [f"{family}: {log[:2000]}" for family, log in results if log]
    assert not failures, "\n".join(failures)


def _sass(cubin: Path) -> str:
    import triton  # ships cuobjdump (and nvdisasm); PyPI has no nvdisasm that knows sm_107a

    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout


def _ptx(source: Path, arch: str, toolchains, out: Path) -> str:
    toolchain = toolchain_for(arch, toolchains)
    cmd = [toolchain.nvcc, "-ptx", "-O3", "-std=c++17", "--fmad=false", "-arch", arch.replace("sm_", "compute_"),
           *[f"-I{d}" for d in INCLUDE_DIRS], "-o", str(out), str(source)]
    subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600)
    return out.read_text()


@pytest.mark.parametrize("arch, hardware", [("sm_90a", False), ("sm_100a", True), ("sm_103a", True)])
def test_sm100_family_uses_hardware_conversions(tmp_path, toolchains, arch, hardware):
    """The SASS of the codec: F2FP...E2M1 (the FP4 convert) on SM100-family targets only."""
    source = ROOT / "generated" / "qwen3-8b" / "codec.cu"
    out = tmp_path / f"codec-{arch}.cubin"
    _, log = _cubin(source, arch, toolchains, out)
    assert not log, log
    assert ("F2FP.SATFINITE.E2M1" in _sass(out)) == hardware


def test_sm107a_uses_hardware_conversions(tmp_path, toolchains):
    """sm_107a (Rubin): no disassembler here knows it, so the PTX is checked (ptxas accepted it in
    test_every_family_compiles_for_every_target)."""
    ptx = _ptx(ROOT / "generated" / "qwen3-8b" / "codec.cu", "sm_107a", toolchains, tmp_path / "codec.ptx")
    assert "cvt.rn.satfinite.e2m1x2.f32" in ptx


def _qwen_codec(**params: int) -> str:
    """qwen3-8b's codec.cu rendered with these codec params (the others at their defaults)."""
    return render_family(load_spec(SPECS_DIR / "qwen3-8b.yaml"), params={"codec": params})["qwen3-8b/codec.cu"]


def _codec_pages(**params: int) -> int:
    found = re.search(r"struct codec::DecodePages<family::Layer> \{\n  static constexpr int kPages = (\d+);",
                      _qwen_codec(**params))
    assert found, "codec.cu has no DecodePages specialization"
    return int(found.group(1))


def test_decode_pages_renders_its_trait_and_one_page_under_the_register_copy():
    assert _codec_pages() == 1 and _codec_pages(decode_pages=2) == 2
    assert _codec_pages(decode_load=2, decode_pages=4) == 4
    assert _codec_pages(decode_load=0, decode_pages=4) == 1   # nothing in flight to overlap


@pytest.mark.parametrize("decode_load, decode_pages", [(1, 1), (2, 1), (1, 2), (1, 4), (2, 2), (2, 4)])
def test_paged_decode_keeps_the_next_record_in_flight_without_spills(tmp_path, toolchains, decode_load,
                                                                     decode_pages):
    """With several pages per CTA a decode thread waits for the older of two cp.async groups
    (DEPBAR.LE SB0, 0x1) while the next record loads; with one it waits for all of them, as before.
    The bulk route keeps its barrier wait (and cp.async for host slots). ptxas spills nothing."""
    source = tmp_path / "codec.cu"
    source.write_text(_qwen_codec(decode_load=decode_load, decode_pages=decode_pages))
    cubin = tmp_path / "codec.cubin"
    cmd = [toolchain_for("sm_90a", toolchains).nvcc, "-cubin", "-O3", "-std=c++17", "--fmad=false", "-Xptxas", "-v",
           "-gencode", gencode("sm_90a"), *[f"-I{d}" for d in INCLUDE_DIRS], "-o", str(cubin), str(source)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[:2000]
    resources = parse_ptxas(proc.stderr)
    assert resources and all(r.spill_stores == 0 and r.spill_loads == 0 for r in resources.values())
    decoders = {name: insns for name, insns in parse_sass(_sass(cubin)).items() if "decode_kernel" in name}
    assert len(decoders) == 2   # host and device pair indices
    for insns in decoders.values():
        waits = {(op, operands.replace(" ", "")) for _, op, operands, _ in insns if op.startswith("DEPBAR")}
        assert (("DEPBAR.LE", "SB0,0x1") in waits) == (decode_pages > 1)
        assert any(op.startswith("SYNCS.PHASECHK") for _, op, _, _ in insns) == (decode_load == 2)


def _ptxas(source_text: str, tmp_path: Path, toolchains) -> dict:
    source = tmp_path / "codec.cu"
    source.write_text(source_text)
    cmd = [toolchain_for("sm_90a", toolchains).nvcc, "-cubin", "-O3", "-std=c++17", "--fmad=false", "-Xptxas", "-v",
           "-gencode", gencode("sm_90a"), *[f"-I{d}" for d in INCLUDE_DIRS], "-o", str(tmp_path / "codec.cubin"),
           str(source)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[:2000]
    return parse_ptxas(proc.stderr)


def test_decode_min_blocks_caps_the_decode_kernel_alone(tmp_path, toolchains):
    """deepseek-v4-csa at its tuned 256 threads and min_blocks 4: decode_min_blocks 6 takes decode
    from 48 registers to at most 40 (6 CTAs of 256 threads) while encode keeps its own cap."""
    spec = load_spec(SPECS_DIR / "deepseek-v4-csa.yaml")
    tuned = {"threads": 256, "min_blocks": 4, "hot_batch": 4, "rounding": 4, "decode_route": 1, "decode_split": 2}

    def registers(decode_min_blocks: int) -> dict[str, int]:
        text = render_family(spec, params={"codec": {**tuned, "decode_min_blocks": decode_min_blocks}})[
            "deepseek-v4-csa/codec.cu"]
        out = tmp_path / str(decode_min_blocks)
        out.mkdir()
        by_kernel = {}
        for name, r in _ptxas(text, out, toolchains).items():
            kind = "decode" if "decode_kernel" in name else "encode" if "encode_kernel" in name else None
            if kind:
                by_kernel[kind] = max(by_kernel.get(kind, 0), r.registers)
        return by_kernel

    shared, own = registers(-1), registers(6)
    assert shared["decode"] > 40 >= own["decode"]
    assert own["encode"] == shared["encode"]
