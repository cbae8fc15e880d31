"""TriAttention score kernels on the build machine: spec -> TriGeometry mapping, the rendered CuTe
DSL module, AOT compile + export + link for every target, and the loadable C ABI.

Compile grid (measured here, 2 cores: every TriAttention family for sm_90a, sm_100a, sm_103a and
sm_107a took 63 s, over the 60 s CI budget): CI compiles every family for sm_90a (the arch that
runs) and one family per other arch (sm_100a, sm_100f, sm_103a, sm_107a: qwen3-8b, the shape the
SM100 family ships with); ``-m slow`` compiles every family for every SM100-family target. The
libraries are compiled once per session into a temporary cache, through the build's
``compile_many`` (one export process per arch); the registry ``build()`` publishes is checked on
the session's real qwen3-8b registry (``tests.test_runtime_registry.real_registry``).
"""

from __future__ import annotations

import ctypes
import importlib.util
import subprocess
from pathlib import Path

import pytest
import torch

from kvgen.arch import ARCHS
from kvgen.artifacts.manifest import manifest_path, read_manifest
from kvgen.build import pipeline
from kvgen.build.compile import Toolchains, compile_many
from kvgen.build.cute_aot import (
    CuteCompileError,
    embedded_sm_versions,
    find_cute_toolchain,
    score_cache_key,
    source_texts,
)
from kvgen.build.job import BuildJob, SpecSource, family_jobs
from kvgen.files import file_sha256
from kvgen.lower.plan import default_params, score_geometry, score_plan
from kvgen.lower.triattention import calibration_defaults, require_scorable, tri_geometry
from kvgen.reference.triattention import GeometryError, load_calibration, save_calibration, synthetic_calibration
from kvgen.reference.triattention_calib import rope_freq_scale_sq, rope_omega
from kvgen.render.source import render
from kvgen.runtime.lookup import RuntimeRegistry
from kvgen.runtime.pack import MovePacker
from kvgen.runtime.score import ScoreLibrary
from kvgen.runtime.select import Selector
from kvgen.spec.schema import SpecError, load_spec, parse_spec
from kvgen.tuning.costmodel.features import embedded_cubin

from .test_runtime_registry import real_registry

ROOT = Path(__file__).resolve().parents[1]
SPECS = ROOT / "specs"
ALL_SPECS = {p.stem: load_spec(p) for p in sorted(SPECS.glob("*.yaml"))}
TRI_FAMILIES = sorted(name for name, spec in ALL_SPECS.items() if spec.triattention.enabled)
MLA_FAMILIES = sorted(name for name, spec in ALL_SPECS.items() if spec.attention in ("mla", "csa"))
OTHER_ARCHS = ("sm_100a", "sm_100f", "sm_103a", "sm_107a")
PROBE_FAMILY = "qwen3-8b"
EXPORTED = {"kvgen_score", "kvgen_score_abi_version", "kvgen_score_family_name", "kvgen_score_arch",
            "kvgen_score_last_error", "kvgen_score_query_geometry", "kvgen_score_check_device_errors"}
ALLOWED_NEEDED = {"libc.so.6", "libm.so.6", "libstdc++.so.6", "libgcc_s.so.1", "ld-linux-x86-64.so.2"}


def _spec_text(**overrides: str) -> str:
    base = {
        "name": "toy", "attention": "gqa", "layers": "4", "query_heads": "8", "kv_heads": "2", "head_dim": "128",
        "tokens_per_block": "16", "layout": "HND", "dtype": "bf16",
    }
    base.update(overrides)
    rope = base.pop("rope", "  placement: full\n  pairing: half\n")
    extra = base.pop("extra", "")
    return "".join(f"{k}: {v}\n" for k, v in base.items()) + "rope:\n" + rope + extra


# ---------------------------------------------------------------- spec -> TriGeometry


def test_geometry_full_rope() -> None:
    g = tri_geometry(ALL_SPECS["qwen3-8b"])
    assert (g.num_layers, g.query_heads, g.kv_heads, g.head_dim) == (36, 32, 8, 128)
    assert (g.rotary_start, g.rotary_dim, g.pairing, g.layout, g.tokens_per_block) == (0, 128, "half", "HND", 32)
    assert g.swa_window == (None,) * 36 and g.scored_layers == tuple(range(36))


def test_geometry_leading_partial_rope() -> None:
    g = tri_geometry(ALL_SPECS["qwen3.5-397b-a17b"])
    assert (g.head_dim, g.rotary_start, g.rotary_dim, g.freqs) == (256, 0, 64, 32)


def test_geometry_trailing_rope_starts_after_the_unrotated_part() -> None:
    spec = parse_spec(_spec_text(rope="  placement: trailing\n  rotary_dim: 64\n  pairing: interleaved\n"))
    g = tri_geometry(spec)
    assert (g.rotary_start, g.rotary_dim, g.pairing) == (64, 64, "interleaved")


def test_geometry_sliding_window_layers() -> None:
    gemma = tri_geometry(ALL_SPECS["gemma-2-9b"])
    assert gemma.swa_window == tuple(4096 if layer % 2 == 0 else None for layer in range(42))
    assert gemma.scored_layers == tuple(range(1, 42, 2))
    gpt = tri_geometry(ALL_SPECS["gpt-oss-20b"])
    assert gpt.swa_window[:4] == (128, None, 128, None) and len(gpt.scored_layers) == 12
    listed = parse_spec(_spec_text(extra="sliding_window:\n  window: 64\n  layers: [0, 3]\n"))
    assert tri_geometry(listed).swa_window == (64, None, None, 64)


def test_geometry_nhd_mqa_and_fp16() -> None:
    falcon = tri_geometry(ALL_SPECS["falcon-7b"])
    assert (falcon.layout, falcon.kv_heads, falcon.group, falcon.head_dim) == ("NHD", 1, 71, 64)
    mistral = ALL_SPECS["mistral-7b"]
    assert tri_geometry(mistral).layout == "NHD" and require_scorable(mistral) is not None


@pytest.mark.parametrize("family", MLA_FAMILIES)
def test_mla_and_csa_are_refused_with_the_reason(family: str) -> None:
    spec = ALL_SPECS[family]
    with pytest.raises(GeometryError, match=r"TriAttention cannot serve attention: (mla|csa) \(one shared latent"):
        tri_geometry(spec)
    with pytest.raises(GeometryError, match="cannot serve"):
        score_plan(spec)   # no score job can be made for it
    text = (SPECS / f"{family}.yaml").read_text() + "triattention:\n  enabled: true\n"
    with pytest.raises(SpecError, match="TriAttention cannot serve attention"):
        parse_spec(text, f"{family}.yaml")


def fp8_family():
    """qwen3-8b-fp8: fp8 E4M3 K, scored since issue 14."""
    return ALL_SPECS["qwen3-8b-fp8"]


def test_fp8_k_is_scorable_and_disabled_families_are_not() -> None:
    fp8 = fp8_family()
    assert fp8.triattention.enabled and require_scorable(fp8) == tri_geometry(fp8)
    assert score_plan(fp8).geometry["dtype"] == "fp8_e4m3"
    text = (SPECS / "qwen3-8b-fp8.yaml").read_text()
    disabled = parse_spec(text.replace("triattention:\n  enabled: true", "triattention:\n  enabled: false"),
                          "qwen3-8b-fp8.yaml")
    with pytest.raises(GeometryError, match="enabled is false"):
        require_scorable(disabled)


def test_calibration_defaults_follow_the_spec_rope(tmp_path: Path) -> None:
    llama = ALL_SPECS["llama-3.1-8b"]
    omega, scale = calibration_defaults(llama)
    scaling = {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    assert torch.equal(omega, rope_omega(128, 500000.0, scaling)) and torch.equal(scale, torch.ones(64))
    _, yarn_scale = calibration_defaults(ALL_SPECS["gpt-oss-20b"])
    assert bool((yarn_scale > 1).all()) and yarn_scale.shape == (32,)
    assert torch.equal(yarn_scale, rope_freq_scale_sq(64, {"type": "yarn", "factor": 32.0}))
    # a calibration made with the family's RoPE loads and validates against the defaults
    geometry = tri_geometry(llama)
    path = tmp_path / "calib.pt"
    save_calibration(synthetic_calibration(geometry, seed=1, theta=500000.0, scaling=scaling), path)
    assert load_calibration(path, geometry, omega, scale).E_q.shape == (32, 32, 64)


# ---------------------------------------------------------------- render


@pytest.mark.parametrize("family", TRI_FAMILIES)
def test_score_module_renders_the_family_constants(family: str) -> None:
    spec = ALL_SPECS[family]
    plan = score_plan(spec)
    text = render(plan)
    assert text == render(score_plan(spec)), "rendering is deterministic"
    assert text.startswith("# Generated by kvgen") and f"plan key: {plan.key()}" in text
    namespace: dict = {}
    exec(compile(text, f"{family}/score.py", "exec"), namespace)  # needs no CUTLASS until make_kernel()
    g = tri_geometry(spec)
    assert namespace["FAMILY"] == family
    assert namespace["GEOMETRY"] == {"dtype": spec.dtype, "layout": g.layout, "head_dim": g.head_dim,
                                     "query_heads": g.query_heads, "kv_heads": g.kv_heads,
                                     "rotary_start": g.rotary_start, "rotary_dim": g.rotary_dim,
                                     "pairing": g.pairing, "tokens_per_block": g.tokens_per_block}
    assert namespace["SCORED_LAYERS"] == g.scored_layers
    assert namespace["PARAMS"] == default_params("score")


def test_score_params_are_checked() -> None:
    spec = ALL_SPECS[PROBE_FAMILY]
    assert score_plan(spec, {"threads": 64}).params["threads"] == 64
    with pytest.raises(ValueError, match="accepted: threads, max_heads, lanes, token_tiles, tokens_per_thread, "
                                         "prefetch"):
        score_plan(spec, {"warps": 4})
    with pytest.raises(ValueError, match="is not one of"):
        score_plan(spec, {"threads": 96})


# ---------------------------------------------------------------- compile, export, link


def _ci_grid() -> list[tuple[str, str]]:
    return [(family, "sm_90a") for family in TRI_FAMILIES] + [(PROBE_FAMILY, arch) for arch in OTHER_ARCHS]


@pytest.fixture(scope="session")
def toolchain():
    try:
        return find_cute_toolchain()
    except CuteCompileError as exc:
        pytest.skip(f"no CuTe DSL toolchain: {exc}")


def score_job(spec, arch: str, params: dict | None = None) -> BuildJob:
    """The score job ``kvgen build`` makes for ``spec`` on ``arch`` (``params``: tuned score params)."""
    jobs = family_jobs(SpecSource(spec, "0" * 64), arch, {"score": params or {}})
    return next(job for job in jobs if job.backend == "cute")


def compile_scores(specs, arch: str, cache: Path, toolchain, params: dict | None = None) -> list:
    return compile_many([score_job(spec, arch, params) for spec in specs], cache, Toolchains(cute=toolchain))


@pytest.fixture(scope="session")
def built(tmp_path_factory, toolchain) -> dict:
    """Compile the CI grid once: {(family, arch): BuildOutcome}, plus the cache directory."""
    root = tmp_path_factory.mktemp("score")
    jobs = []
    for family, arch in _ci_grid():
        spec = ALL_SPECS[family]
        if arch not in spec.targets:   # every DSL target is exported once, even one no spec lists (sm_100f)
            spec = spec.model_copy(update={"targets": [*spec.targets, arch]})
        jobs.append(score_job(spec, arch))
    outcomes = compile_many(jobs, root / "cache", Toolchains(cute=toolchain), workers=2)   # 2 export processes
    return {"builds": {(o.family, o.arch): o for o in outcomes}, "root": root}


def _check_library(path: Path, family: str, arch: str, spec=None) -> None:
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True)
    exported = {line.split()[-1] for line in symbols.stdout.splitlines() if line.strip()}
    assert exported == EXPORTED, "only the C ABI is exported (the DSL's symbols stay local)"
    dynamic = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    needed = {line.split("[")[1].rstrip("]") for line in dynamic.splitlines() if "(NEEDED)" in line}
    assert needed <= ALLOWED_NEEDED, f"CuTe DSL runtime and cudart must be static; needs {sorted(needed)}"
    assert embedded_sm_versions(path) == [int(arch[3:-1])], "one cubin, for the target"
    lib = ScoreLibrary(path, family=family)
    assert (lib.family, lib.arch) == (family, arch)
    spec = spec or ALL_SPECS[family]
    g = tri_geometry(spec)
    lib.check_geometry(g, spec.dtype)
    assert lib.geometry["abi_version"] == 2 and lib.geometry["threads"] == 128
    assert lib.geometry["passes"] * lib.geometry["heads_per_pass"] >= g.group


@pytest.mark.parametrize("family,arch", _ci_grid())
def test_score_library_builds_and_loads(built: dict, family: str, arch: str) -> None:
    build = built["builds"][(family, arch)]
    assert build.status == "built", build.error
    assert build.artifact.name == f"lib{score_plan(ALL_SPECS[family]).symbol()}_score.so"
    assert file_sha256(build.artifact) == build.sha256 and build.toolchain["nvidia-cutlass-dsl"]
    _check_library(build.artifact, family, arch)


def test_an_arch_the_spec_does_not_target_builds_no_score_library(tmp_path: Path) -> None:
    spec = ALL_SPECS[PROBE_FAMILY].model_copy(update={"targets": ["sm_90a"]})
    report = pipeline.build([SpecSource(spec, "0" * 64)], ["sm_100a"], tmp_path / "generated",
                            tmp_path / "cache",
                            toolchains=[], registry_dir=tmp_path / "registry",
                            tuning_dir=tmp_path / "tuning", tuning_environ={}, backends=("cute",))
    assert [(o.arch, o.status) for o in report.outcomes] == [("sm_100a", "skipped")]
    assert not (tmp_path / "registry").exists()


def test_build_publishes_every_op_with_its_sha256(tmp_path_factory, toolchain) -> None:
    """``build()`` from Python, as ``kvgen build`` runs it: codec and compact (nvcc), score (CuTe
    DSL), pack and select (Triton, AOT) each name their artifact in the manifest,
    with its sha256, and the runtime loads each from the path ``Resolved.artifact`` verifies."""
    registry = real_registry(tmp_path_factory)
    path = manifest_path(registry, "sm_90a")
    entry = read_manifest(path).family(PROBE_FAMILY)
    assert {op.op: op.artifact for op in entry.ops} == {
        "codec": "libkvgen_qwen3_8b.so", "compact": "libkvgen_qwen3_8b.so", "score": "libkvgen_qwen3_8b_score.so",
        "pack": "libkvgen_qwen3_8b_pack.so", "select": "libkvgen_qwen3_8b_select.so"}
    assert {a.file: a.backend for a in entry.artifacts} == {
        "libkvgen_qwen3_8b.so": "nvcc", "libkvgen_qwen3_8b_score.so": "cute", "libkvgen_qwen3_8b_pack.so": "triton-aot",
        "libkvgen_qwen3_8b_select.so": "triton-aot"}
    for artifact in entry.artifacts:
        assert file_sha256(path.parent / artifact.file) == artifact.sha256 and len(artifact.cache_key) == 64
    assert entry.op("score").params == default_params("score") and entry.layout["family"] == PROBE_FAMILY
    resolved = RuntimeRegistry([registry]).resolve(PROBE_FAMILY, "sm_90a")
    spec = ALL_SPECS[PROBE_FAMILY]
    ScoreLibrary(resolved.artifact("score"), family=PROBE_FAMILY).check_geometry(tri_geometry(spec), spec.dtype)
    packer = MovePacker(resolved.artifact("pack"), PROBE_FAMILY)
    assert (packer.num_layers, packer.kv_heads) == (spec.layers, spec.kv_heads) and packer.aot
    selection = Selector(resolved.artifact("select"), PROBE_FAMILY)
    g = tri_geometry(spec)
    selection.check_geometry(g.num_layers, g.kv_heads, g.group, g.scored_layers)
    assert selection.aot and selection.module.arch == "sm_90a"


def test_every_dsl_target_is_covered() -> None:
    assert set(ARCHS) == {"sm_90a", *OTHER_ARCHS}


@pytest.mark.slow
@pytest.mark.parametrize("arch", OTHER_ARCHS)
def test_every_family_compiles_for_every_sm100_target(tmp_path: Path, toolchain, arch: str) -> None:
    specs = [ALL_SPECS[f].model_copy(update={"targets": [arch]}) for f in TRI_FAMILIES]
    for build in compile_scores(specs, arch, tmp_path / "cache", toolchain):
        assert build.status == "built", build.error
        _check_library(build.artifact, build.family, arch)


def test_second_build_is_a_cache_hit_and_params_change_the_key(built: dict, toolchain) -> None:
    root = built["root"]
    spec = ALL_SPECS[PROBE_FAMILY]
    (again,) = compile_scores([spec], "sm_90a", root / "cache", toolchain)
    assert again.status == "hit" and again.key == built["builds"][(PROBE_FAMILY, "sm_90a")].key
    texts = source_texts(render(score_plan(spec)))
    key = score_cache_key(texts, "sm_90a", toolchain)
    assert key == again.key
    assert score_cache_key(source_texts(render(score_plan(spec, {"threads": 64}))), "sm_90a", toolchain) != key
    assert score_cache_key(texts, "sm_100a", toolchain) != key
@pytest.mark.skipif(torch.cuda.is_available(), reason="garbage pointers must not reach a real GPU")
def test_kernel_call_without_a_driver_fails_cleanly(built: dict) -> None:
    lib = ScoreLibrary(built["builds"][(PROBE_FAMILY, "sm_90a")].artifact)
    raw = lib._lib
    bad = ctypes.c_void_p(16)
    status = raw.kvgen_score(bad, 4096, 10, bad, 4, bad, bad, bad, bad, bad, bad, bad, bad, bad, 1, 1, 8, None)
    assert status == -2 and lib.last_error().startswith("kvgen_score (qwen3-8b, sm_90a): no current CUDA device")
    assert raw.kvgen_score(bad, 3, 10, bad, 4, bad, bad, bad, bad, bad, bad, bad, bad, bad, 1, 1, 8, None) == -1
    assert "page_stride 3" in lib.last_error()
    assert raw.kvgen_score(bad, 4096, 0, bad, 4, bad, bad, bad, bad, bad, bad, bad, bad, bad, 1, 1, 8, None) == -1
    assert "num_pages 0" in lib.last_error()
    assert raw.kvgen_score(bad, 4096, 10, bad, 4, bad, bad, bad, bad, bad, bad, bad, bad, bad, 300, 300, 8,
                           None) == -1
    assert "65535" in lib.last_error()
    assert raw.kvgen_score(None, 4096, 10, None, 4, None, None, None, None, None, None, None, None, None, 1, 1, 0,
                           None) == 0, "an empty width is a no-op"


def test_score_rejects_mismatched_tensors(built: dict) -> None:
    lib = ScoreLibrary(built["builds"][(PROBE_FAMILY, "sm_90a")].artifact)
    f32 = torch.float32
    args = dict(k_layer_ptrs=torch.zeros(2, dtype=torch.int64), page_stride=4096,
                page_table=torch.zeros(3, 4, dtype=torch.int32), P=torch.zeros(3, dtype=torch.int32),
                S=torch.zeros(3, dtype=torch.int32), c=torch.zeros(3, 64), d=torch.zeros(3, 64),
                qr=torch.zeros(2, 32, 64), qi=torch.zeros(2, 32, 64), mlr=torch.zeros(2, 32, 64),
                freq_scale_sq=torch.zeros(64), scores=torch.zeros(2, 3, 32, 10, dtype=f32))
    with pytest.raises(ValueError, match=r"c: expected a contiguous float32 \[3, 64\]"):
        lib.score(**{**args, "c": torch.zeros(3, 32)}, num_pages=4)
    with pytest.raises(ValueError, match="P: expected a contiguous int32"):
        lib.score(**{**args, "P": torch.zeros(3, dtype=torch.int64)}, num_pages=4)
    with pytest.raises(ValueError, match="not contiguous"):
        lib.score(**{**args, "qr": torch.zeros(2, 64, 32).transpose(1, 2)}, num_pages=4)


# Every value of the pipeline tunables, each in one variant (with lanes/token_tiles that are other
# code paths too), for a one-pass family, the multi-pass one (falcon-7b, 5 passes, NHD) and fp8 K.
VARIANTS = [{"lanes": 4, "token_tiles": 4},
            {"tokens_per_thread": 2, "prefetch": 1, "token_tiles": 2},
            {"tokens_per_thread": 4, "prefetch": 1},
            {"tokens_per_thread": 4, "prefetch": 0, "token_tiles": 2},
            {"smem_stages": 2, "token_tiles": 4},
            {"smem_stages": 3, "tokens_per_thread": 2, "token_tiles": 2},
            {"smem_stages": 4, "lanes": 1},
            {"bulk_stages": 2, "token_tiles": 4},
            {"bulk_stages": 3, "lanes": 1, "token_tiles": 2}]


def _tokens_per_cta(lib: ScoreLibrary, params: dict) -> int:
    merged = {**default_params("score"), **params}
    return int(lib.geometry["threads"]) // int(lib.geometry["lanes"]) * merged["tokens_per_thread"] * merged[
        "token_tiles"]


@pytest.mark.parametrize("params", VARIANTS, ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()))
def test_tunable_variants_compile_and_report_their_launch_shape(tmp_path: Path, toolchain, params: dict) -> None:
    """lanes > 1 (threads share a token, shuffle-reduced), several stages per CTA, several tokens per
    thread and the prefetch are other code paths: compile them (sm_90a) and check the launch shape."""
    specs = [ALL_SPECS[PROBE_FAMILY], ALL_SPECS["falcon-7b"], fp8_family()]
    for build in compile_scores(specs, "sm_90a", tmp_path / "cache", toolchain, params):
        assert build.status == "built", build.error
        lib = ScoreLibrary(build.artifact, family=build.family)
        assert lib.geometry["tokens_per_cta"] == _tokens_per_cta(lib, params)
        assert score_plan(specs[0], params).key() != score_plan(specs[0]).key(), "the tunables are in the plan key"


_TRITON = importlib.util.find_spec("triton")
# the disassembler Triton's wheel ships (no CUDA toolkit needed)
CUOBJDUMP = Path(_TRITON.origin).parent / "backends" / "nvidia" / "bin" / "cuobjdump" if _TRITON else Path("-")


def _resource_usage(library: Path, tmp: Path) -> str:
    """``cuobjdump --dump-resource-usage`` of the sm_90 cubin a score library embeds (the first
    CUDA ELF image in it, cut out by its own header's section and program tables)."""
    cubin = embedded_cubin(library, tmp / "kernel.cubin")
    return subprocess.run([str(CUOBJDUMP), "--dump-resource-usage", str(cubin)], capture_output=True, text=True,
                          check=True).stdout


@pytest.mark.skipif(not CUOBJDUMP.is_file(), reason="no cuobjdump (Triton's wheel ships it)")
def test_pipelined_variants_do_not_spill(tmp_path: Path, toolchain) -> None:
    """The pipelined forms read their coefficients with volatile loads and keep the stage loop rolled:
    with plain loads they held every coefficient of the row live and spilled (2-6 KB of stack)."""
    params = [{"threads": 256, "max_heads": 4, "token_tiles": 4, "prefetch": 1},
              {"threads": 128, "token_tiles": 2, "tokens_per_thread": 2},
              {"threads": 128, "token_tiles": 4, "smem_stages": 3},
              {"threads": 128, "token_tiles": 4, "bulk_stages": 3},
              {"threads": 256, "token_tiles": 2, "tokens_per_thread": 2, "unpack": 1}]   # bf16 shift / mask
    for variant in params:
        (build,) = compile_scores([ALL_SPECS[PROBE_FAMILY]], "sm_90a", tmp_path / "cache", toolchain, variant)
        assert build.status == "built", build.error
        usage = _resource_usage(build.artifact, tmp_path)
        assert " STACK:0 " in usage and " LOCAL:0 " in usage, (variant, usage)


@pytest.mark.parametrize("arch", ["sm_100a", "sm_103a"])
def test_pipelined_and_fp8_scorers_compile_for_sm100_targets(tmp_path: Path, toolchain, arch: str) -> None:
    _bf16_and_fp8_build_for(arch, tmp_path, toolchain, {"tokens_per_thread": 2, "smem_stages": 2, "token_tiles": 2})


def _bf16_and_fp8_build_for(arch: str, tmp_path: Path, toolchain, params: dict) -> None:
    """The probe family and the fp8 family with ``params``, built and loadable for ``arch``."""
    specs = [spec.model_copy(update={"targets": [arch]}) for spec in (ALL_SPECS[PROBE_FAMILY], fp8_family())]
    for build in compile_scores(specs, arch, tmp_path / "cache", toolchain, params):
        assert build.status == "built", build.error
        _check_library(build.artifact, build.family, arch, specs[1] if build.family.endswith("fp8") else None)


# ---------------------------------------------------------------- form 1: the tensor-core scorer

MMA_VARIANTS = [  # (family, params): both magnitude routes, several MMA tiles and ring depths, 2 head tiles
    ("qwen3-8b", {"form": 1, "token_tiles": 16, "bulk_stages": 2, "mag_mma": 1}),
    ("qwen3-8b", {"form": 1, "threads": 64, "token_tiles": 4, "bulk_stages": 3, "mma_tiles": 2}),
    ("falcon-7b", {"form": 1, "threads": 128, "token_tiles": 2, "bulk_stages": 2, "mag_mma": 1}),   # NHD, 5 passes
    ("gemma-2-9b", {"form": 1, "threads": 128, "token_tiles": 8, "bulk_stages": 2}),                 # 512-byte rows
    ("qwen3.5-397b-a17b", {"form": 1, "threads": 128, "token_tiles": 4, "bulk_stages": 2, "mma_tiles": 2,
                           "mag_mma": 1}),                                                           # 16 heads
    ("qwen3-8b-fp8", {"form": 1, "token_tiles": 16, "bulk_stages": 2, "mag_mma": 1}),                # E4M3 widened
    ("qwen3-8b-fp8", {"form": 1, "threads": 64, "token_tiles": 4, "bulk_stages": 3, "mma_tiles": 2}),
]


def test_tensor_core_scorer_sizes_its_shared_memory_as_the_tuner_does() -> None:
    """The tuner folds form 1 to what fits ``MMA_SHARED_BUDGET`` without importing CUTLASS
    (``geometry.mma_coefficient_words`` / ``mma_ring_bytes``), and the kernel allocates exactly that."""
    pytest.importorskip("cutlass", reason="the kernel objects are CuTe DSL")
    from kvgen.kernels.cute.geometry import mma_coefficient_words, mma_ring_bytes
    from kvgen.kernels.cute.score_mma import TriScoreMmaKernel, make_score_kernel

    for family, params in MMA_VARIANTS:
        render_params = {**default_params("score"), **params}
        kernel = make_score_kernel(**_kernel_geometry(family), **render_params)
        assert isinstance(kernel, TriScoreMmaKernel)
        assert (kernel.b_words, kernel.m_words) == mma_coefficient_words(kernel.heads, kernel.rotary_dim,
                                                                          kernel.mag_mma)
        assert kernel.ring_bytes == mma_ring_bytes(kernel.warps, kernel.stages, kernel.rows, kernel.span_bytes)
    with pytest.raises(ValueError, match="form 1: needs bf16 or fp8_e4m3 K, half pairs"):
        make_score_kernel(**_kernel_geometry("mistral-7b"), **{**default_params("score"), "form": 1})


def _kernel_geometry(family: str) -> dict:
    g = score_geometry(ALL_SPECS[family])
    return {k: g[k] for k in ("dtype", "layout", "head_dim", "query_heads", "kv_heads", "rotary_start",
                              "rotary_dim", "pairing", "tokens_per_block")}


@pytest.mark.parametrize("family,params", MMA_VARIANTS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(MMA_VARIANTS)])
def test_tensor_core_scorer_compiles_without_spills_and_reports_its_launch_shape(tmp_path: Path, toolchain,
                                                                                  family: str, params: dict) -> None:
    """Form 1 for sm_90a: built, loadable, no stack or local memory, and a CTA covers warps x
    token_tiles x 16·mma_tiles tokens (the shim's grid)."""
    (build,) = compile_scores([ALL_SPECS[family]], "sm_90a", tmp_path / "cache", toolchain, params)
    assert build.status == "built", build.error
    lib = ScoreLibrary(build.artifact, family=build.family)
    merged = {**default_params("score"), **params}
    assert lib.geometry["tokens_per_cta"] == merged["threads"] // 32 * merged["token_tiles"] * 16 * merged["mma_tiles"]
    if CUOBJDUMP.is_file():
        usage = _resource_usage(build.artifact, tmp_path)
        assert " STACK:0 " in usage and " LOCAL:0 " in usage, (params, usage)


@pytest.mark.parametrize("arch", ["sm_100a", "sm_103a", "sm_107a"])
def test_tensor_core_scorer_compiles_for_sm100_targets(tmp_path: Path, toolchain, arch: str) -> None:
    _bf16_and_fp8_build_for(arch, tmp_path, toolchain, {"form": 1, "token_tiles": 16, "bulk_stages": 2, "mag_mma": 1})


def test_tensor_core_scorer_places_each_pair_once_where_the_mma_fragments_hold_it() -> None:
    """The index arithmetic of form 1 against the PTX fragment layouts: ``mma.m16n8k16`` (A: lane
    ``4g + t4`` holds columns ``2·t4 + {0, 1}`` and ``+ 8``; B: the same columns of head ``g``),
    ``m16n8k8`` (B: lane ``4n + t4`` holds rows ``t4`` and ``t4 + 4``) and ``ldmatrix.x4`` (lane ``4g
    + t4`` gets bytes ``4·t4 .. 4·t4 + 3`` of a 16-byte matrix row). bf16: a pair's slot is where the
    A fragment holds its element. fp8: it is where ``ldmatrix`` puts its byte, and the coefficient of
    that element sits at the B column the A fragment gives it (``mma_column``). Every pair has one
    (block, lane, slot), every coefficient one B place, and the magnitude B fragments fill their
    words exactly once."""
    pytest.importorskip("cutlass", reason="the kernel objects are CuTe DSL")
    from kvgen.kernels.cute.score_mma import SLOT_PAIRS, SPLITS, make_score_kernel

    for family in ("qwen3-8b", "gemma-2-9b", "qwen3.5-397b-a17b", "qwen3-8b-fp8"):
        kernel = make_score_kernel(**_kernel_geometry(family), **{**default_params("score"), "form": 1,
                                                                   "bulk_stages": 2, "mag_mma": 1})
        places = {kernel.pair_place(f) for f in range(kernel.freqs)}
        assert len(places) == kernel.freqs
        for f in range(kernel.freqs):
            block, t4, slot = kernel.pair_place(f)
            within = f - 16 * block
            if kernel.fp8:      # ldmatrix: the lane's 4 bytes; register q holds bytes 2·(q // 2) + {0, 1}
                assert within == 4 * t4 + slot
                # A-fragment register 2·(slot // 2), element slot % 2: column 2·t4 + 8·(slot // 2) + slot % 2
                assert kernel.mma_column(within) == 2 * t4 + 8 * (slot // 2) + slot % 2
            else:               # register q of lane t4 holds columns 2·t4 + 8·(q // 2) + {0, 1}: slot 2·(q // 2) + e
                assert within == 2 * t4 + 8 * (slot // 2) + slot % 2 == kernel.mma_column(within)
            assert block < kernel.mag_blocks
            # the im element f + F is the same place of block + blocks / 2
            assert (f + kernel.freqs) // 16 == block + kernel.mag_blocks and (f + kernel.freqs) % 16 == f % 16
        # B fragments: element e of head h goes to lane 4·(h % 8) + t4, register r, half j with MMA column
        # 2·t4 + 8·r + j = mma_column(e % 16); every (head tile, block, split, lane, register, half) once
        seen = set()
        for h in range(kernel.head_tiles * 8):
            for element in range(kernel.rotary_dim):
                word, half = kernel.b_place(h, element)
                k, column = element // 16, kernel.mma_column(element % 16)
                nt, rest = divmod(word, kernel.blocks * SPLITS * 64)
                block, rest = divmod(rest, SPLITS * 64)
                lane, r = divmod(rest, 2)
                assert (nt, block, lane // 4, 2 * (lane % 4) + 8 * r + half) == (h // 8, k, h % 8, column)
                seen.add((word, half))
        assert len(seen) == kernel.head_tiles * 8 * kernel.rotary_dim
        words = [kernel.m_fragment_word(nt, block, j, split, lane, r)
                 for nt in range(kernel.head_tiles) for block in range(kernel.mag_blocks)
                 for j in range(SLOT_PAIRS) for split in range(2) for lane in range(32) for r in range(2)]
        assert sorted(words) == list(range(kernel.m_words))