"""Kernel wheels (kvgen.artifacts.wheel, ``kvgen wheel``): contents, RECORD hashes, metadata and version lock,
reproducibility, the split by arch family, the size guard, and a real install with pip that the
runtime then finds through its entry point.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest

from kvgen import __version__
from kvgen.artifacts.manifest import RegistryError, manifest_path, parse_manifest, write_manifest
from kvgen.artifacts.wheel import (
    ENTRY_POINT_GROUP,
    PROVENANCE,
    WHEEL_TAG,
    WheelError,
    build_wheel,
    build_wheels,
    group_by_wheel,
    registry_archs,
    verify_installed,
    wheel_filename,
    wheel_provenance,
)
from kvgen.cli import main
from kvgen.files import file_sha256

from .test_runtime_registry import REAL_FAMILY, ROOT, fake_registry, real_registry

SM90 = f"kvgen_kernels_sm90-{__version__}"


def _names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        return zf.namelist()


def _read(wheel: Path, name: str) -> str:
    with zipfile.ZipFile(wheel) as zf:
        return zf.read(name).decode()


def test_wheel_contents_metadata_and_record(tmp_path: Path) -> None:
    registry = fake_registry(tmp_path / "reg", "sm_90a", ["fam", "other"])
    wheel = build_wheel(registry, ["sm_90a"], tmp_path / "dist")
    assert wheel.name == f"{SM90}-{WHEEL_TAG}.whl" == wheel_filename("kvgen_kernels_sm90")
    info = f"{SM90}.dist-info"
    assert _names(wheel) == [
        "kvgen_kernels_sm90/__init__.py",
        "kvgen_kernels_sm90/registry/sm_90a/libkvgen_fam.so",
        "kvgen_kernels_sm90/registry/sm_90a/libkvgen_other.so",
        "kvgen_kernels_sm90/registry/sm_90a/manifest.json",
        f"{info}/METADATA", f"{info}/WHEEL", f"{info}/entry_points.txt", f"{info}/top_level.txt",
        f"{info}/{PROVENANCE}", f"{info}/RECORD"]
    metadata = _read(wheel, f"{info}/METADATA")
    assert "Name: kvgen-kernels-sm90\n" in metadata and f"Version: {__version__}\n" in metadata
    assert f"Requires-Dist: kvgen=={__version__}\n" in metadata
    wheel_file = _read(wheel, f"{info}/WHEEL")
    assert f"Tag: {WHEEL_TAG}\n" in wheel_file and "Root-Is-Purelib: false\n" in wheel_file
    entry_points = _read(wheel, f"{info}/entry_points.txt")
    assert entry_points == f"[{ENTRY_POINT_GROUP}]\nkvgen_kernels_sm90 = kvgen_kernels_sm90\n"
    assert f'KVGEN_VERSION = "{__version__}"' in _read(wheel, "kvgen_kernels_sm90/__init__.py")
    assert '"kvgen_version": "' + __version__ in _read(wheel, "kvgen_kernels_sm90/registry/sm_90a/manifest.json")
    _check_record(wheel, f"{info}/RECORD")


def _check_record(wheel: Path, record_name: str) -> None:
    """Every member but RECORD is listed once with its urlsafe-base64 sha256 and size."""
    with zipfile.ZipFile(wheel) as zf:
        rows = [line.split(",") for line in zf.read(record_name).decode().splitlines()]
        listed = {name: (digest, size) for name, digest, size in rows}
        assert listed.pop(record_name) == ("", "")
        assert sorted(listed) == sorted(n for n in zf.namelist() if n != record_name)
        for name, (digest, size) in listed.items():
            data = zf.read(name)
            want = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert digest == f"sha256={want}" and int(size) == len(data), name
        modes = {info.filename: (info.external_attr >> 16) & 0o777 for info in zf.infolist()}
        assert all(mode == (0o755 if name.endswith(".so") else 0o644) for name, mode in modes.items())


def test_platform_tag_follows_the_glibc_the_libraries_need(tmp_path: Path) -> None:
    registry = fake_registry(tmp_path / "reg", "sm_90a", ["fam"])
    lib = registry / "sm_90a" / "libkvgen_fam.so"
    lib.write_bytes(b"\x7fELF...GLIBC_2.2.5\0GLIBC_2.34\0GLIBC_2.17\0")
    manifest = parse_manifest(manifest_path(registry, "sm_90a"))
    entry = manifest.families[0]
    entry = replace(entry, artifacts=(replace(entry.artifacts[0], sha256=file_sha256(lib)),))
    write_manifest(manifest_path(registry, "sm_90a"), replace(manifest, families=(entry,)))
    wheel = build_wheel(registry, ["sm_90a"], tmp_path / "dist")
    assert wheel.name == f"{SM90}-py3-none-manylinux_2_34_x86_64.whl"
    assert "Tag: py3-none-manylinux_2_34_x86_64\n" in _read(wheel, f"{SM90}.dist-info/WHEEL")


def test_wheel_is_reproducible(tmp_path: Path) -> None:
    registry = fake_registry(tmp_path / "reg", "sm_90a", ["fam"])
    first = build_wheel(registry, ["sm_90a"], tmp_path / "a").read_bytes()
    os.utime(registry / "sm_90a" / "libkvgen_fam.so", (1, 1))          # mtimes are not inputs
    assert build_wheel(registry, ["sm_90a"], tmp_path / "b").read_bytes() == first


def test_wheels_split_by_arch_family(tmp_path: Path) -> None:
    registry = tmp_path / "reg"
    for arch in ("sm_90a", "sm_100a", "sm_100f", "sm_103a", "sm_107a"):
        fake_registry(registry, arch, ["fam"])
    assert registry_archs(registry) == ["sm_100a", "sm_100f", "sm_103a", "sm_107a", "sm_90a"]
    assert group_by_wheel(registry_archs(registry)) == {
        "kvgen_kernels_sm100": ["sm_100a", "sm_100f", "sm_103a", "sm_107a"], "kvgen_kernels_sm90": ["sm_90a"]}
    sm100, sm90 = build_wheels(registry, registry_archs(registry), tmp_path / "dist")
    assert sm90.name.startswith(SM90) and sm100.name.startswith(f"kvgen_kernels_sm100-{__version__}")
    archs = {n.split("/")[2] for n in _names(sm100) if n.startswith("kvgen_kernels_sm100/registry/")}
    assert archs == {"sm_100a", "sm_100f", "sm_103a", "sm_107a"}
    with pytest.raises(WheelError, match="belong to different wheels"):
        build_wheel(registry, ["sm_90a", "sm_100a"], tmp_path / "dist")


def test_size_guard_fails_clearly_and_leaves_nothing(tmp_path: Path) -> None:
    registry = fake_registry(tmp_path / "reg", "sm_90a", ["fam"])
    with pytest.raises(WheelError, match=r"kvgen_kernels_sm90-.*\.whl would be 0\.0 MB, over the 0 MB limit.*100 MB"):
        build_wheel(registry, ["sm_90a"], tmp_path / "dist", limit_bytes=100)
    assert list((tmp_path / "dist").iterdir()) == []


def test_refuses_tampered_missing_or_foreign_registries(tmp_path: Path) -> None:
    registry = fake_registry(tmp_path / "reg", "sm_90a", ["fam"])
    (registry / "sm_90a" / "libkvgen_fam.so").write_bytes(b"tampered")
    with pytest.raises(RegistryError, match="sha256 mismatch.*kvgen build --arch sm_90a --family fam"):
        build_wheel(registry, ["sm_90a"], tmp_path / "dist")
    with pytest.raises(WheelError, match="no manifest for sm_100a; run: kvgen build --arch sm_100a --registry"):
        build_wheel(registry, ["sm_100a"], tmp_path / "dist")
    old = fake_registry(tmp_path / "old", "sm_90a", ["fam"], kvgen_version="0.0.1")
    with pytest.raises(RegistryError, match="written by kvgen 0.0.1"):
        build_wheel(old, ["sm_90a"], tmp_path / "dist")


def test_cli_wheel(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    specs, sha = git_specs(tmp_path)
    registry = fake_registry(tmp_path / "reg", "sm_90a", ["fam"], spec_sha256=sha)
    fake_registry(registry, "sm_103a", ["fam"], spec_sha256=sha)
    assert main(["--specs", str(specs), "wheel", "--registry", str(registry), "--out", str(tmp_path / "dist")]) == 0
    assert sorted(p.name.split("-")[0] for p in (tmp_path / "dist").iterdir()) == [
        "kvgen_kernels_sm100", "kvgen_kernels_sm90"]
    assert "wrote" in capsys.readouterr().out
    assert main(["--specs", str(specs), "wheel", "--arch", "sm_100a", "--registry", str(registry),
                 "--out", str(tmp_path / "d2")]) == 1
    assert "no manifest for sm_100a" in capsys.readouterr().err
    assert main(["wheel", "--registry", str(tmp_path / "none"), "--out", str(tmp_path / "d3")]) == 1


def _pip_install(wheel: Path, target: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet",
                             "--disable-pip-version-check", "--target", str(target), str(wheel)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


RESOLVE = """
from kvgen.runtime import RuntimeRegistry
registry = RuntimeRegistry.default(environ={})
resolved = registry.resolve("FAMILY", "sm_90a")
library = registry.load("FAMILY", "sm_90a")
print(resolved.source.package, resolved.source.version, resolved.artifact("codec"), library.family)
"""


def test_installed_wheel_is_found_and_loads(tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    registry = real_registry(tmp_path_factory)
    wheel = build_wheel(registry, ["sm_90a"], tmp_path / "dist")
    target = tmp_path / "site"
    _pip_install(wheel, target)
    assert (target / f"{SM90}.dist-info" / "RECORD").is_file()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), str(ROOT)])}
    env.pop("KVGEN_REGISTRY", None)
    result = subprocess.run([sys.executable, "-c", RESOLVE.replace("FAMILY", REAL_FAMILY)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    package, version, artifact, family = result.stdout.split()
    assert (package, version, family) == ("kvgen-kernels-sm90", __version__, REAL_FAMILY)
    assert Path(artifact) == target / "kvgen_kernels_sm90" / "registry" / "sm_90a" / "libkvgen_qwen3_8b.so"


def test_every_listed_artifact_ships_and_nothing_else(tmp_path: Path) -> None:
    registry = fake_registry(tmp_path / "reg", "sm_90a", ["fam", "other"], ops=("codec", "score", "pack"))
    (registry / "sm_90a" / "libkvgen_stale_score.so").write_bytes(b"left over by an old build")
    (registry / "sm_90a" / "libkvgen_fam_score.json").write_text("{}")    # a format-1 sidecar
    names = [n for n in _names(build_wheel(registry, ["sm_90a"], tmp_path / "dist")) if "/registry/" in n]
    prefix = "kvgen_kernels_sm90/registry/sm_90a/"
    assert names == [prefix + n for n in ("libkvgen_fam.so", "libkvgen_fam_pack.so", "libkvgen_fam_score.so",
                                          "libkvgen_other.so", "libkvgen_other_pack.so", "libkvgen_other_score.so",
                                          "manifest.json")]


@pytest.mark.parametrize("name", ["libkvgen_fam_score.so", "libkvgen_fam_pack.so"])
def test_tampered_score_library_or_packer_is_refused(tmp_path: Path, name: str) -> None:
    registry = fake_registry(tmp_path / "reg", "sm_90a", ["fam"], ops=("codec", "score", "pack"))
    (registry / "sm_90a" / name).write_bytes(b"tampered")
    with pytest.raises(RegistryError, match=rf"{name}: sha256 mismatch.*kvgen build --arch sm_90a --family fam"):
        build_wheel(registry, ["sm_90a"], tmp_path / "dist")
    assert not (tmp_path / "dist").exists() or not list((tmp_path / "dist").iterdir())


def test_wheel_of_a_built_registry_carries_the_score_library_and_the_packer(
        tmp_path_factory: pytest.TempPathFactory, tmp_path: Path) -> None:
    """From what ``build()`` published for a TriAttention family: every op's artifact is in the
    wheel, byte for byte, and listed (with that sha256) in the wheel's manifest."""
    registry = real_registry(tmp_path_factory)
    wheel = build_wheel(registry, ["sm_90a"], tmp_path / "dist")
    prefix = "kvgen_kernels_sm90/registry/sm_90a/"
    manifest = json.loads(_read(wheel, prefix + "manifest.json"))
    (entry,) = manifest["families"]
    served = {op["op"]: op["artifact"] for op in entry["ops"]}
    if "score" not in served:
        pytest.skip("no CuTe DSL here: the registry has no score library")
    assert served == {"codec": "libkvgen_qwen3_8b.so", "compact": "libkvgen_qwen3_8b.so",
                      "score": "libkvgen_qwen3_8b_score.so", "pack": "libkvgen_qwen3_8b_pack.so",
                      "select": "libkvgen_qwen3_8b_select.so"}
    with zipfile.ZipFile(wheel) as zf:
        shipped = {n[len(prefix):] for n in zf.namelist() if n.startswith(prefix)}
        assert shipped == {a["file"] for a in entry["artifacts"]} | {"manifest.json"}
        for artifact in entry["artifacts"]:
            assert hashlib.sha256(zf.read(prefix + artifact["file"])).hexdigest() == artifact["sha256"]


# ---------------------------------------------------------------- provenance: spec sha256, --allow-dirty


SPEC_TEXT = "name: fam\n# committed version\n"


def _git(repo: Path, *argv: str) -> None:
    subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *argv], check=True,
                   capture_output=True)


def git_specs(tmp_path: Path) -> tuple[Path, str]:
    """A git checkout holding specs/fam.yaml, committed; (its specs folder, the file's sha256)."""
    repo = tmp_path / "checkout"
    specs = repo / "specs"
    specs.mkdir(parents=True)
    (specs / "fam.yaml").write_text(SPEC_TEXT)
    _git(repo, "init", "-q")
    _git(repo, "add", "specs/fam.yaml")
    _git(repo, "commit", "-q", "-m", "fam")
    return specs, file_sha256(specs / "fam.yaml")


def _provenance(wheel: Path) -> dict:
    return json.loads(_read(wheel, f"{SM90}.dist-info/{PROVENANCE}"))


def test_a_wheel_records_the_sha256_and_git_state_of_each_spec(tmp_path: Path) -> None:
    specs, sha = git_specs(tmp_path)
    registry = fake_registry(tmp_path / "reg", "sm_90a", ["fam"], spec_sha256=sha)
    wheel = build_wheel(registry, ["sm_90a"], tmp_path / "dist", specs_dir=specs)
    record = _provenance(wheel)
    assert record["specs"] == [{"arch": "sm_90a", "family": "fam", "spec": str(specs / "fam.yaml"),
                                "spec_sha256": sha, "state": "committed"}]
    assert record["dirty"] == [] and record["allow_dirty"] is False and len(record["commit"]) == 40
    assert wheel_provenance(wheel) == record
    assert f"    sm_90a fam {sha} committed\n" in _read(wheel, f"{SM90}.dist-info/METADATA")
    _check_record(wheel, f"{SM90}.dist-info/RECORD")


@pytest.mark.parametrize("state", ["modified", "untracked", "changed since the build", "missing"])
def test_packing_an_uncommitted_spec_needs_allow_dirty_and_is_recorded(tmp_path: Path, state: str) -> None:
    specs, committed_sha = git_specs(tmp_path)
    spec = specs / "fam.yaml"
    if state == "untracked":
        _git(specs.parent, "rm", "-q", "--cached", "specs/fam.yaml")
        _git(specs.parent, "commit", "-q", "-m", "untrack")
    elif state != "missing":
        spec.write_text(SPEC_TEXT + "# edited, not committed\n")
    built_from = committed_sha if state == "changed since the build" else file_sha256(spec) if spec.exists() else "x"
    if state == "missing":
        spec.unlink()
    registry = fake_registry(tmp_path / "reg", "sm_90a", ["fam"], spec_sha256=built_from)
    with pytest.raises(WheelError, match=rf"not committed: fam sm_90a: {spec} {state}.*--allow-dirty"):
        build_wheel(registry, ["sm_90a"], tmp_path / "dist", specs_dir=specs)
    assert not (tmp_path / "dist").exists() or not list((tmp_path / "dist").iterdir())
    record = _provenance(build_wheel(registry, ["sm_90a"], tmp_path / "dist", specs_dir=specs, allow_dirty=True))
    assert record["allow_dirty"] is True and record["dirty"] == [f"fam sm_90a: {spec} {state}"]
    assert record["specs"][0]["state"] == state and record["specs"][0]["spec_sha256"] == built_from


def test_specs_outside_a_checkout_are_recorded_as_such(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    specs = tmp_path / "plain" / "specs"
    specs.mkdir(parents=True)
    (specs / "fam.yaml").write_text(SPEC_TEXT)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))   # no checkout above tmp_path counts
    registry = fake_registry(tmp_path / "reg", "sm_90a", ["fam"], spec_sha256=file_sha256(specs / "fam.yaml"))
    record = _provenance(build_wheel(registry, ["sm_90a"], tmp_path / "dist", specs_dir=specs))
    assert record["specs"][0]["state"] == "not in a git checkout" and record["dirty"] == []


def test_cli_wheel_refuses_a_dirty_spec_and_prints_what_allow_dirty_packed(tmp_path: Path, capsys) -> None:
    specs, _ = git_specs(tmp_path)
    (specs / "fam.yaml").write_text(SPEC_TEXT + "# edited\n")
    registry = fake_registry(tmp_path / "reg", "sm_90a", ["fam"], spec_sha256=file_sha256(specs / "fam.yaml"))
    argv = ["--specs", str(specs), "wheel", "--registry", str(registry), "--out", str(tmp_path / "dist")]
    assert main(argv) == 1
    assert "not committed: fam sm_90a" in capsys.readouterr().err
    assert main([*argv, "--allow-dirty"]) == 0
    captured = capsys.readouterr()
    assert "1 family for sm_90a" in captured.out and PROVENANCE in captured.out
    assert f"packed with --allow-dirty (recorded in the wheel): fam sm_90a: {specs / 'fam.yaml'} modified" in \
        " ".join(captured.err.split())


# ---------------------------------------------------------------- kvgen verify --installed


def test_verify_installed_checks_record_manifests_and_provenance(tmp_path: Path) -> None:
    specs, _ = git_specs(tmp_path)
    (specs / "fam.yaml").write_text(SPEC_TEXT + "# edited\n")
    registry = fake_registry(tmp_path / "reg", "sm_90a", ["fam"], spec_sha256=file_sha256(specs / "fam.yaml"),
                             ops=("codec", "pack"))
    wheel = build_wheel(registry, ["sm_90a"], tmp_path / "dist", specs_dir=specs, allow_dirty=True)
    target = tmp_path / "site"
    _pip_install(wheel, target)
    (check,) = verify_installed([str(target)])
    assert (check.name, check.version, check.problems, check.manifests) == ("kvgen-kernels-sm90", __version__, [], 1)
    assert check.files >= 4 and check.notes == [f"kvgen-kernels-sm90: packed with --allow-dirty: fam sm_90a: "
                                                f"{specs / 'fam.yaml'} modified"]
    packer = target / "kvgen_kernels_sm90" / "registry" / "sm_90a" / "libkvgen_fam_pack.so"
    packer.write_text("tampered")
    (check,) = verify_installed([str(target)])
    assert any("libkvgen_fam_pack.so: sha256 differs from RECORD" in p for p in check.problems)
    assert any("libkvgen_fam_pack.so: sha256 mismatch" in p for p in check.problems)
    assert verify_installed([str(tmp_path / "nothing")]) == []


def test_cli_verify_installed(tmp_path: Path) -> None:
    """``kvgen verify --installed`` as a user runs it: a fresh interpreter whose path holds the wheel."""
    specs, sha = git_specs(tmp_path)
    wheel = build_wheel(fake_registry(tmp_path / "reg", "sm_90a", ["fam"], spec_sha256=sha), ["sm_90a"],
                        tmp_path / "dist", specs_dir=specs)
    target = tmp_path / "site"
    _pip_install(wheel, target)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(target), str(ROOT)])}
    proc = subprocess.run([sys.executable, "-m", "kvgen", "verify", "--installed", "--json"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] and [w["package"] for w in report["installed"]] == ["kvgen-kernels-sm90"]
    (target / "kvgen_kernels_sm90" / "registry" / "sm_90a" / "manifest.json").write_text("{}")
    proc = subprocess.run([sys.executable, "-m", "kvgen", "verify", "--installed"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "manifest.json: sha256 differs from RECORD" in proc.stderr
