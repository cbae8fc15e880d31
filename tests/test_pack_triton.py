"""The generated Triton move packer (templates/pack.py.j2) against the oracle's pack_moves.

Every output must equal the oracle's Moves exactly (torch.equal on src, dst and offsets, fill
regions included). The kernels run under Triton's interpreter in ONE worker subprocess: the
interpreter must be switched on before triton is first imported and stays on for the whole
process (triton's own library functions are decorated at import), so doing it here would break
other tests that compile Triton for real GPU targets. This process imports the same modules in
normal JIT mode only to check host-side errors and to compile the kernels for sm_90/sm_100.

Families: qwen3-8b (union), llama-3.1-8b (per_head), mistral-7b (per_layer_perhead), gemma-2-9b
(SWA 4096 on even layers) and gpt-oss-20b (SWA 128 on even layers); every family runs every mode,
because the packer takes the mode at run time. Budgets stay small (24..40) except where a window
forces budget >= W. gemma-2-9b's budget of 4096 is the slow case under the interpreter, so its
batches are smaller and it is rendered with block 512.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvgen.lower.plan import plans_for
from kvgen.reference.triattention import MODES, num_decision_rows, pack_moves
from kvgen.render.source import render
from kvgen.runtime.pack import MovePacker, PackModuleError, import_pack_module, load_pack_module
from kvgen.spec.schema import load_spec
from tests.interpreter import interpret
from tests.move_cases import geometry, random_batch

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("qwen3-8b", "llama-3.1-8b", "mistral-7b", "gemma-2-9b", "gpt-oss-20b")
SLOW = {"gemma-2-9b": {"block": 512}}  # pack params for the test render (see the module docstring)


def _spec(family: str):
    return load_spec(ROOT / "specs" / f"{family}.yaml")


def _pack_plan(family: str):
    plans = plans_for(_spec(family), {"pack": SLOW.get(family, {})})
    return next(p for p in plans if p.op == "pack")


def _geometry(family: str):
    g = _pack_plan(family).geometry
    return geometry(g["num_layers"], g["kv_heads"], g["swa_window"])


def _budget(family: str, base: int) -> int:
    windows = [w for w in _pack_plan(family).geometry["swa_window"] if w]
    return max([base] + windows)


# ---------------------------------------------------------------------------------------------
# Cases: (id, family, batch) -- small, seeded, every mode; the worker packs them all at once
# ---------------------------------------------------------------------------------------------


def _cases() -> list[tuple[str, str, dict]]:
    cases = []
    for family in FAMILIES:
        geo = _geometry(family)
        for i, mode in enumerate(MODES):
            seed = 11 * i + len(family)
            budget = _budget(family, 24 + seed % 17)
            batch = random_batch(geo, mode, budget, batch=2 if family in SLOW else 4, seed=seed, padding=1)
            # Every other case packs into a larger, fixed capacity (the graph-capture path).
            capacity = None if i % 2 else int(batch.max_requests * (budget + 24) + 5)
            cases.append((f"{family}-{mode}", family, {"batch": batch, "capacity": capacity}))
    geo = _geometry("qwen3-8b")
    edge = {
        "none-due": random_batch(geo, "union", 8, batch=3, seed=5, active=[False, False, False]),
        "no-tails": random_batch(geo, "per_head", 8, batch=3, seed=6, max_tail=0),
        "keep-all": random_batch(geo, "union", 8, batch=2, seed=7, max_extra=0, padding=0),
        "one-request": random_batch(geo, "per_layer_perhead", 5, batch=1, seed=8, padding=0),
    }
    for name, batch in edge.items():
        cases.append((f"qwen3-8b-{name}", "qwen3-8b", {"batch": batch, "capacity": None}))
    kept32 = random_batch(geo, "union", 8, batch=3, seed=9)
    kept32.kept = kept32.kept.to(torch.int32)
    cases.append(("qwen3-8b-int32-kept", "qwen3-8b", {"batch": kept32, "capacity": 40}))
    return cases


CASES = _cases()

WORKER = r"""
import sys, torch
from kvgen.runtime.pack import import_pack_module
cases, out = torch.load(sys.argv[1], weights_only=False), {}
modules = {family: import_pack_module(path) for family, path in torch.load(sys.argv[2]).items()}
for case_id, family, case in cases:
    b = case["batch"]
    try:
        out[case_id] = modules[family].pack_moves(*b.args(), b.max_requests, case["capacity"])
    except Exception as exc:  # reported by the test of that case
        out[case_id] = f"{type(exc).__name__}: {exc}"
torch.save(out, sys.argv[3])
"""


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pack")
    paths = {}
    for family in FAMILIES:
        path = root / family / "pack.py"
        path.parent.mkdir()
        path.write_text(render(_pack_plan(family)))
        paths[family] = path
    return paths


@pytest.fixture(scope="module")
def interpreted(rendered: dict[str, Path], tmp_path_factory) -> dict:
    """case id -> (src, dst, offsets) or an error string, from the interpreter worker."""
    work = tmp_path_factory.mktemp("pack_worker")
    torch.save(CASES, work / "cases.pt")
    torch.save({family: str(path) for family, path in rendered.items()}, work / "paths.pt")
    interpret(WORKER, str(work / "cases.pt"), str(work / "paths.pt"), str(work / "out.pt"), timeout=300)
    return torch.load(work / "out.pt", weights_only=False)


@pytest.mark.parametrize("case_id, family, case", CASES, ids=[c[0] for c in CASES])
def test_packer_equals_oracle(interpreted: dict, case_id: str, family: str, case: dict) -> None:
    result = interpreted[case_id]
    assert not isinstance(result, str), result
    src, dst, offsets = result
    b = case["batch"]
    ref = pack_moves(*b.args(), _geometry(family), b.max_requests)
    n = ref.src.shape[-1]
    capacity = case["capacity"]
    assert src.shape == (ref.src.shape[:2] + (n if capacity is None else capacity,))
    assert src.dtype == dst.dtype == offsets.dtype == torch.int32
    assert torch.equal(offsets, ref.offsets)
    assert torch.equal(src[..., :n], ref.src) and torch.equal(dst[..., :n], ref.dst)
    assert bool((src[..., n:] == -1).all()) and bool((dst[..., n:] == -1).all())  # capacity past the moves


# ---------------------------------------------------------------------------------------------
# Host-side behaviour, in JIT mode (no kernel runs)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def jit_modules(rendered: dict[str, Path]) -> dict:
    return {family: import_pack_module(path) for family, path in rendered.items()}


def test_module_carries_the_family_geometry(jit_modules: dict) -> None:
    for family, module in jit_modules.items():
        spec = _spec(family)
        assert module.FAMILY == family and module.NUM_LAYERS == spec.layers and module.KV_HEADS == spec.kv_heads
        assert module.SWA_WINDOW == tuple(spec.layer_window(layer) for layer in range(spec.layers))
        assert module.BLOCK == SLOW.get(family, {}).get("block", 256)
        for mode in MODES:
            assert module.num_decision_rows(mode) == num_decision_rows(mode, _geometry(family))


@pytest.mark.parametrize("family, budget, mode, kept_shape, message", [
    ("qwen3-8b", 8, "both", None, "eviction_mode 'both'"),
    ("llama-3.1-8b", 8, "per_head", (2, 1, 8), r"kept has shape \[2, 1, 8\], expected \[2, 8, 8\]"),
    ("gpt-oss-20b", 64, "union", None, "layer 0: budget 64 < sliding window 128"),
])
def test_host_side_errors_match_the_oracle(jit_modules: dict, family, budget, mode, kept_shape, message) -> None:
    geo = _geometry(family)
    batch = random_batch(geo, "union", budget, batch=2, seed=3)
    kept = batch.kept if kept_shape is None else torch.zeros(kept_shape, dtype=torch.int64)
    args = (kept, batch.P, batch.S, batch.tail, batch.active, budget, mode)
    with pytest.raises(ValueError, match=message):
        pack_moves(*args, geo)
    with pytest.raises(ValueError, match=message):
        jit_modules[family].pack_moves(*args)


@pytest.mark.filterwarnings("ignore:TRITON_DEFAULT_FP_FUSION")
def test_kernels_compile_for_gpu_targets() -> None:
    """The interpreter is lenient; the real compiler is not (no Python globals, typed loop-carried
    values). Triton here is 3.9 and the GPU machine's is 3.6: the kernels use nothing newer."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvgen.kernels.triton import pack as module  # the generated modules bind these kernels to family constants

    specs = module.aot_specializations(module.TritonPacker(36, 8, [None] * 36, 512))   # what the AOT build compiles
    assert [spec.name for spec in specs] == ["offsets", "moves"]
    for arch in (90, 100):
        target = GPUTarget("cuda", arch, 32)
        for spec in specs:
            compiled = triton.compile(ASTSource(spec.kernel, spec.triton_signature(), spec.constants), target,
                                      spec.options)
            assert compiled.asm["cubin"]


def test_runtime_loader(rendered: dict[str, Path], tmp_path: Path) -> None:
    path = rendered["qwen3-8b"]
    assert load_pack_module(path) is load_pack_module(path)
    packer = MovePacker(path, "qwen3-8b")
    assert (packer.num_layers, packer.kv_heads) == (36, 8) and packer.swa_window == (None,) * 36
    with pytest.raises(PackModuleError, match="generated for family 'qwen3-8b', not 'mistral-7b'"):
        MovePacker(path, "mistral-7b")
    with pytest.raises(PackModuleError, match="no generated pack module; build it with: kvgen build"):
        import_pack_module(tmp_path / "missing" / "pack.py")
    (tmp_path / "other.py").write_text("x = 1\n")
    with pytest.raises(PackModuleError, match="missing FAMILY"):
        import_pack_module(tmp_path / "other.py")
