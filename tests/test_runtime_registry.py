"""Run-time lookup (kvgen.runtime.lookup) on the CPU: search order, verification before loading,
version and spec checks, read-only registries, no files on import, no GPU call without a GPU,
the layout carried by the manifest, and the schema of the torch custom ops.

Most tests use fake registries (a few bytes standing in for a library: lookup never loads them);
the ones that dlopen build the real qwen3-8b library for sm_90a once (about 7 s).
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvgen import __version__
from kvgen.arch import arch_family, arch_for_capability, family_target, parse_arch
from kvgen.artifacts.manifest import (
    ArtifactEntry,
    FamilyEntry,
    Manifest,
    OpEntry,
    RegistryError,
    manifest_path,
    write_manifest,
)
from kvgen.artifacts.packages import distribution_name, package_name
from kvgen.files import file_sha256
from kvgen.runtime import codec as codec_ops
from kvgen.runtime import lookup as rr
from kvgen.runtime.library import LibraryError
from kvgen.runtime.lookup import RegistrySource, RuntimeRegistry, check_spec, spec_file_sha256

ROOT = Path(__file__).resolve().parents[1]
SPECS = ROOT / "specs"
SYSTEM_NVCC = Path("/usr/local/bin/nvcc")
REAL_FAMILY = "qwen3-8b"


# ---------------------------------------------------------------- fixtures


# op -> (artifact file name for a symbol, backend, template), as kvgen build names them
FAKE_ARTIFACTS = {"codec": ("lib{}.so", "nvcc", "codec.cu.j2"), "score": ("lib{}_score.so", "cute", "score.py.j2"),
                  "pack": ("lib{}_pack.so", "triton-aot", "pack.py.j2")}


def fake_registry(root: Path, arch: str, families: list[str], kvgen_version: str = __version__,
                  spec_sha256: str = "s" * 64, layout: dict | None = None, ops: tuple[str, ...] = ("codec",)) -> Path:
    """A registry dir with one manifest whose artifacts (one per op) are a few bytes each."""
    arch_dir = root / arch
    arch_dir.mkdir(parents=True, exist_ok=True)
    entries = []
    for family in families:
        symbol = f"kvgen_{family.replace('-', '_')}"
        op_entries, artifacts = [], []
        for op in ops:
            pattern, backend, template = FAKE_ARTIFACTS[op]
            name = pattern.format(symbol)
            (arch_dir / name).write_bytes(f"{family} {op} {arch} {root}".encode())
            op_entries.append(OpEntry(op, name, template, "p" * 64, {"threads": 256} if op == "codec" else {}))
            artifacts.append(ArtifactEntry(name, file_sha256(arch_dir / name), backend, "k" * 64,
                                           {"nvcc": "13.0.88"} if backend == "nvcc" else {}))
        entries.append(FamilyEntry(family=family, arch=arch, symbol=symbol, spec_sha256=spec_sha256,
                                   ops=tuple(op_entries), artifacts=tuple(artifacts), layout=layout,
                                   kvgen_version=kvgen_version))
    write_manifest(manifest_path(root, arch), Manifest(arch=arch, families=tuple(entries),
                                                       kvgen_version=kvgen_version))
    return root


_REAL: dict[str, Path] = {}


def real_registry(factory: pytest.TempPathFactory) -> Path:
    """The real qwen3-8b sm_90a registry as ``build()`` makes it (family library, CuTe DSL score
    library, Triton AOT packer and selection), built once per test session (about 7 s; shared with test_wheel,
    test_c_abi and test_score_build). Where the DSL is not installed, the score library is left out."""
    if "dir" not in _REAL:
        from kvgen.build.cute_aot import CuteCompileError, find_cute_toolchain
        from kvgen.build.nvcc import find_toolchains, pip_nvcc_paths
        from kvgen.build.pipeline import build

        toolchains = find_toolchains([SYSTEM_NVCC, *pip_nvcc_paths()])
        if not any(t.supports("sm_90a") for t in toolchains):
            pytest.skip("no nvcc for sm_90a")
        try:
            cute, backends = find_cute_toolchain(), ("nvcc", "cute", "triton-aot")
        except CuteCompileError:
            cute, backends = None, ("nvcc", "triton-aot")
        base = factory.mktemp("real-registry")
        cache = base / "cache"
        report = build([SPECS / f"{REAL_FAMILY}.yaml"], ["sm_90a"], base / "generated", cache, jobs=2,
                       toolchains=toolchains, cute_toolchain=cute, registry_dir=base / "registry",
                       tuning_dir=base / "no-tuning", tuning_environ={}, backends=backends)
        assert report.ok, [o.error for o in report.outcomes]
        _REAL.update(dir=base / "registry", cache=cache)
    return _REAL["dir"]


@pytest.fixture
def real(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return real_registry(tmp_path_factory)


# ---------------------------------------------------------------- arch names


def test_arch_names() -> None:
    assert parse_arch("sm_103a") == (10, 3, "a") and parse_arch("sm_100f") == (10, 0, "f")
    assert [arch_for_capability(*cc) for cc in ((9, 0), (10, 0), (10, 3), (10, 7))] == [
        "sm_90a", "sm_100a", "sm_103a", "sm_107a"]
    assert family_target("sm_90a") is None and family_target("sm_103a") == "sm_100f"
    assert rr.candidate_archs("sm_107a") == ["sm_107a", "sm_100f"] and rr.candidate_archs("sm_100f") == ["sm_100f"]
    assert [arch_family(a) for a in ("sm_90a", "sm_100a", "sm_100f", "sm_103a", "sm_107a")] == [
        "sm90", "sm100", "sm100", "sm100", "sm100"]
    assert package_name("sm_90a") == "kvgen_kernels_sm90" and distribution_name("sm_103a") == "kvgen-kernels-sm100"
    with pytest.raises(ValueError, match="not a CUDA arch"):
        parse_arch("hopper")


def test_current_arch_reads_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 3))
    assert rr.current_arch() == "sm_103a"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RegistryError, match="no CUDA device: pass arch="):
        RuntimeRegistry([]).resolve("fam")


# ---------------------------------------------------------------- lookup order


def test_exact_arch_beats_family_target_in_an_earlier_directory(tmp_path: Path) -> None:
    first = fake_registry(tmp_path / "a", "sm_100f", ["fam"])
    second = fake_registry(tmp_path / "b", "sm_103a", ["fam"])
    resolved = RuntimeRegistry([first, second]).resolve("fam", "sm_103a")
    assert resolved.arch == "sm_103a" and resolved.source.path == second
    assert resolved.artifact("codec") == second / "sm_103a" / "libkvgen_fam.so"


def test_family_target_is_the_fallback(tmp_path: Path) -> None:
    root = fake_registry(tmp_path / "a", "sm_100f", ["fam"])
    fake_registry(root, "sm_90a", ["fam"])
    assert RuntimeRegistry([root]).resolve("fam", "sm_107a").arch == "sm_100f"
    assert RuntimeRegistry([root]).resolve("fam", "sm_90a").arch == "sm_90a"


def test_search_path_order(tmp_path: Path) -> None:
    first = fake_registry(tmp_path / "a", "sm_90a", ["fam"])
    second = fake_registry(tmp_path / "b", "sm_90a", ["fam", "other"])
    registry = RuntimeRegistry([tmp_path / "missing", first, second])
    assert registry.resolve("fam", "sm_90a").source.path == first
    assert registry.resolve("other", "sm_90a").source.path == second


def test_missing_arch_lists_what_was_found_and_the_fix(tmp_path: Path) -> None:
    root = fake_registry(tmp_path / "reg", "sm_90a", ["fam", "other"])
    with pytest.raises(RegistryError) as err:
        RuntimeRegistry([root, tmp_path / "missing"]).resolve("fam", "sm_103a")
    message = str(err.value)
    assert "no kvgen library for family 'fam' on sm_103a (looked for sm_103a then sm_100f)" in message
    assert f"{root}: sm_90a: fam, other" in message and f"{tmp_path / 'missing'}: no manifests" in message
    assert "kvgen build --arch sm_103a --family fam" in message
    assert f"pip install kvgen-kernels-sm100=={__version__}" in message


def test_default_search_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    registry = RuntimeRegistry.default([tmp_path / "x"], environ={"KVGEN_REGISTRY": f"{a}{os.pathsep}{b}"},
                                       installed=False)
    assert [s.path for s in registry.sources] == [tmp_path / "x", a, b]
    monkeypatch.setenv("KVGEN_REGISTRY", str(a))            # environ defaults to the process's
    assert [s.path for s in RuntimeRegistry.default(installed=False).sources] == [a]


# ---------------------------------------------------------------- refusals


def test_tampered_artifact_is_refused_before_loading(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = fake_registry(tmp_path / "reg", "sm_90a", ["fam"])
    (root / "sm_90a" / "libkvgen_fam.so").write_bytes(b"tampered")
    monkeypatch.setattr(rr, "FamilyLibrary", _must_not_load)
    with pytest.raises(RegistryError, match=r"libkvgen_fam\.so: sha256 mismatch.*kvgen build --arch sm_90a "
                                            r"--family fam"):
        RuntimeRegistry([root]).load("fam", "sm_90a")
    (root / "sm_90a" / "libkvgen_fam.so").unlink()
    with pytest.raises(RegistryError, match="artifact missing.*kvgen build --arch sm_90a --family fam"):
        RuntimeRegistry([root]).resolve("fam", "sm_90a").artifact("codec")


@pytest.mark.parametrize("op", ["score", "pack"])
def test_tampered_score_or_pack_artifact_is_refused(tmp_path: Path, op: str) -> None:
    root = fake_registry(tmp_path / "reg", "sm_90a", ["fam"], ops=("codec", "score", "pack"))
    resolved = RuntimeRegistry([root]).resolve("fam", "sm_90a")
    path = resolved.artifact(op)
    assert path == root / "sm_90a" / FAKE_ARTIFACTS[op][0].format("kvgen_fam")
    path.write_bytes(path.read_bytes() + b"!")
    with pytest.raises(RegistryError, match=rf"{path.name}: sha256 mismatch with .*manifest\.json.*kvgen build "
                                            r"--arch sm_90a --family fam"):
        resolved.artifact(op)
    assert resolved.artifact("codec").is_file()          # the other ops stay usable


def test_an_op_the_family_does_not_ship_is_refused(tmp_path: Path) -> None:
    root = fake_registry(tmp_path / "reg", "sm_90a", ["fam"])
    with pytest.raises(RegistryError, match=r"manifest\.json: fam has no 'score' artifact \(its ops: codec\); "
                                            "rebuild with: kvgen build --arch sm_90a --family fam"):
        RuntimeRegistry([root]).resolve("fam", "sm_90a").artifact("score")


def test_manifest_of_another_format_is_refused(tmp_path: Path) -> None:
    root = fake_registry(tmp_path / "reg", "sm_90a", ["fam"])
    path = manifest_path(root, "sm_90a")
    path.write_text(path.read_text().replace('"format_version": 3', '"format_version": 2'))
    with pytest.raises(RegistryError, match=r"manifest\.json: format version 2, this kvgen reads 3.*kvgen build"):
        RuntimeRegistry([root]).resolve("fam", "sm_90a")


def _must_not_load(*args, **kwargs):  # noqa: ANN002, ANN003
    raise AssertionError("a library was loaded before verification")


def test_manifest_of_another_kvgen_version_is_refused(tmp_path: Path) -> None:
    root = fake_registry(tmp_path / "reg", "sm_90a", ["fam"], kvgen_version="0.0.1")
    with pytest.raises(RegistryError, match=f"written by kvgen 0.0.1.*this is kvgen {__version__}.*kvgen build "
                                            "--arch sm_90a"):
        RuntimeRegistry([root]).resolve("fam", "sm_90a")


def test_manifest_of_another_abi_is_refused(tmp_path: Path) -> None:
    root = fake_registry(tmp_path / "reg", "sm_90a", ["fam"])
    path = manifest_path(root, "sm_90a")
    path.write_text(path.read_text().replace('"abi_version": 2', '"abi_version": 1'))
    with pytest.raises(RegistryError, match=r"manifest\.json: written by kvgen .* \(ABI 1\).*kvgen build "
                                            r"--arch sm_90a"):
        RuntimeRegistry([root]).resolve("fam", "sm_90a")


def test_installed_wheel_of_another_version_names_both_versions_and_pip(tmp_path: Path) -> None:
    root = fake_registry(tmp_path / "site" / "kvgen_kernels_sm90" / "registry", "sm_90a", ["fam"],
                         kvgen_version="0.0.1")
    source = RegistrySource(root, "kvgen-kernels-sm90", "0.0.1")
    with pytest.raises(RegistryError) as err:
        RuntimeRegistry([source]).resolve("fam", "sm_90a")
    message = str(err.value)
    assert "manifest.json: installed kvgen-kernels-sm90 0.0.1 holds kernels built by kvgen 0.0.1" in message
    assert f"this is kvgen {__version__}" in message
    assert f"pip install kvgen-kernels-sm90=={__version__}" in message
    assert "kvgen build --arch sm_90a --family fam" in message


def test_unreadable_manifest_names_the_fix(tmp_path: Path) -> None:
    (tmp_path / "sm_90a").mkdir()
    (tmp_path / "sm_90a" / "manifest.json").write_text("{not json")
    with pytest.raises(RegistryError, match="not a kvgen manifest.*kvgen build --arch sm_90a --family fam"):
        RuntimeRegistry([tmp_path]).resolve("fam", "sm_90a")


def test_spec_changed_after_the_build(tmp_path: Path) -> None:
    spec = tmp_path / "fam.yaml"
    spec.write_text("name: fam\n")
    root = fake_registry(tmp_path / "reg", "sm_90a", ["fam"], spec_sha256=spec_file_sha256(spec))
    registry = RuntimeRegistry([root])
    resolved = registry.resolve("fam", "sm_90a", spec_path=spec)
    check_spec(resolved.entry, spec)
    spec.write_text("name: fam\nlayers: 2\n")
    with pytest.raises(RegistryError, match=r"fam\.yaml: changed since fam was built for sm_90a.*kvgen build "
                                            r"--arch sm_90a --family fam"):
        registry.resolve("fam", "sm_90a", spec_path=spec)


def test_manifest_without_layout_asks_for_a_rebuild(tmp_path: Path) -> None:
    root = fake_registry(tmp_path / "reg", "sm_90a", ["fam"])
    with pytest.raises(RegistryError, match="no layout.*kvgen build --arch sm_90a --family fam"):
        RuntimeRegistry([root]).resolve("fam", "sm_90a").layout()


# ---------------------------------------------------------------- real library


def test_layout_in_the_manifest_matches_the_spec(real: Path) -> None:
    from kvgen.lower.layout import family_layout
    from kvgen.spec.schema import load_spec

    want = family_layout(load_spec(SPECS / f"{REAL_FAMILY}.yaml"))
    resolved = RuntimeRegistry([real]).resolve(REAL_FAMILY, "sm_90a", spec_path=SPECS / f"{REAL_FAMILY}.yaml")
    layout = resolved.layout()
    assert layout.family == REAL_FAMILY and layout.record_bytes == want.record.bytes
    assert [(lc.layers, lc.cold_page_bytes, lc.hot_page_bytes) for lc in layout.lifecycles] == [
        (lc.layers, lc.cold_page_bytes, lc.hot_page_bytes) for lc in want.lifecycles]
    assert [b["name"] for b in layout.buffers] == [b.name for b in want.record.buffers]
    assert resolved.op("codec") is not None and resolved.op("compact") is not None


def test_read_only_registry_loads_once(real: Path, tmp_path: Path) -> None:
    copy = tmp_path / "ro"
    shutil.copytree(real, copy)
    _chmod_tree(copy, write=False)
    try:
        registry = RuntimeRegistry([copy])
        library = registry.load(REAL_FAMILY, "sm_90a")
        assert library.family == REAL_FAMILY and library.path.is_relative_to(copy)
        assert registry.load(REAL_FAMILY, "sm_90a") is library           # one handle per (path, sha)
        listed = {a.file for a in registry.resolve(REAL_FAMILY, "sm_90a").entry.artifacts}
        assert sorted(p.name for p in (copy / "sm_90a").iterdir()) == sorted([*listed, "manifest.json"])
    finally:
        _chmod_tree(copy, write=True)


def _chmod_tree(root: Path, write: bool) -> None:
    bits = stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH
    for path in [root, *root.rglob("*")]:
        mode = path.stat().st_mode
        path.chmod(mode | stat.S_IWUSR if write else mode & ~bits)


def test_without_a_gpu_loading_works_and_the_codec_stops_before_the_gpu(real: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    registry = RuntimeRegistry([real])
    library = registry.load(REAL_FAMILY, "sm_90a")      # dlopen needs no driver: cudart is static
    assert library.kvgen_abi_version() == 2
    calls = []
    monkeypatch.setattr(library, "kvgen_codec_configure", lambda *args: calls.append(args))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(LibraryError, match="no CUDA device"):
        rr.codec_from_registry(registry, REAL_FAMILY, [[torch.zeros(1)]], arch="sm_90a")
    assert calls == []


# ---------------------------------------------------------------- imports


def _run_python(code: str, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_importing_the_runtime_creates_nothing(tmp_path: Path) -> None:
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("XDG_", "KVGEN_", "TORCH", "TRITON"))}
    env.update(HOME=str(home), PYTHONPATH=str(ROOT))
    code = "import kvgen.runtime, kvgen.runtime.lookup, kvgen.artifacts.wheel; kvgen.runtime.installed_sources()"
    result = _run_python(code, cwd, env)
    assert result.returncode == 0, result.stderr
    assert list(home.rglob("*")) == [] and list(cwd.rglob("*")) == []


def test_runtime_imports_without_pydantic(tmp_path: Path) -> None:
    blocker = ("import sys\n"
               "class Block:\n"
               "    def find_spec(self, name, path=None, target=None):\n"
               "        if name.split('.')[0] == 'pydantic':\n"
               "            raise ImportError('pydantic blocked')\n"
               "sys.meta_path.insert(0, Block())\n")
    code = blocker + "import kvgen.runtime\nassert 'pydantic' not in sys.modules\n"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = _run_python(code, tmp_path, env)
    assert result.returncode == 0, result.stderr


BARE_KVGEN = """
import re, sys, types
from pathlib import Path
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "pydantic":
            raise ImportError("pydantic blocked")
sys.meta_path.insert(0, Block())
root = Path(sys.argv[1]) / "kvgen"
for name in ("kvgen", "kvgen.runtime"):        # packages whose __init__ imports the spec today
    package = types.ModuleType(name)
    package.__path__ = [str(root.joinpath(*name.split(".")[1:]))]
    sys.modules[name] = package
sys.modules["kvgen"].__version__ = re.search(r'__version__ = "([^"]+)"', (root / "__init__.py").read_text())[1]
from kvgen.runtime.lookup import RuntimeRegistry
registry = RuntimeRegistry([sys.argv[2]])
print(registry.load("FAMILY", "sm_90a").family, registry.resolve("FAMILY", "sm_90a").layout().record_bytes)
assert not any(m.startswith(("pydantic", "kvgen.spec.schema", "kvgen.lower.layout")) for m in sys.modules)
"""


def test_lookup_and_load_need_no_pydantic(real: Path, tmp_path: Path) -> None:
    """The lookup module itself is spec-free (the GPU machine's Python has no pydantic)."""
    code = BARE_KVGEN.replace("FAMILY", REAL_FAMILY)
    result = subprocess.run([sys.executable, "-c", code, str(ROOT), str(real)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[0] == REAL_FAMILY


# ---------------------------------------------------------------- torch custom ops


class _CopyCodec:
    """Stands in for ColdPageCodec on the CPU: 'encodes' by copying bytes (pairs are (dst, src))."""

    def __init__(self, hot: torch.Tensor):
        self._pools = [[hot]]

    def encode(self, cold: torch.Tensor, pairs: torch.Tensor, lifecycle: int) -> None:
        cold[pairs[:, 0].long()] = self._pools[0][0][pairs[:, 1].long()]

    def decode(self, cold: torch.Tensor, pairs: torch.Tensor, lifecycle: int) -> None:
        self._pools[0][0][pairs[:, 0].long()] = cold[pairs[:, 1].long()]


def test_custom_op_schemas_declare_the_mutations() -> None:
    codec_ops.register_ops()
    codec_ops.register_ops()   # idempotent
    encode = str(torch.ops.kvgen.cold_encode.default._schema)
    decode = str(torch.ops.kvgen.cold_decode.default._schema)
    assert "Tensor(a!) cold" in encode and "Tensor[] hot" in encode
    assert "Tensor(a!)[] hot" in decode and "Tensor cold" in decode


def test_custom_ops_run_a_registered_codec_and_pass_opcheck() -> None:
    hot = torch.arange(4 * 8, dtype=torch.uint8).reshape(4, 8)
    codec = _CopyCodec(hot)
    codec_id = codec_ops.register_codec(codec)
    cold = torch.zeros(3, 8, dtype=torch.uint8)
    pairs = torch.tensor([[0, 2], [2, 1]], dtype=torch.int32)
    codec_ops.cold_encode(codec_id, cold, pairs)
    assert torch.equal(cold[0], hot[2]) and torch.equal(cold[2], hot[1]) and not cold[1].any()
    codec_ops.cold_decode(codec_id, cold, torch.tensor([[3, 0]], dtype=torch.int32))
    assert torch.equal(hot[3], hot[2])
    for op in (torch.ops.kvgen.cold_encode.default, torch.ops.kvgen.cold_decode.default):
        results = torch.library.opcheck(op, (codec_id, cold, pairs, 0, [hot]))
        assert set(results.values()) == {"SUCCESS"}, results


def test_custom_op_is_one_opaque_node_under_torch_compile() -> None:
    hot = torch.arange(4 * 8, dtype=torch.uint8).reshape(4, 8)
    codec = _CopyCodec(hot)
    codec_id = codec_ops.register_codec(codec)
    codec_ops.register_ops()

    @torch.compile(fullgraph=True, backend="eager")
    def encode_then_read(cold: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
        torch.ops.kvgen.cold_encode(codec_id, cold, pairs, 0, [hot])
        return cold.sum(dim=1)

    cold = torch.zeros(2, 8, dtype=torch.uint8)
    sums = encode_then_read(cold, torch.tensor([[1, 3]], dtype=torch.int32))
    assert torch.equal(cold[1], hot[3]) and sums.tolist() == [0, int(hot[3].sum())]


def test_custom_op_with_a_dead_codec_is_a_clear_error() -> None:
    codec_id = codec_ops.register_codec(_CopyCodec(torch.zeros(1, 8, dtype=torch.uint8)))
    import gc

    gc.collect()
    with pytest.raises(LibraryError, match=f"no live codec with id {codec_id}"):
        codec_ops.cold_encode(codec_id, torch.zeros(1, 8, dtype=torch.uint8), torch.zeros(0, 2, dtype=torch.int32))
