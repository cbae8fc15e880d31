"""Issue 15, spec validation is complete: names that collide in C are refused (naming both files),
deep nesting and huge numbers are a clean ``SpecError`` naming the file, and a spec that validates
always builds: a seeded hypothesis fuzz over mutated shipped specs ends in either a ``SpecError``
or a spec that lowers and renders with every integer of the generated CUDA a 32-bit int (render
only), plus one nvcc build of the boundary values (sizes at the documented maxima).
"""

from __future__ import annotations

import copy
import math
import re
import shutil
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from kvgen.build.job import SpecSource
from kvgen.build.nvcc import find_toolchains, pip_nvcc_paths
from kvgen.build.pipeline import build
from kvgen.cli import main
from kvgen.lower.layout import family_layout
from kvgen.render.source import render_family
from kvgen.spec.schema import (
    MAX_PAGE_BYTES,
    MAX_SCALE,
    MIN_SCALE,
    SpecError,
    hot_page_bound,
    load_spec,
    parse_spec,
)

from .conftest import SPECS_DIR

SHIPPED = {p.stem: yaml.safe_load(p.read_text()) for p in sorted(SPECS_DIR.glob("*.yaml"))}
INT32_MAX = 2**31 - 1


def _spec_file(folder: Path, name: str, base: str = "mistral-7b", **changes) -> Path:
    data = {**copy.deepcopy(SHIPPED[base]), "name": name, **changes}
    path = folder / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# ---------------------------------------------------------------- names colliding in C


def test_names_colliding_after_normalisation_are_refused_naming_both_files(tmp_path: Path, capsys) -> None:
    a, b = _spec_file(tmp_path, "coll-a"), _spec_file(tmp_path, "coll_a")
    assert main(["validate", str(a), str(b)]) == 1
    err = capsys.readouterr().err
    assert str(a) in err and str(b) in err and "kvgen_coll_a" in err
    with pytest.raises(SpecError, match=r"collides with 'coll-a'"):
        build([a, b], ["sm_90a"], tmp_path / "gen", tmp_path / "cache", toolchains=[], registry_dir=tmp_path / "reg")
    assert not (tmp_path / "gen").exists()   # refused before anything is rendered
    assert main(["--specs", str(tmp_path), "build", "--arch", "sm_90a", "--registry", str(tmp_path / "reg"),
                 "--cache-dir", str(tmp_path / "cache"), "--generated", str(tmp_path / "gen")]) == 1
    assert "collides" in capsys.readouterr().err


def test_dotted_names_collide_too(tmp_path: Path, capsys) -> None:
    a, b = _spec_file(tmp_path, "q3.5"), _spec_file(tmp_path, "q3-5")
    assert main(["validate", str(a), str(b)]) == 1
    assert "collides with 'q3.5'" in capsys.readouterr().err


# ---------------------------------------------------------------- hostile YAML


@pytest.mark.parametrize("text, message", [
    ("name: a\nx: " + "[" * 1000 + "]" * 1000, "nested more than"),
    ("name: a\nx: " + "{a: " * 1000 + "}" * 1000, "nested more than"),
    ("name: a\nlayers: " + "9" * 5000, "integer of 5000 characters"),
    ("name: a\nlayers: -" + "9" * 5000, "integer of 5001 characters"),
    ("name: a\nlayers: 0x" + "f" * 100, "integer of 102 characters"),
])
def test_deep_nesting_and_huge_numbers_are_clean_errors(tmp_path: Path, capsys, text: str, message: str) -> None:
    path = tmp_path / "a.yaml"
    path.write_text(text)
    with pytest.raises(SpecError, match=message) as info:
        load_spec(path)
    assert str(info.value).startswith(f"{path}:")
    assert main(["validate", str(path)]) == 1
    captured = capsys.readouterr()
    assert message in captured.err and "Traceback" not in captured.err


@pytest.mark.parametrize("changes, key", [
    ({"tokens_per_block": 1024, "kv_heads": 16, "query_heads": 32, "head_dim": 512}, "tokens_per_block"),
    ({"side_buffers": [{"name": f"s{i}", "bytes_per_token": 1 << 20} for i in range(8)], "tokens_per_block": 64},
     "tokens_per_block"),
    ({"query_heads": 2048, "kv_heads": 1024}, "query_heads"),
    ({"cold_page": {"scales": {"k": {"G": 1e300}}}}, "cold_page.scales.k.G"),
    ({"cold_page": {"scales": {"v": {"G": 1.0, "Q": 1e-300}}}}, "cold_page.scales.v.Q"),
])
def test_values_that_would_break_the_generated_code_are_refused(tmp_path: Path, changes: dict, key: str) -> None:
    with pytest.raises(SpecError, match=re.escape(key)):
        load_spec(_spec_file(tmp_path, "big", **changes))


# ---------------------------------------------------------------- seeded fuzz: validates => renders

_COMMENTS = re.compile(r"/\*.*?\*/|//[^\n]*")
_INTS = re.compile(r"(?<![\w.])\d+(?![\w.])")

VALUES = st.one_of(
    st.integers(-3, 70),
    st.sampled_from([0, 1, 2, 16, 64, 128, 1024, 4096, 16384, 1 << 20, 1 << 24, 2**31, 2**63, 10**30]),
    st.sampled_from([0.0, -1.0, 1e-300, 1e-30, MIN_SCALE, 0.5, 1.0, 6.0, MAX_SCALE, 1e30, 1e300, math.inf, math.nan]),
    st.sampled_from(["", "even", "odd", "all", "half", "interleaved", "full", "leading", "trailing", "none",
                     "quantized", "lossless", "2fp4", "bf16", "fp8_e4m3", "mha", "gqa", "mla", "csa", "HND", "[/x]"]),
    st.booleans(), st.none(),
    st.lists(st.integers(-1, 70), max_size=4),
    st.just({}), st.just([{"name": "extra", "bytes_per_token": 1 << 20}]),
)
FIELDS = ("layers", "query_heads", "kv_heads", "head_dim", "tokens_per_block", "layout", "dtype", "attention",
          "side_buffers", "sliding_window", "targets", "mla", "csa", "bogus")
NESTED = {"rope": ("placement", "rotary_dim", "partial_rotary_factor", "pairing", "theta"),
          "cold_page": ("rope", "residual_width", "quantized_range", "scales"),
          "triattention": ("enabled", "budget", "beta", "eviction_mode"),
          "sliding_window": ("window", "layers"), "mla": ("kv_lora_rank", "qk_rope_head_dim")}


# Mostly plausible values of the field's own kind (so many mutants validate and reach the
# renderer), sometimes anything at all (so the refusals are exercised too).
SIZES = st.sampled_from([1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 512, 576, 1024, 2048, 4096, 8192, 16384,
                         1 << 20, 1 << 22, 1 << 24])
SCALES = st.sampled_from([MIN_SCALE, 2.0 ** -20, 0.25, 1.0, 6.0, 448.0, 2.0 ** 40, MAX_SCALE])
SIZE_FIELDS = ("layers", "query_heads", "kv_heads", "head_dim", "tokens_per_block")
NESTED_SIZES = {"triattention": ("budget", "beta"), "sliding_window": ("window",), "rope": ("rotary_dim",),
                "cold_page": ("residual_width",), "mla": ("kv_lora_rank", "qk_rope_head_dim")}


@st.composite
def mutated_specs(draw) -> dict:
    data = copy.deepcopy(SHIPPED[draw(st.sampled_from(sorted(SHIPPED)))])
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["size", "size", "big_page", "nested", "side", "scale", "wild", "wild_nested"]))
        if kind == "big_page":   # large pages: where sizes outgrow a 32-bit int
            heads = draw(st.sampled_from([16, 64, 128, 256, 1024]))
            data.update(tokens_per_block=draw(st.sampled_from([256, 512, 1024])), attention="mha",
                        query_heads=heads, kv_heads=heads, head_dim=draw(st.sampled_from([128, 256, 1024, 4096])))
        elif kind == "size":
            data[draw(st.sampled_from(SIZE_FIELDS))] = draw(SIZES)
        elif kind == "nested":
            section = draw(st.sampled_from(sorted(NESTED_SIZES)))
            if section == "sliding_window" and not isinstance(data.get(section), dict):
                data[section] = {"window": 4096, "layers": draw(st.sampled_from(["even", "odd", "all"]))}
            if isinstance(data.get(section), dict):
                data[section][draw(st.sampled_from(NESTED_SIZES[section]))] = draw(SIZES)
        elif kind == "side":
            data["side_buffers"] = [{"name": f"s{i}", "bytes_per_token": draw(SIZES)}
                                    for i in range(draw(st.integers(1, 8)))]
        elif kind == "scale":
            buffer = {"mla": "latent", "csa": "entry"}.get(data.get("attention"), draw(st.sampled_from(["k", "v"])))
            scale = {"G": draw(SCALES)}
            if draw(st.booleans()):
                scale["Q"] = draw(SCALES)
            data.setdefault("cold_page", {}).setdefault("scales", {})[buffer] = scale
        elif kind == "wild":
            data[draw(st.sampled_from(FIELDS))] = draw(VALUES)
        else:
            section = draw(st.sampled_from(sorted(NESTED)))
            if not isinstance(data.get(section), dict):
                data[section] = {}
            data[section][draw(st.sampled_from(NESTED[section]))] = draw(VALUES)
    return data


def _check_generated_ints(rendered: dict[str, str]) -> None:
    for name, text in rendered.items():
        if name.endswith(".cu"):
            for literal in _INTS.findall(_COMMENTS.sub("", text)):
                assert int(literal) <= INT32_MAX, f"{name}: {literal} is not a 32-bit int"


@seed(15)
@settings(max_examples=250, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(mutated_specs())
def test_fuzzed_specs_either_are_refused_cleanly_or_render(data: dict) -> None:
    try:
        text = yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
    except yaml.YAMLError:
        return
    try:
        spec = parse_spec(text, "fuzz.yaml")
    except SpecError as exc:
        assert str(exc).startswith("fuzz.yaml:")
        return
    assert hot_page_bound(spec) <= MAX_PAGE_BYTES
    family_layout(spec)
    _check_generated_ints(render_family(spec))


# ---------------------------------------------------------------- the boundary builds with nvcc

SYSTEM_NVCC = Path("/usr/local/bin/nvcc")


def boundary_spec(folder: Path) -> Path:
    """Every size at its documented maximum at once: a 16 MiB page (16 KV heads x 1024 tokens x
    256 x bf16, K and V), 4096 layers half of them sliding, scales at both ends of their range."""
    return _spec_file(folder, "boundary", layers=4096, query_heads=32, kv_heads=16, head_dim=256,
                      tokens_per_block=1024, dtype="bf16", sliding_window={"window": 1 << 24, "layers": "even"},
                      triattention={"enabled": False},
                      cold_page={"scales": {"k": {"G": MAX_SCALE, "Q": MIN_SCALE}, "v": {"G": MIN_SCALE}}})


def test_the_boundary_spec_is_at_the_maxima(tmp_path: Path) -> None:
    spec = load_spec(boundary_spec(tmp_path))
    assert hot_page_bound(spec) == MAX_PAGE_BYTES
    _check_generated_ints(render_family(spec))


def test_the_boundary_spec_builds_with_nvcc(tmp_path: Path) -> None:
    toolchains = [t for t in find_toolchains([SYSTEM_NVCC, *pip_nvcc_paths()]) if t.supports("sm_90a")]
    if not toolchains or not shutil.which("g++"):
        pytest.skip("no nvcc for sm_90a")
    path = boundary_spec(tmp_path)
    source = SpecSource(load_spec(path), "0" * 64, path)
    report = build([source], ["sm_90a"], tmp_path / "gen", tmp_path / "cache", toolchains=toolchains,
                   registry_dir=tmp_path / "reg", tuning_dir=tmp_path / "tuning", tuning_environ={},
                   backends={"nvcc"})
    assert report.ok, [o.error for o in report.outcomes]
