"""Per-layer second-level scales (issue 16, item 4), on the CPU build machine.

(a) The spec declares them (``cold_page.scales.<buffer>: per_layer``); the layout and the plan carry
    no compile-time G/Q for such a buffer, and the generated codec reads them at run time.
(b) The oracle takes one (G, Q) per layer: with every pair at 1 it writes the bytes of the same
    family with compiled-in scales (bit for bit), and it refuses a missing or misplaced pair.
(c) The kernels' own record code (Layer/Quantized/Side, __host__ __device__), compiled for the host
    from the generated codec.cu with the per-layer scale tables of codec_host.cuh, against the
    oracle: multi-layer cold pages of two lifecycles with a distinct (G, Q) per layer and buffer,
    encoded and decoded bit for bit (tests/csrc/codec_record_check.cu); the exact messages of
    refused scale arrays; and the same record code with compiled-in unit scales under the codec
    defaults (decode_split 2's half blocks, rounding 2) and hot_batch 2/4.
(d) The scales file loader (kvgen.runtime.scales): safetensors and torch weights-only files, shapes
    checked against the layout, clear errors naming the file and what is wrong.
(e) The built library without a GPU: it exports the per-layer scales entry points, and a bad scales
    file given to ``codec_from_registry`` is refused before any GPU call.
The GPU run of the same codec through the C ABI is tests/gpu/test_layer_scales_gpu.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvgen.kernels import INCLUDE_DIRS
from kvgen.lower.layout import family_layout, to_json
from kvgen.lower.plan import default_params, fold_codec_params, plans_for
from kvgen.reference.codec import decode_page, encode_page, encode_records
from kvgen.render.source import render_family
from kvgen.runtime.library import FamilyLibrary
from kvgen.runtime.lookup import RegistryLayout, RuntimeRegistry, codec_from_registry
from kvgen.runtime.scales import LayerScales, ScalesFileError, load_layer_scales
from kvgen.spec.schema import SpecError, parse_spec
from kvgen.tuning.space import lut_decode_buffers

from .conftest import ROOT
from .layer_scales_cases import (
    PER_LAYER_SPEC,
    fp8_spec,
    hot_pages,
    layer_scales,
    mixed_spec,
    per_layer_spec,
    save_scales,
    split_layer,
)

DRIVER = ROOT / "tests" / "csrc" / "codec_record_check.cu"
SYSTEM_NVCC = Path("/usr/local/bin/nvcc")


# ---------------------------------------------------------------------------------------------
# (a) spec, layout, plan, generated code
# ---------------------------------------------------------------------------------------------


def test_the_spec_declares_per_layer_buffers_and_the_plan_has_no_constants_for_them() -> None:
    spec = mixed_spec()
    assert spec.scale_for("k") is None and spec.scale_for("v") == (0.5, 2.0)
    k, v = family_layout(spec).record.buffers
    assert (k.G, k.Q, k.per_layer_scales) == (None, None, True) and (v.G, v.Q) == (0.5, 2.0)
    codec = next(p for p in plans_for(spec) if p.op == "codec")
    assert [(b["G"], b["Q"]) for b in codec.geometry["buffers"]] == [(None, None), ("0x1.0000000000000p-1f",
                                                                                    "0x1.0000000000000p+1f")]
    source = render_family(spec)["per-layer-scales-mixed/codec.cu"]
    assert ("codec::Quantized<Buffer_k, Hot, kRounding, kDecodeRoute, kHotBatch, kDecodeSplit, codec::Scales::PerLayer>"
            in source)
    assert "codec::Quantized<Buffer_v, Hot, kRounding, kDecodeRoute, kHotBatch, kDecodeSplit>" in source
    assert source.count("static constexpr float kG") == 1


@pytest.mark.parametrize("value, message", [
    ("perlayer", "cold_page.scales.k: Input should be 'per_layer'"),
    ("{G: 0}", "cold_page.scales.k.G: Input should be greater than or equal to"),
    ("3", "cold_page.scales.k: Input should be a valid dictionary"),
])
def test_a_bad_scales_declaration_names_its_key(value: str, message: str) -> None:
    text = PER_LAYER_SPEC.read_text(encoding="utf-8").replace("k: per_layer", f"k: {value}")
    with pytest.raises(SpecError, match=message):
        parse_spec(text, "x.yaml")


# ---------------------------------------------------------------------------------------------
# (b) the oracle
# ---------------------------------------------------------------------------------------------


def compiled_twin(text: str) -> str:
    """The test spec with its per-layer declarations removed (G = Q = 1 compiled in)."""
    return text.replace("  scales:\n    k: per_layer\n    v: per_layer\n", "")


def test_unit_per_layer_scales_write_the_bytes_of_compiled_unit_scales() -> None:
    spec = per_layer_spec()
    twin = parse_spec(compiled_twin(PER_LAYER_SPEC.read_text(encoding="utf-8")), "twin")
    assert not any(b.per_layer_scales for b in family_layout(twin).record.buffers)
    pools = hot_pages(spec, 3)
    ones = [{"k": (1.0, 1.0), "v": (1.0, 1.0)}] * spec.layers
    for lc, lifecycle in enumerate(family_layout(spec).lifecycles):
        layers = [split_layer(spec, pools[layer], 0) for layer in lifecycle.layers]
        assert torch.equal(encode_page(family_layout(spec), layers, lc, ones),
                           encode_page(family_layout(twin), layers, lc))


def test_distinct_layer_scales_give_distinct_records() -> None:
    spec = per_layer_spec()
    record = family_layout(spec).record
    buffers, sides = split_layer(spec, hot_pages(spec, 2)[0], slice(None))
    scales = layer_scales(spec)
    recs = [encode_records(record, buffers, sides, scales.of_layer(layer)) for layer in range(spec.layers)]
    assert all(not torch.equal(recs[0], other) for other in recs[1:])


def test_the_oracle_refuses_missing_and_misplaced_scales() -> None:
    spec = mixed_spec()
    record = family_layout(spec).record
    buffers, sides = split_layer(spec, hot_pages(spec, 1)[0], slice(None))
    with pytest.raises(ValueError, match="buffer 'k': G and Q are per layer; pass this layer's scales"):
        encode_records(record, buffers, sides)
    with pytest.raises(ValueError, match=r"buffer 'v': G and Q are compiled in \(G=0.5, Q=2.0\)"):
        encode_records(record, buffers, sides, {"k": (1.0, 1.0), "v": (2.0, 0.5)})


# ---------------------------------------------------------------------------------------------
# (c) the kernels' record code on the host
# ---------------------------------------------------------------------------------------------


def compile_driver(spec, tmp: Path, codec_params: dict[str, int] | None = None) -> Path:
    """tests/csrc/codec_record_check.cu built for the host around ``spec``'s generated codec.cu."""
    if not SYSTEM_NVCC.is_file():
        pytest.skip("nvcc 13.0 not found at /usr/local/bin/nvcc")
    source = tmp / "codec.cu"
    params = {"codec": codec_params} if codec_params else None
    source.write_text(render_family(spec, params=params)[f"{spec.name}/codec.cu"], encoding="utf-8")
    exe = tmp / "codec_record_check"
    # -arch: the device pass of the kernels the generated file instantiates needs sm_80+ PTX
    cmd = [str(SYSTEM_NVCC), "-x", "cu", "-std=c++17", "--fmad=false", "-arch=sm_90a",
           *[f"-I{d}" for d in INCLUDE_DIRS], f"-DKVGEN_FAMILY_SOURCE=\"{source}\"", str(DRIVER), "-o", str(exe)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return exe


@pytest.fixture(scope="module", params=["per-layer-scales", "per-layer-scales-mixed", "per-layer-scales-fp8"])
def driver(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    spec = {"per-layer-scales": per_layer_spec, "per-layer-scales-mixed": mixed_spec,
            "per-layer-scales-fp8": fp8_spec}[request.param]()
    return spec, compile_driver(spec, tmp_path_factory.mktemp(request.param))


def driver_input(spec, pools: list[list[torch.Tensor]], scales: LayerScales) -> bytes:
    raw = b"".join(part[0].contiguous().view(torch.uint8).numpy().tobytes() for layer in pools for part in layer)
    G, Q = scales.flat()
    return raw + torch.tensor(G, dtype=torch.float32).numpy().tobytes() + torch.tensor(Q, dtype=torch.float32).numpy().tobytes()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kernel_record_code_matches_the_oracle_with_distinct_layer_scales(driver, seed: int) -> None:
    spec, exe = driver
    layout = family_layout(spec)
    pools = hot_pages(spec, 1, seed)
    scales = layer_scales(spec, seed)
    proc = subprocess.run([str(exe)], input=driver_input(spec, pools, scales), capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr.decode()
    out = torch.frombuffer(bytearray(proc.stdout), dtype=torch.uint8)
    pos = 0
    cold = []
    for lc, lifecycle in enumerate(layout.lifecycles):
        want = encode_page(layout, [split_layer(spec, pools[layer], 0) for layer in lifecycle.layers], lc,
                           scales.per_layer())
        got = out[pos : pos + lifecycle.cold_page_bytes]
        assert torch.equal(got, want), f"lifecycle {lc}: {(got != want).sum().item()} bytes differ"
        cold.append(want)
        pos += lifecycle.cold_page_bytes
    for lc, lifecycle in enumerate(layout.lifecycles):
        decoded = decode_page(layout, cold[lc], spec.dtype, lc, scales.per_layer())
        for layer, (buffers, sides) in zip(lifecycle.layers, decoded):
            for want in [*buffers.values(), *sides.values()]:
                raw = want.contiguous().view(torch.uint8).reshape(-1)
                got = out[pos : pos + raw.numel()]
                assert torch.equal(got, raw), f"lifecycle {lc} layer {layer}: decode differs"
                pos += raw.numel()
    assert pos == out.numel()


# Where the driver puts its bad values (the last G, the second Q), per family: (count, per-layer
# buffers, the last G's layer and buffer, the second Q's layer and buffer).
REFUSED_AT = {"per-layer-scales": (8, 2, "layer 3, buffer 1", "layer 0, buffer 1"),
              "per-layer-scales-mixed": (4, 1, "layer 3, buffer 0", "layer 1, buffer 0"),
              "per-layer-scales-fp8": (8, 2, "layer 3, buffer 1", "layer 0, buffer 1")}


def test_refused_scale_arrays_name_the_value(driver) -> None:
    spec, exe = driver
    n, k, last_g, second_q = REFUSED_AT[spec.name]
    lines = subprocess.run([str(exe), "--errors"], capture_output=True, text=True, timeout=60, check=True).stdout
    name, tail = spec.name, "; scales must be finite and > 0"
    assert lines.splitlines() == [
        "ok: 1 ",
        f"short: 0 {name}: expected {n} scales (4 layers x {k} per-layer buffers), got {n - 1}",
        f"null G: 0 {name}: expected {n} scales (4 layers x {k} per-layer buffers), got a null G",
        *[line for value in ("nan", "inf", "0", "-2") for line in (
            f"bad G: 0 {name}: G[{n - 1}] ({last_g}) is {value}{tail}",
            f"bad Q: 0 {name}: Q[1] ({second_q}) is {value}{tail}")],
        f"1/G: 0 {name}: 1/G[0] (layer 0, buffer 0) is inf{tail}",
    ]


# The same record code with compiled-in unit scales (G = Q = 1, as every shipped spec): the Lut
# decode route with half blocks (decode_split 2) and the packed encode routes, the defaults, which a
# per-layer or Q != 1 buffer never takes (rounding 4: BF16 codes on fp16 pairs; it folds to 3 for
# FP8, the packed fp16 encode, and to 2, the fused FMA-pipe rounding, for fp16); and hot_batch 2
# and 4; BF16 also with route 2 itself.
# (dtype, variant, the rounding it builds)
UNIT_VARIANTS = [("bf16", {"hot_batch": 2}, 4), ("bf16", {"rounding": 2}, 2), ("fp16", {"hot_batch": 4}, 2),
                 ("fp16", {"rounding": 4}, 2), ("fp8_e4m3", {"hot_batch": 2}, 3)]


@pytest.mark.parametrize(("dtype", "variant", "rounding"), UNIT_VARIANTS)
def test_kernel_record_code_with_unit_scales_and_codec_variants_matches_the_oracle(
        dtype: str, variant: dict[str, int], rounding: int, tmp_path: Path) -> None:
    text = compiled_twin(PER_LAYER_SPEC.read_text(encoding="utf-8")).replace("dtype: bf16", f"dtype: {dtype}")
    spec = parse_spec(text.replace("name: per-layer-scales", f"name: unit-scales-{dtype}"), "unit-scales")
    params = fold_codec_params(spec, {**default_params("codec"), **variant})
    fp8 = dtype == "fp8_e4m3"
    assert params["decode_split"] == 2 and params["rounding"] == rounding and lut_decode_buffers(spec) != fp8
    exe = compile_driver(spec, tmp_path, params)
    layout = family_layout(spec)
    pools = hot_pages(spec, 1, 5)
    raw = b"".join(part[0].contiguous().view(torch.uint8).numpy().tobytes() for layer in pools for part in layer)
    proc = subprocess.run([str(exe)], input=raw, capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr.decode()
    want = []
    for lc, lifecycle in enumerate(layout.lifecycles):
        cold = encode_page(layout, [split_layer(spec, pools[layer], 0) for layer in lifecycle.layers], lc)
        want.append(cold)
    for lc in range(len(layout.lifecycles)):
        for buffers, sides in decode_page(layout, want[lc], spec.dtype, lc):
            want += [t.contiguous().view(torch.uint8).reshape(-1) for t in (*buffers.values(), *sides.values())]
    expected = torch.cat([w.reshape(-1) for w in want])
    got = torch.frombuffer(bytearray(proc.stdout), dtype=torch.uint8)
    assert got.numel() == expected.numel() and torch.equal(got, expected), \
        f"{(got != expected).sum().item() if got.numel() == expected.numel() else 'sizes'} bytes differ"


# ---------------------------------------------------------------------------------------------
# (d) the scales file loader
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_a_scales_file_round_trips_through_the_loader(tmp_path: Path, suffix: str) -> None:
    spec = per_layer_spec()
    scales = layer_scales(spec, 3)
    path = save_scales(tmp_path / f"scales{suffix}", scales)
    registry_layout = RegistryLayout.from_json(to_json(spec, family_layout(spec)))  # what the runtime reads
    loaded = load_layer_scales(path, registry_layout)
    assert (loaded.values, loaded.buffers, loaded.family) == (scales.values, ("k", "v"), "per-layer-scales")
    assert load_layer_scales(path, family_layout(spec)).values == scales.values


def test_q_defaults_to_the_binary32_reciprocal_of_g(tmp_path: Path) -> None:
    spec = per_layer_spec()
    G = torch.tensor([3.0, 0.1, 7.0, 1e-3], dtype=torch.float32)
    torch.save({"k.G": G, "v.G": G * 2}, tmp_path / "s.pt")
    loaded = load_layer_scales(tmp_path / "s.pt", family_layout(spec))
    assert [row[0][1] for row in loaded.values] == (1.0 / G).tolist()
    assert loaded.flat()[0] == [3.0, 6.0, *torch.tensor([0.1, 0.2, 7.0, 14.0, 1e-3, 2e-3]).tolist()]


GOOD = {"k.G": torch.ones(4), "v.G": torch.ones(4)}


@pytest.mark.parametrize("tensors, message", [
    ({**GOOD, "k.scale": torch.ones(4)}, "unknown key 'k.scale' for family per-layer-scales; accepted: k.G, k.Q, v.G, "
                                         r"v.Q \(Q optional, default 1/G\)"),
    ({"k.G": torch.ones(4)}, r"missing v.G \(one encode multiplier per layer for buffer 'v' of per-layer-scales\)"),
    ({**GOOD, "v.G": torch.ones(3)}, r"v.G has shape \[3\], expected \[4\] \(one value per layer of per-layer-scales\)"),
    ({**GOOD, "v.G": torch.ones(4, 1)}, r"v.G has shape \[4, 1\], expected \[4\]"),
    ({**GOOD, "k.G": torch.ones(4, dtype=torch.int32)}, "k.G has dtype torch.int32, expected a floating tensor"),
    ({**GOOD, "k.Q": torch.tensor([1, float("nan"), 1, 1])}, r"k.Q\[1\] = nan: scales must be finite"),
    ({**GOOD, "k.G": torch.tensor([1, 1, float("inf"), 1])}, r"k.G\[2\] = inf: scales must be finite"),
    ({**GOOD, "v.G": torch.tensor([1, 1, 1, 0.0])}, r"v.G\[3\] = 0.0: scales must be finite and in 2\^-64..2\^64"),
    ({**GOOD, "v.G": torch.tensor([-1.0, 1, 1, 1])}, r"v.G\[0\] = -1.0"),
    ({**GOOD, "v.Q": torch.tensor([1, 1, 1, 2.0 ** 70])}, r"v.Q\[3\] = 1.1805916207174113e\+21"),
])
def test_a_bad_scales_file_is_a_clear_error(tmp_path: Path, tensors: dict, message: str) -> None:
    path = tmp_path / "bad.safetensors"
    from safetensors.torch import save_file

    save_file(tensors, str(path))
    with pytest.raises(ScalesFileError, match=rf"^{path}: {message}"):
        load_layer_scales(path, family_layout(per_layer_spec()))


def test_unreadable_and_misshapen_files_are_clear_errors(tmp_path: Path) -> None:
    layout = family_layout(per_layer_spec())
    with pytest.raises(ScalesFileError, match="no such scales file"):
        load_layer_scales(tmp_path / "missing.pt", layout)
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ScalesFileError, match="not a readable safetensors file"):
        load_layer_scales(tmp_path / "junk.safetensors", layout)
    torch.save([1.0, 2.0], tmp_path / "list.pt")
    with pytest.raises(ScalesFileError, match="expected a mapping of names to tensors, got list"):
        load_layer_scales(tmp_path / "list.pt", layout)
    torch.save({"k.G": [1.0] * 4, "v.G": torch.ones(4)}, tmp_path / "lists.pt")
    with pytest.raises(ScalesFileError, match="k.G is a list, expected a tensor"):
        load_layer_scales(tmp_path / "lists.pt", layout)


def test_a_family_with_compiled_scales_takes_no_scales_file(tmp_path: Path) -> None:
    twin = parse_spec(compiled_twin(PER_LAYER_SPEC.read_text(encoding="utf-8")), "twin")
    torch.save(GOOD, tmp_path / "s.pt")
    with pytest.raises(ScalesFileError, match="has no per-layer scales .* it takes no scales file"):
        load_layer_scales(tmp_path / "s.pt", family_layout(twin))
    mixed = family_layout(mixed_spec())
    with pytest.raises(ScalesFileError, match="unknown key 'v.G' for family per-layer-scales-mixed; accepted: k.G, k.Q"):
        load_layer_scales(tmp_path / "s.pt", mixed)


# ---------------------------------------------------------------------------------------------
# (e) the built library without a GPU
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test family built by ``kvgen build`` for sm_90a (about 15 s)."""
    if not SYSTEM_NVCC.is_file():
        pytest.skip("nvcc 13.0 not found at /usr/local/bin/nvcc")
    tmp = tmp_path_factory.mktemp("layer-scales-registry")
    cmd = [sys.executable, "-m", "kvgen.cli", "--specs", str(PER_LAYER_SPEC.parent), "build", "--family",
           "per-layer-scales", "--arch", "sm_90a", "--registry", str(tmp / "registry"), "--generated",
           str(tmp / "generated"), "--cache-dir", str(tmp / "cache"), "--jobs", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return tmp / "registry"


def test_the_library_exports_the_layer_scale_entry_points(registry: Path) -> None:
    library = FamilyLibrary(registry / "sm_90a" / "libkvgen_per_layer_scales.so", "per-layer-scales")
    assert library.layer_scales and library.abi == 2


def test_a_bad_scales_file_is_refused_before_any_gpu_call(registry: Path, tmp_path: Path) -> None:
    torch.save({"k.G": torch.ones(4)}, tmp_path / "s.pt")
    with pytest.raises(ScalesFileError, match=r"s.pt: missing v.G"):
        codec_from_registry(RuntimeRegistry([registry]), "per-layer-scales", [], arch="sm_90a",
                            scales_file=tmp_path / "s.pt")
