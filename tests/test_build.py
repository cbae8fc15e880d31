"""Render -> compile -> cache -> registry, on the CPU build machine.

Templates here are tiny stand-ins written by the tests (the real ones belong to other modules), so
these tests pin the pipeline's contract, not kernel semantics. Real compiles use nvcc for sm_90a
(the system 13.0 toolkit) and sm_107a (the pip 13.5 one); each takes about a second.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from dataclasses import replace
from pathlib import Path

import pytest

from kvgen import __version__
from kvgen.artifacts.manifest import (
    ABI_VERSION,
    FORMAT_VERSION,
    ArtifactEntry,
    FamilyEntry,
    Manifest,
    OpEntry,
    RegistryError,
    read_manifest,
    write_manifest,
)
from kvgen.build.cache import META, entry_dir, failed_dir, get_or_build, load_entry
from kvgen.build.nvcc import (
    CompileError,
    Toolchain,
    ToolchainError,
    cache_key,
    compile_shared_library,
    default_nvcc_candidates,
    find_toolchains,
    gencode,
    parse_ptxas,
    pip_nvcc_paths,
    probe_toolchain,
    real_nvcc,
    toolchain_for,
)
from kvgen.build.pipeline import build, check_generated, load_spec_source
from kvgen.cli import main
from kvgen.files import write_if_different
from kvgen.lower.plan import default_params, fold_codec_params, plans_for
from kvgen.lower.triattention import require_scorable
from kvgen.render.source import TEMPLATES_DIR, RenderError, header, render, render_family
from kvgen.runtime.pack import PackLibrary
from kvgen.runtime.select import SelectLibrary
from kvgen.spec.schema import load_spec

ROOT = Path(__file__).resolve().parents[1]
SPECS = ROOT / "specs"
FAMILY = "llama-3.1-8b"          # GQA with TriAttention: renders codec.cu and compact.cu
SYSTEM_NVCC = Path("/usr/local/bin/nvcc")

CODEC = """{{ header }}
#include <cuda_runtime.h>
// record of {{ g.record_bytes }} bytes, {{ g.buffers | length }} buffers
__global__ void {{ symbol }}_codec_kernel(unsigned char* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = (unsigned char)({{ g.record_bytes }} & 0xff);
}
extern "C" int {{ symbol }}_codec_launch(unsigned char* out, int n, cudaStream_t stream) {
  {{ symbol }}_codec_kernel<<<(n + {{ p.threads }} - 1) / {{ p.threads }}, {{ p.threads }}, 0, stream>>>(out, n);
  return (int)cudaGetLastError();
}
"""

COMPACT = """{{ header }}
#include <cuda_runtime.h>
__global__ void {{ symbol }}_compact_kernel(float* x, int n) {
  __shared__ float tile[{{ p.tile_tokens }}];
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) { tile[threadIdx.x % {{ p.tile_tokens }}] = x[i]; x[i] = tile[threadIdx.x % {{ p.tile_tokens }}]; }
}
extern "C" int {{ symbol }}_compact_heads() { return {{ g.kv_heads }}; }
"""

PACK = """{{ header }}
BLOCK = {{ p.block }}
"""

SCORE = """{{ header }}
THREADS = {{ p.threads }}
"""

SELECT = """{{ header }}
RADIX_BITS = {{ p.radix_bits }}
"""

TINY_CU = """#include <cuda_runtime.h>
__global__ void add_one(float* x, int n) { int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) x[i] += 1.f; }
extern "C" int tiny_launch(float* x, int n) { add_one<<<(n + 255) / 256, 256>>>(x, n); return (int)cudaGetLastError(); }
"""


@pytest.fixture
def templates(tmp_path: Path) -> Path:
    d = tmp_path / "templates"
    d.mkdir()
    (d / "codec.cu.j2").write_text(CODEC)
    (d / "compact.cu.j2").write_text(COMPACT)
    (d / "pack.py.j2").write_text(PACK)
    (d / "score.py.j2").write_text(SCORE)
    (d / "select.py.j2").write_text(SELECT)
    return d


@pytest.fixture(scope="module")
def toolchains() -> list[Toolchain]:
    found = find_toolchains([SYSTEM_NVCC, *pip_nvcc_paths()])
    if not any(t.supports("sm_90a") for t in found):
        pytest.skip("no nvcc for sm_90a")
    return found


def _spec():
    return load_spec(SPECS / f"{FAMILY}.yaml")


def codec_defaults() -> dict[str, int]:
    """The declared codec defaults as this family compiles them (fold_codec_params: the packed rounding
    route its hot dtype has)."""
    return fold_codec_params(_spec(), default_params("codec"))


def _fake_toolchain(**changes) -> Toolchain:
    base = Toolchain(nvcc="/opt/cuda/bin/nvcc", version="13.0.88", version_sha256="a" * 64,
                     archs=("sm_90", "sm_100", "sm_103"), host_cc="/usr/bin/g++-12", host_cc_version="g++ 12.2.0")
    return replace(base, **changes)


# ---------------------------------------------------------------- render


def test_render_is_deterministic_and_starts_with_header(templates: Path) -> None:
    first = render_family(_spec(), templates)
    second = render_family(_spec(), templates)
    assert first == second
    assert sorted(first) == [f"{FAMILY}/codec.cu", f"{FAMILY}/compact.cu", f"{FAMILY}/pack.py", f"{FAMILY}/score.py",
                                                                 f"{FAMILY}/select.py"]
    for plan in plans_for(_spec()):
        text = first[f"{FAMILY}/{plan.template[:-3]}"]
        assert text.startswith(header(plan) + "\n")
        assert plan.key() in text.splitlines()[4]
    assert "kvgen_llama_3_1_8b_codec_launch" in first[f"{FAMILY}/codec.cu"]


def test_header_comment_syntax_follows_the_output_kind(templates: Path) -> None:
    (templates / "pack.py.j2").write_text("x = {{ p.threads }}\n")   # no {{ header }}: prepended
    plan = replace(plans_for(_spec())[0], template="pack.py.j2")
    text = render(plan, templates)
    assert text.startswith("# Generated by kvgen: do not edit; regenerate with `kvgen build`.\n# family:")
    assert text.endswith("x = 256\n")


def test_missing_variable_is_an_error_naming_the_template(templates: Path) -> None:
    (templates / "codec.cu.j2").write_text("{{ header }}\nint a = 1;\nint b = {{ g.no_such_field }};\n")
    with pytest.raises(RenderError, match=r"'codec.cu.j2' line 3 .*no_such_field"):
        render_family(_spec(), templates)


def test_missing_template_lists_the_available_ones(tmp_path: Path, templates: Path) -> None:
    (templates / "compact.cu.j2").unlink()
    with pytest.raises(RenderError, match=r"'compact.cu.j2' not found .*available: codec.cu.j2"):
        render_family(_spec(), templates)


def test_write_if_different(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "a.cu"
    assert write_if_different(path, "one\n")
    os.utime(path, (1_000_000, 1_000_000))
    assert not write_if_different(path, "one\n")
    assert path.stat().st_mtime == 1_000_000            # untouched when equal
    assert write_if_different(path, "two\n")
    assert path.read_text() == "two\n"
    assert [p.name for p in path.parent.iterdir()] == ["a.cu"]   # no temp files left


def test_check_generated_lists_changed_missing_and_leftover_files(tmp_path: Path, templates: Path) -> None:
    generated = tmp_path / "generated"
    source = load_spec_source(SPECS / f"{FAMILY}.yaml")
    assert check_generated([source], generated, templates) == [f"{FAMILY}/codec.cu", f"{FAMILY}/compact.cu", f"{FAMILY}/pack.py", f"{FAMILY}/score.py",
                                                                 f"{FAMILY}/select.py"]
    args = ["--specs", str(SPECS), "build", "--family", FAMILY, "--generated", str(generated),
            "--templates", str(templates)]
    assert main([*args, "--render-only"]) == 0
    assert main([*args, "--check"]) == 0
    (generated / FAMILY / "codec.cu").write_text("edited\n")
    (generated / FAMILY / "old.cu").write_text("from a removed template\n")
    assert check_generated([source], generated, templates) == [f"{FAMILY}/codec.cu", f"{FAMILY}/old.cu"]
    assert main([*args, "--check"]) == 1


# ---------------------------------------------------------------- toolchains and keys


def test_gencode_maps_arch_variants() -> None:
    assert gencode("sm_90a") == "arch=compute_90a,code=sm_90a"
    assert gencode("sm_100f") == "arch=compute_100f,code=sm_100f"
    assert gencode("sm_107a") == "arch=compute_107a,code=sm_107a"


def test_cache_key_changes_with_every_real_input() -> None:
    sources = {"fam/codec.cu": "int x;\n", "csrc/a.cuh": "#pragma once\n"}
    flags = ["-O3", "--fmad=false"]
    base = cache_key(sources, flags, _fake_toolchain(), "sm_90a", 1)
    variants = [
        cache_key({**sources, "fam/codec.cu": "int y;\n"}, flags, _fake_toolchain(), "sm_90a", 1),
        cache_key({**sources, "csrc/a.cuh": "#pragma once //\n"}, flags, _fake_toolchain(), "sm_90a", 1),
        cache_key(sources, [*flags, "-G"], _fake_toolchain(), "sm_90a", 1),
        cache_key(sources, flags, _fake_toolchain(version="13.0.89"), "sm_90a", 1),
        cache_key(sources, flags, _fake_toolchain(nvcc="/other/bin/nvcc"), "sm_90a", 1),
        cache_key(sources, flags, _fake_toolchain(version_sha256="b" * 64), "sm_90a", 1),
        cache_key(sources, flags, _fake_toolchain(host_cc_version="g++ 13.1"), "sm_90a", 1),
        cache_key(sources, flags, _fake_toolchain(), "sm_100a", 1),
        cache_key(sources, flags, _fake_toolchain(), "sm_90a", 2),
    ]
    assert len({base, *variants}) == len(variants) + 1
    # Order of the mapping and the arch list of the toolchain are not inputs.
    assert cache_key(dict(reversed(list(sources.items()))), flags, _fake_toolchain(archs=()), "sm_90a", 1) == base


def test_toolchain_identity_ignores_how_nvcc_was_reached(tmp_path: Path) -> None:
    if not SYSTEM_NVCC.exists():
        pytest.skip("no system nvcc")
    real = real_nvcc(SYSTEM_NVCC)
    wrapper = tmp_path / "bin" / "nvcc"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nexec {real} "$@"\n')
    wrapper.chmod(0o755)
    link = tmp_path / "link-nvcc"
    link.symlink_to(real)
    probes = {probe_toolchain(p) for p in (SYSTEM_NVCC, wrapper, link, real)}
    assert len(probes) == 1
    (toolchain,) = probes
    assert toolchain.nvcc == real and not real.endswith("/usr/local/bin/nvcc")
    assert toolchain.supports("sm_90a") and toolchain.supports("sm_100f")
    # Same key whichever directory is on PATH, and whatever the source files' mtimes are.
    assert len({cache_key({"a.cu": "x"}, [], t, "sm_90a", 1) for t in probes}) == 1


def test_path_string_does_not_change_the_found_toolchain() -> None:
    if not SYSTEM_NVCC.exists():
        pytest.skip("no system nvcc")
    real_dir = str(Path(real_nvcc(SYSTEM_NVCC)).parent)
    via_wrapper = find_toolchains(default_nvcc_candidates(search_path=f"/nonexistent:{SYSTEM_NVCC.parent}"))
    via_real = find_toolchains(default_nvcc_candidates(search_path=f"{real_dir}:/usr/bin"))
    assert via_wrapper[0] == via_real[0]


def test_toolchain_selection(toolchains: list[Toolchain]) -> None:
    assert toolchain_for("sm_90a", toolchains).release == "13.0" or not SYSTEM_NVCC.exists()
    if any(t.supports("sm_107a") for t in toolchains):
        assert toolchain_for("sm_107a", toolchains).release == "13.5"
    with pytest.raises(ToolchainError, match=r'no nvcc supports sm_107a.*pip install "nvidia-cuda-nvcc==13\.5\.\*"'):
        toolchain_for("sm_107a", [_fake_toolchain()])
    with pytest.raises(ToolchainError, match="kvgen\\[nvcc-rubin\\]"):
        toolchain_for("sm_107a", [])
    assert toolchain_for("sm_100f", [_fake_toolchain()]).version == "13.0.88"
    with pytest.raises(ToolchainError, match="unknown arch"):
        toolchain_for("sm90", [_fake_toolchain()])


def test_parse_ptxas() -> None:
    log = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z1kPf' for 'sm_90a'
ptxas info    : Function properties for _Z1kPf
    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 2048 bytes smem, 360 bytes cmem[0]
ptxas info    : Compiling entry function 'plain' for 'sm_90a'
ptxas info    : Function properties for plain
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 8 registers, used 0 barriers, 360 bytes cmem[0]
"""
    kernels = parse_ptxas(log)
    assert kernels["_Z1kPf"].registers == 40 and kernels["_Z1kPf"].smem_bytes == 2048
    assert (kernels["_Z1kPf"].stack_bytes, kernels["_Z1kPf"].spill_stores, kernels["_Z1kPf"].spill_loads) == (16, 8, 4)
    assert kernels["plain"].registers == 8 and kernels["plain"].smem_bytes == 0


# ---------------------------------------------------------------- compile


def test_compile_shared_library_sm90a(tmp_path: Path, toolchains: list[Toolchain]) -> None:
    source = tmp_path / "tiny.cu"
    source.write_text(TINY_CU)
    out = tmp_path / "libtiny.so"
    result = compile_shared_library([source], "sm_90a", [], out, toolchain_for("sm_90a", toolchains), ptx=True)
    assert out.is_file() and out.stat().st_size > 0
    assert result.kernels["_Z7add_onePfi"].registers > 0
    assert "code=sm_90a" in " ".join(result.command) and "--fmad=false" in result.command
    (ptx,) = result.ptx
    assert ".target sm_90a" in ptx.read_text()


def test_compile_sm107a_with_the_pip_toolchain(tmp_path: Path, toolchains: list[Toolchain]) -> None:
    if not any(t.supports("sm_107a") for t in toolchains):
        pytest.skip("no nvcc for sm_107a")
    source = tmp_path / "tiny.cu"
    source.write_text(TINY_CU)
    result = compile_shared_library([source], "sm_107a", [], tmp_path / "lib.so", toolchain_for("sm_107a", toolchains))
    assert "_Z7add_onePfi" in result.kernels


def test_compile_error_carries_log_command_and_source(tmp_path: Path, toolchains: list[Toolchain]) -> None:
    source = tmp_path / "bad.cu"
    source.write_text("__global__ void k() { undefined_thing(); }\n")
    with pytest.raises(CompileError) as info:
        compile_shared_library([source], "sm_90a", [], tmp_path / "lib.so", toolchain_for("sm_90a", toolchains))
    assert "undefined_thing" in info.value.log
    assert info.value.sources == (source,) and info.value.command[0].endswith("nvcc")
    assert not info.value.resource_overflow


# ---------------------------------------------------------------- cache


def _counting_build(counter: Path, delay: float = 0.0):
    def build_into(tmp: Path) -> dict:
        time.sleep(delay)
        with open(counter, "a") as f:
            f.write(f"{os.getpid()}\n")
        (tmp / "lib.so").write_bytes(b"artifact")
        return {"artifact": "lib.so"}
    return build_into


def test_cache_hit_after_build(tmp_path: Path) -> None:
    entry = entry_dir(tmp_path, __version__, "sm_90a", "fam", "k" * 64)
    counter = tmp_path / "count"
    meta, hit = get_or_build(entry, "k" * 64, _counting_build(counter))
    assert not hit and meta["key"] == "k" * 64 and (entry / META).is_file()
    again, hit = get_or_build(entry, "k" * 64, _counting_build(counter))
    assert hit and again == meta
    assert counter.read_text().count("\n") == 1


def test_killed_build_leftovers_are_never_loaded_and_get_rebuilt(tmp_path: Path) -> None:
    key = "c" * 64
    entry = entry_dir(tmp_path, __version__, "sm_90a", "fam", key)
    entry.mkdir(parents=True)                                  # published, killed before meta.json
    (entry / "lib.so").write_bytes(b"half-written")
    temp = entry.with_name(entry.name + ".tmp-dead")            # killed mid-compile
    temp.mkdir()
    (temp / "lib.so").write_bytes(b"partial")
    assert load_entry(entry, key) is None
    meta, hit = get_or_build(entry, key, _counting_build(tmp_path / "count"))
    assert not hit and (entry / "lib.so").read_bytes() == b"artifact"
    assert not temp.exists()
    # A corrupted artifact under a valid marker is rebuilt, not loaded.
    (entry / "lib.so").write_bytes(b"bit rot")
    meta, hit = get_or_build(entry, key, _counting_build(tmp_path / "count"))
    assert not hit and (entry / "lib.so").read_bytes() == b"artifact"


def test_failed_build_publishes_nothing_and_keeps_its_directory(tmp_path: Path) -> None:
    key = "f" * 64
    entry = entry_dir(tmp_path, __version__, "sm_90a", "fam", key)

    def failing(tmp: Path) -> dict:
        (tmp / "src.cu").write_text("broken")
        raise RuntimeError("compiler said no")

    with pytest.raises(RuntimeError, match="compiler said no"):
        get_or_build(entry, key, failing)
    assert not entry.exists()
    assert (failed_dir(entry) / "src.cu").read_text() == "broken"
    assert not list(entry.parent.glob("*.tmp-*"))


def _race(args: tuple[str, str]) -> tuple[bool, str]:
    cache, counter = map(Path, args)
    entry = entry_dir(cache, __version__, "sm_90a", "fam", "r" * 64)
    meta, hit = get_or_build(entry, "r" * 64, _counting_build(counter, delay=0.5))
    return hit, meta["artifact_sha256"]


def test_concurrent_builds_of_one_key_compile_once(tmp_path: Path) -> None:
    counter = tmp_path / "count"
    with multiprocessing.get_context("fork").Pool(2) as pool:
        results = pool.map(_race, [(str(tmp_path), str(counter))] * 2)
    assert sorted(hit for hit, _ in results) == [False, True]
    assert len({sha for _, sha in results}) == 1
    assert counter.read_text().count("\n") == 1


# ---------------------------------------------------------------- build and registry


def _build(tmp_path: Path, templates: Path, toolchains: list[Toolchain], archs=("sm_90a",), registry="registry",
           backends=("nvcc",), environ=None):
    """The stand-in templates through the nvcc backend (their score module is no CuTe kernel)."""
    return build([SPECS / f"{FAMILY}.yaml"], list(archs), tmp_path / "generated", tmp_path / "cache", jobs=2,
                 toolchains=toolchains, registry_dir=tmp_path / registry, templates_dir=templates,
                 kernels_dir=tmp_path / "kernels", tuning_dir=tmp_path / "tuning", tuning_environ=environ or {},
                 backends=backends)


def test_build_then_rebuild_is_all_cache_hits(tmp_path: Path, templates: Path, toolchains: list[Toolchain]) -> None:
    report = _build(tmp_path, templates, toolchains, archs=("sm_90a", "sm_100f"))
    assert [(o.arch, o.status) for o in report.outcomes] == [("sm_100f", "skipped"), ("sm_90a", "built")]
    assert report.ok and len(report.rendered) == 5
    manifest = read_manifest(tmp_path / "registry" / "sm_90a" / "manifest.json")
    entry = manifest.family(FAMILY)
    (library,) = entry.artifacts
    assert entry.abi_version == ABI_VERSION and library.toolchain["nvcc"].startswith("13.0")
    assert [op.op for op in entry.ops] == ["codec", "compact"] and entry.ops[0].params == codec_defaults()
    assert {op.artifact for op in entry.ops} == {library.file} == {"libkvgen_llama_3_1_8b.so"}
    assert (tmp_path / "registry" / "sm_90a" / library.file).is_file() and library.backend == "nvcc"
    meta = json.loads((report.outcomes[1].artifact.parent / "manifest.json").read_text())
    assert meta["format_version"] == FORMAT_VERSION and meta["families"][0]["artifacts"][0]["file"] == "libkvgen_llama_3_1_8b.so"
    for path in (tmp_path / "generated").rglob("*"):
        os.utime(path, (1, 1))                                   # mtimes are not inputs
    again = _build(tmp_path, templates, toolchains)
    assert [o.status for o in again.outcomes] == ["hit"] and again.rendered == []
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "common.cuh").write_text("#pragma once\n")   # a header change is a new key
    assert [o.status for o in _build(tmp_path, templates, toolchains).outcomes] == ["built"]


def test_tuned_parameters_are_compiled_per_arch_and_recorded(tmp_path: Path, templates: Path,
                                                            toolchains: list[Toolchain]) -> None:
    """The arch's tuned launch parameters reach the compiled source and the manifest; generated/
    keeps the arch-neutral default rendering."""
    report = _build(tmp_path, templates, toolchains,
                    environ={"KVGEN_TUNED_PARAMS": f"{FAMILY}:codec:threads=512,in_flight=2"})
    assert report.ok and report.tuning_notes == [f"KVGEN_TUNED_PARAMS overrides: {FAMILY}:codec:threads=512,in_flight=2"]
    entry = read_manifest(tmp_path / "registry" / "sm_90a" / "manifest.json").family(FAMILY)
    assert entry.op("codec").params == {**codec_defaults(), "threads": 512, "in_flight": 2}
    assert "<<<(n + 256 - 1) / 256, 256" in (tmp_path / "generated" / FAMILY / "codec.cu").read_text()
    kept = next((tmp_path / "cache").rglob("src/codec.cu")).read_text()   # what was compiled
    assert "<<<(n + 512 - 1) / 512, 512" in kept


def test_build_failure_is_reported_with_kept_sources(tmp_path: Path, templates: Path,
                                                     toolchains: list[Toolchain]) -> None:
    (templates / "compact.cu.j2").write_text("{{ header }}\nthis is not C++;\n")
    report = _build(tmp_path, templates, toolchains)
    (outcome,) = report.outcomes
    assert outcome.status == "failed" and not report.ok
    assert "this is not C++" in outcome.error or "error" in outcome.error
    kept = next((tmp_path / "cache").rglob("*.failed"))
    assert (kept / "src" / "compact.cu").is_file() and (kept / "build.log").is_file()
    assert str(kept) in outcome.error
    assert read_manifest(tmp_path / "registry" / "sm_90a" / "manifest.json").families == ()


def _build_in_child(args: tuple[str, str, str]) -> tuple[str, str]:
    tmp, templates, registry = args
    found = find_toolchains([SYSTEM_NVCC, *pip_nvcc_paths()])
    (outcome,) = _build(Path(tmp), Path(templates), found, registry=registry).outcomes
    return outcome.status, outcome.key


def test_concurrent_real_builds_compile_once(tmp_path: Path, templates: Path, toolchains: list[Toolchain]) -> None:
    args = [(str(tmp_path), str(templates), f"registry{i}") for i in range(2)]
    with multiprocessing.get_context("fork").Pool(2) as pool:
        results = pool.map(_build_in_child, args)
    assert sorted(status for status, _ in results) == ["built", "hit"]
    shas = {read_manifest(tmp_path / f"registry{i}" / "sm_90a" / "manifest.json").families[0].artifacts[0].sha256
            for i in range(2)}
    assert len(shas) == 1


def _fake_registry(tmp_path: Path) -> Path:
    arch_dir = tmp_path / "registry" / "sm_90a"
    arch_dir.mkdir(parents=True)
    (arch_dir / "libkvgen_fam.so").write_bytes(b"library bytes")
    from kvgen.files import file_sha256

    entry = FamilyEntry(family="fam", arch="sm_90a", symbol="kvgen_fam", spec_sha256="s" * 64,
                        ops=(OpEntry("codec", "libkvgen_fam.so", "codec.cu.j2", "p" * 64, {"threads": 256}),),
                        artifacts=(ArtifactEntry("libkvgen_fam.so", file_sha256(arch_dir / "libkvgen_fam.so"), "nvcc",
                                                 "k" * 64, {"nvcc": "13.0.88"}),))
    path = arch_dir / "manifest.json"
    write_manifest(path, Manifest(arch="sm_90a", families=(entry,)))
    return path


def test_manifest_round_trip_and_tamper(tmp_path: Path) -> None:
    path = _fake_registry(tmp_path)
    assert read_manifest(path).family("fam").ops[0].params == {"threads": 256}
    (path.parent / "libkvgen_fam.so").write_bytes(b"library bytez")
    with pytest.raises(RegistryError) as info:
        read_manifest(path)
    message = str(info.value)
    assert "sha256 mismatch" in message and str(path) in message
    assert "kvgen build --arch sm_90a --family fam" in message
    (path.parent / "libkvgen_fam.so").unlink()
    with pytest.raises(RegistryError, match="artifact missing.*kvgen build --arch sm_90a --family fam"):
        read_manifest(path)


def test_manifest_version_checks(tmp_path: Path) -> None:
    path = _fake_registry(tmp_path)
    with pytest.raises(RegistryError, match=r"written by kvgen .* this is kvgen 9\.9.*kvgen build --arch sm_90a"):
        read_manifest(path, kvgen_version="9.9")
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "format_version": 99}))
    with pytest.raises(RegistryError, match=f"{path}: format version 99"):
        read_manifest(path)
    path.write_text("{not json")
    with pytest.raises(RegistryError, match="not a kvgen manifest.*kvgen build --arch sm_90a"):
        read_manifest(path)


def test_cli_show_config_and_clear_cache(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cache = tmp_path / "cache"
    (cache / __version__ / "sm_90a").mkdir(parents=True)
    (cache / "unrelated").mkdir()
    assert main(["show-config", "--cache-dir", str(cache)]) == 0
    out = capsys.readouterr().out
    assert "torch" in out and str(cache) in out
    assert main(["clear-cache", "--cache-dir", str(cache)]) == 0
    assert not (cache / __version__).exists() and (cache / "unrelated").exists()


def test_every_artifact_is_published_and_a_failed_one_left_out(tmp_path: Path, templates: Path,
                                                              toolchains: list[Toolchain]) -> None:
    """The packer and the selection are published as their AOT libraries (the real templates: the
    build compiles their Triton kernels); an op whose artifact failed is not listed, the family's
    other artifacts still are."""
    (templates / "compact.cu.j2").write_text("{{ header }}\nthis is not C++;\n")
    for name in ("pack.py.j2", "select.py.j2"):
        (templates / name).write_text((TEMPLATES_DIR / name).read_text())
    report = _build(tmp_path, templates, toolchains, backends=("nvcc", "triton-aot"))
    assert [(o.backend, o.status) for o in report.outcomes] == [("nvcc", "failed"), ("triton-aot", "built"),
                                                                ("triton-aot", "built")]
    entry = read_manifest(tmp_path / "registry" / "sm_90a" / "manifest.json").family(FAMILY)
    pack, select = entry.artifacts
    assert [op.op for op in entry.ops] == ["pack", "select"]
    assert entry.op("pack").artifact == pack.file == "libkvgen_llama_3_1_8b_pack.so"
    assert entry.op("select").artifact == select.file == "libkvgen_llama_3_1_8b_select.so"
    for artifact in (pack, select):
        assert artifact.backend == "triton-aot" and set(artifact.toolchain) == {"nvcc", "triton"}
        published = tmp_path / "registry" / "sm_90a" / artifact.file
        assert published.stat().st_mode & 0o777 == 0o755   # a shared library, as the nvcc ones
    spec = _spec()
    library = SelectLibrary(tmp_path / "registry" / "sm_90a" / select.file, family=FAMILY)
    assert library.arch == "sm_90a" and library.scored_layers == tuple(require_scorable(spec).scored_layers)
    packer = PackLibrary(tmp_path / "registry" / "sm_90a" / pack.file, family=FAMILY)
    assert (packer.num_layers, packer.kv_heads, packer.arch) == (spec.layers, spec.kv_heads, "sm_90a")
