"""Issue 15, the CLI never shows a traceback for bad input: a read-only or full cache, registry or
output directory, odd paths in messages (rich markup must not read ``[/x]``), a directory given as a
spec. Each is one plain-text line on stderr and exit 2 (fix the input or the environment) or 1 (a
check failed).

The read-only directory is real (``/sys``: root may not create anything there either); the full
disk is simulated by making the first temp file or directory raise ENOSPC.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

import pytest

from kvgen.cli import main

from .conftest import SPECS_DIR

FAMILY = "falcon-7b"
READ_ONLY = Path("/sys/kvgen-hardening")


@pytest.fixture
def specs(tmp_path: Path) -> Path:
    folder = tmp_path / "specs"
    folder.mkdir()
    shutil.copy(SPECS_DIR / f"{FAMILY}.yaml", folder)
    return folder


def _build(specs: Path, tmp_path: Path, **dirs: Path) -> list[str]:
    paths = {"cache_dir": tmp_path / "cache", "registry": tmp_path / "reg", "generated": tmp_path / "gen", **dirs}
    return ["--specs", str(specs), "build", "--arch", "sm_90a", "--family", FAMILY,
            *(arg for key, path in paths.items() for arg in (f"--{key.replace('_', '-')}", str(path)))]


def _plain_error(capsys) -> str:
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    lines = [line for line in captured.err.splitlines() if line.startswith("error")]
    assert lines, captured.err
    return lines[0]


def _need_read_only() -> None:
    try:
        READ_ONLY.mkdir()
    except OSError:
        return
    READ_ONLY.rmdir()
    pytest.skip("/sys is writable here")


@pytest.mark.parametrize("where", ["cache_dir", "generated", "registry"])
def test_a_read_only_directory_is_one_plain_line(specs: Path, tmp_path: Path, capsys, where: str) -> None:
    _need_read_only()
    if where != "generated" and not shutil.which("nvcc"):
        pytest.skip("the build stops earlier without nvcc")
    assert main(_build(specs, tmp_path, **{where: READ_ONLY})) == 2
    assert str(READ_ONLY) in _plain_error(capsys)
    if where == "registry":   # refused before compiling, not after
        assert not list((tmp_path / "cache").rglob("*.so"))


def test_a_full_disk_while_rendering_is_one_plain_line(specs: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    from kvgen import files

    def full(*args, dir=None, **kwargs):  # noqa: A002 - tempfile's signature
        raise OSError(errno.ENOSPC, "No space left on device", str(dir))

    monkeypatch.setattr(files.tempfile, "mkstemp", full)
    assert main(_build(specs, tmp_path)) == 2
    assert "No space left on device" in _plain_error(capsys)


def test_a_full_cache_disk_is_one_plain_line(specs: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    if not shutil.which("nvcc"):
        pytest.skip("the build stops earlier without nvcc")
    from kvgen.build import cache

    real = cache.tempfile.mkdtemp

    def full(*args, **kwargs):   # only the cache's disk is full
        where = kwargs.get("dir")
        if where is not None and Path(where).is_relative_to(tmp_path / "cache"):
            raise OSError(errno.ENOSPC, "No space left on device", str(where))
        return real(*args, **kwargs)

    monkeypatch.setattr(cache.tempfile, "mkdtemp", full)
    assert main(_build(specs, tmp_path)) == 2
    line = _plain_error(capsys)
    assert "No space left on device" in line and str(tmp_path / "cache") in line


def test_paths_with_brackets_are_printed_as_they_are(tmp_path: Path, capsys) -> None:
    folder = tmp_path / "[/x]" / "[red]"
    folder.mkdir(parents=True)
    bad = folder / "a.yaml"
    bad.write_text("name: a\nlayers: [\n")
    assert main(["validate", str(bad)]) == 1
    assert str(bad) in _plain_error(capsys)
    assert main(["validate", str(folder)]) == 1      # a directory, not a spec file
    assert str(folder) in _plain_error(capsys)


def test_verify_of_a_registry_that_is_a_file_or_unreadable(tmp_path: Path, capsys) -> None:
    registry = tmp_path / "reg"
    (registry / "sm_90a").mkdir(parents=True)
    (registry / "sm_90a" / "manifest.json").mkdir()   # a directory where the manifest should be
    assert main(["verify", "--registry", str(registry)]) == 1
    assert "unreadable manifest" in _plain_error(capsys)
