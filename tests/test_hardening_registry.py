"""Issue 15, registry and writers: the registry loads only its own files (artifact paths relative
and inside it after symlinks, the arch matching its folder, malformed manifests refused), every
problem reported by ``kvgen verify`` without a traceback; concurrent publishes of different
families lose nothing (two processes racing through ``publish``); published files are 0644/0755
whatever the umask; a killed or interrupted build leaves no compiler process behind.

All on the CPU: fake registries (a few bytes per artifact, never loaded) and a fake compiler script.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvgen.artifacts.manifest import RegistryError, manifest_path, manifest_problems, parse_manifest, read_manifest
from kvgen.build.job import BuildOutcome, SpecSource, family_jobs, load_spec_source
from kvgen.build.nvcc import CompileError, Toolchain, compile_shared_library
from kvgen.build.pipeline import publish
from kvgen.cli import main
from kvgen.files import copy_if_different, file_sha256, write_if_different, write_json_atomic
from kvgen.runtime.lookup import RuntimeRegistry, spec_file_sha256

from .conftest import SPECS_DIR
from .test_runtime_registry import fake_registry

FAMILY = "qwen3-8b"
LIB = "libkvgen_qwen3_8b.so"


def _manifest(registry: Path, arch: str = "sm_90a") -> tuple[Path, dict]:
    path = manifest_path(registry, arch)
    return path, json.loads(path.read_text())


def _set_artifact_file(registry: Path, file: str, arch: str = "sm_90a", sha256: str | None = None) -> None:
    path, data = _manifest(registry, arch)
    entry = data["families"][0]
    old = entry["artifacts"][0]["file"]
    entry["artifacts"][0]["file"] = file
    if sha256:
        entry["artifacts"][0]["sha256"] = sha256
    for op in entry["ops"]:
        if op["artifact"] == old:
            op["artifact"] = file
    path.write_text(json.dumps(data))


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Path, Path]:
    specs = tmp_path / "specs"
    specs.mkdir()
    shutil.copy(SPECS_DIR / f"{FAMILY}.yaml", specs)
    registry = fake_registry(tmp_path / "reg", "sm_90a", [FAMILY], spec_sha256=spec_file_sha256(specs / f"{FAMILY}.yaml"))
    return registry, specs


def _verify(registry: Path, specs: Path, capsys) -> tuple[int, str]:
    code = main(["--specs", str(specs), "verify", "--registry", str(registry)])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    return code, captured.err


def _refused_without_loading(registry: Path, monkeypatch: pytest.MonkeyPatch, match: str) -> None:
    """The lookup refuses before anything is dlopened."""
    from kvgen.runtime import library

    monkeypatch.setattr(library.ctypes, "CDLL", lambda *a, **k: pytest.fail("dlopened before the checks"))
    with pytest.raises(RegistryError, match=match):
        RuntimeRegistry([registry]).load(FAMILY, "sm_90a")


# ---------------------------------------------------------------- paths that escape the registry


@pytest.mark.parametrize("kind", ["absolute", "dotdot", "symlink_file", "symlink_dir"])
def test_artifact_paths_outside_the_registry_are_refused(setup, tmp_path: Path, capsys, monkeypatch, kind) -> None:
    registry, specs = setup
    outside = tmp_path / "outside"
    outside.mkdir()
    evil = outside / LIB
    evil.write_bytes(b"a library outside the registry")
    sha = file_sha256(evil)   # a matching sha256 must not be enough
    arch_dir = registry / "sm_90a"
    if kind == "absolute":
        _set_artifact_file(registry, str(evil), sha256=sha)
    elif kind == "dotdot":
        _set_artifact_file(registry, f"../../outside/{LIB}", sha256=sha)
    elif kind == "symlink_file":
        (arch_dir / LIB).unlink()
        (arch_dir / LIB).symlink_to(evil)
        _set_artifact_file(registry, LIB, sha256=sha)
    else:
        (arch_dir / "sub").symlink_to(outside, target_is_directory=True)
        _set_artifact_file(registry, f"sub/{LIB}", sha256=sha)
    _refused_without_loading(registry, monkeypatch, "registry|relative")
    code, err = _verify(registry, specs, capsys)
    assert code == 1 and "kvgen build --arch sm_90a --family qwen3-8b" in err
    assert ("outside" in err) or ("relative" in err)


def test_a_symlink_inside_the_registry_is_fine(setup, capsys) -> None:
    registry, specs = setup
    arch_dir = registry / "sm_90a"
    (arch_dir / "libs").mkdir()
    shutil.move(arch_dir / LIB, arch_dir / "libs" / LIB)
    (arch_dir / LIB).symlink_to(Path("libs") / LIB)
    assert RuntimeRegistry([registry]).resolve(FAMILY, "sm_90a").artifact("codec") == (arch_dir / "libs" / LIB)
    assert _verify(registry, specs, capsys)[0] == 0


def test_a_registry_copied_into_another_arch_folder_is_refused(setup, capsys, monkeypatch) -> None:
    registry, specs = setup
    shutil.copytree(registry / "sm_90a", registry / "sm_100a")
    with pytest.raises(RegistryError, match=r"sm_90a in the folder sm_100a"):
        RuntimeRegistry([registry]).resolve(FAMILY, "sm_100a")
    code, err = _verify(registry, specs, capsys)
    assert code == 1 and "sm_100a" in err and "kvgen build --arch sm_100a" in err
    assert RuntimeRegistry([registry]).resolve(FAMILY, "sm_90a").arch == "sm_90a"


# ---------------------------------------------------------------- malformed manifests


def _edit(data: dict, how: str) -> dict | list | str:
    family = data["families"][0]
    if how == "list":
        return [data]
    if how == "arch_int":
        data["arch"] = 90
    elif how == "families_dict":
        data["families"] = {"a": 1}
    elif how == "family_str":
        data["families"] = ["qwen3-8b"]
    elif how == "missing_sha":
        del family["artifacts"][0]["sha256"]
    elif how == "file_int":
        family["artifacts"][0]["file"] = 7
    elif how == "params_str":
        family["ops"][0]["params"] = {"threads": "256"}
    elif how == "unknown_key":
        family["artifacts"][0]["run_me"] = "rm -rf /"
    elif how == "op_names_unlisted":
        family["ops"][0]["artifact"] = "libother.so"
    elif how == "abi_bool":
        data["abi_version"] = True
    return data


@pytest.mark.parametrize("how", ["list", "arch_int", "families_dict", "family_str", "missing_sha", "file_int",
                                 "params_str", "unknown_key", "op_names_unlisted", "abi_bool"])
def test_malformed_manifests_are_reported_without_a_traceback(setup, capsys, how: str) -> None:
    registry, specs = setup
    path, data = _manifest(registry)
    path.write_text(json.dumps(_edit(data, how)))
    with pytest.raises(RegistryError):
        read_manifest(path)
    code, err = _verify(registry, specs, capsys)
    assert code == 1 and str(path) in err
    assert main(["--specs", str(specs), "verify", "--registry", str(registry), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["problems"]


@pytest.mark.parametrize("text", ["", "{", "[" * 100000, "\xff", "null", '{"format_version": 2}'])
def test_unparseable_manifests_are_refused(setup, capsys, text: str) -> None:
    registry, specs = setup
    path = manifest_path(registry, "sm_90a")
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(RegistryError, match="manifest"):
        parse_manifest(path)
    assert _verify(registry, specs, capsys)[0] == 1


def test_verify_reports_every_problem(setup, capsys) -> None:
    registry, specs = setup
    fake_registry(registry, "sm_90a", [FAMILY], spec_sha256=spec_file_sha256(specs / f"{FAMILY}.yaml"),
                  ops=("codec", "score", "pack"))
    arch_dir = registry / "sm_90a"
    (arch_dir / "libkvgen_qwen3_8b_score.so").write_bytes(b"altered")
    (arch_dir / "libkvgen_qwen3_8b_pack.so").unlink()
    _, problems = manifest_problems(manifest_path(registry, "sm_90a"))
    assert len(problems) == 2
    code, err = _verify(registry, specs, capsys)
    assert code == 1 and "sha256 mismatch" in err and "artifact missing" in err


# ---------------------------------------------------------------- concurrent publishes


def _fake_results(spec_name: str, work: Path, arch: str = "sm_90a", rename: str | None = None) -> list[tuple]:
    """Real jobs of a shipped spec (renamed to ``rename``), each with a fake built artifact:
    publish's real code path without nvcc."""
    source = load_spec_source(SPECS_DIR / f"{spec_name}.yaml")
    if rename:
        source = SpecSource(source.spec.model_copy(update={"name": rename}), source.sha256, None)
    results = []
    for job in family_jobs(source, arch):
        artifact = work / job.family / job.artifact
        artifact.parent.mkdir(parents=True, exist_ok=True)
        artifact.write_bytes(f"{job.family} {job.backend}".encode())
        results.append((job, BuildOutcome(job.family, arch, job.backend, "built", 0.0, artifact, "k" * 64,
                                          sha256=file_sha256(artifact))))
    return results


def _racer(registry: str, work: str, spec_name: str, rounds: int, barrier) -> None:
    """Publishes a new family each round (a family already listed is never dropped: the race
    that loses one is between two builds adding families)."""
    batches = [_fake_results(spec_name, Path(work), rename=f"{spec_name}-r{i}") for i in range(rounds)]
    barrier.wait()
    for results in batches:
        publish(Path(registry), "sm_90a", results)


def test_concurrent_publishes_of_different_families_lose_nothing(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    barrier, rounds = ctx.Barrier(2), 40
    names = ("mistral-7b", "falcon-7b")
    racers = [ctx.Process(target=_racer, args=(str(tmp_path / "reg"), str(tmp_path / "work"), name, rounds, barrier))
              for name in names]
    for p in racers:
        p.start()
    for p in racers:
        p.join(120)
        assert p.exitcode == 0
    manifest = read_manifest(manifest_path(tmp_path / "reg", "sm_90a"))
    assert {e.family for e in manifest.families} == {f"{n}-r{i}" for n in names for i in range(rounds)}


# ---------------------------------------------------------------- file modes


def test_published_files_are_readable_by_others_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o077)
    try:
        write_json_atomic(tmp_path / "a.json", {"a": 1})
        write_if_different(tmp_path / "gen" / "b.cu", "// b\n")
        path = publish(tmp_path / "reg", "sm_90a", _fake_results("falcon-7b", tmp_path / "work"))
    finally:
        os.umask(old)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o644
    assert (tmp_path / "gen" / "b.cu").stat().st_mode & 0o777 == 0o644
    assert path.stat().st_mode & 0o777 == 0o644
    modes = {p.name: p.stat().st_mode & 0o777 for p in path.parent.iterdir() if not p.name.startswith(".")}
    assert all(mode == (0o644 if name.endswith((".py", ".json")) else 0o755) for name, mode in modes.items()), modes


def test_an_identical_artifact_left_unreadable_gets_its_mode_back(tmp_path: Path) -> None:
    """An older build may have left an artifact 0600; republishing the same bytes fixes the mode."""
    src, dest = tmp_path / "lib.so", tmp_path / "reg" / "lib.so"
    src.write_bytes(b"\x7fELF")
    copy_if_different(src, dest, file_sha256(src))
    dest.chmod(0o600)
    before = dest.stat().st_ino
    copy_if_different(src, dest, file_sha256(src))
    assert dest.stat().st_mode & 0o777 == 0o755 and dest.stat().st_ino == before   # same file, not rewritten


# ---------------------------------------------------------------- no compiler left behind

FAKE_NVCC = """#!/bin/sh
# a slow compiler that spawns a helper, as nvcc spawns cicc and ptxas
sleep 300 &
echo $$ $! >> "$KVGEN_TEST_PIDS"
wait
"""

COMPILE = textwrap.dedent("""
    import sys
    from pathlib import Path
    from kvgen.build.nvcc import Toolchain, compile_shared_library
    toolchain = Toolchain(nvcc=sys.argv[1], version="13.0.0", version_sha256="x", archs=("sm_90",))
    compile_shared_library([Path("a.cu")], "sm_90a", [], Path("lib.so"), toolchain, cwd=Path(sys.argv[2]))
""")


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def _compiler_pids(pids_file: Path, timeout: float = 30) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pids_file.is_file() and len(pids_file.read_text().split()) >= 2:
            return [int(p) for p in pids_file.read_text().split()]
        time.sleep(0.05)
    pytest.fail("the fake compiler never started")


def _all_gone(pids: list[int], timeout: float = 5) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def fake_nvcc(tmp_path: Path) -> tuple[Path, Path]:
    nvcc = tmp_path / "bin" / "nvcc"
    nvcc.parent.mkdir()
    nvcc.write_text(FAKE_NVCC)
    nvcc.chmod(0o755)
    return nvcc, tmp_path / "pids"


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM, signal.SIGINT])
def test_a_killed_build_leaves_no_compiler_behind(fake_nvcc, tmp_path: Path, sig: signal.Signals) -> None:
    nvcc, pids_file = fake_nvcc
    env = {**os.environ, "KVGEN_TEST_PIDS": str(pids_file), "PYTHONPATH": str(SPECS_DIR.parent)}
    # SIGINT as at a terminal: a background job of a non-interactive shell (CI started with `&`)
    # inherits SIGINT ignored, and Python then never raises KeyboardInterrupt.
    build = subprocess.Popen([sys.executable, "-c", COMPILE, str(nvcc), str(tmp_path)], env=env,
                             stderr=subprocess.PIPE, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    pids = _compiler_pids(pids_file)
    assert all(_alive(p) for p in pids)
    assert os.getpgid(pids[0]) != os.getpgid(build.pid)   # the compiler has a group of its own
    build.send_signal(sig)
    build.wait(30)
    try:
        assert _all_gone(pids), f"compiler processes {pids} outlived the build ({sig.name})"
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_compile_timeout_kills_the_compiler_group(fake_nvcc, tmp_path: Path, monkeypatch) -> None:
    nvcc, pids_file = fake_nvcc
    monkeypatch.setenv("KVGEN_TEST_PIDS", str(pids_file))
    toolchain = Toolchain(nvcc=str(nvcc), version="13.0.0", version_sha256="x", archs=("sm_90",))
    with pytest.raises(CompileError, match="timed out"):
        compile_shared_library([Path("a.cu")], "sm_90a", [], Path("lib.so"), toolchain, timeout=1.5, cwd=tmp_path)
    assert _all_gone([int(p) for p in pids_file.read_text().split()])


def test_a_compiler_in_its_group_keeps_its_output_and_status() -> None:
    from kvgen.build.process import run_in_group

    done = run_in_group(["sh", "-c", "echo out; echo err >&2; exit 3"], timeout=30)
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")
    missing = run_in_group(["/nonexistent/nvcc", "--version"], timeout=30)
    assert missing.returncode == 1 and "cannot run /nonexistent/nvcc" in missing.stderr
