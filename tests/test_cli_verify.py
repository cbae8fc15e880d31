"""`kvgen verify`: a registry whose artifacts, versions and specs all match passes; a tampered
artifact (family library, score library or packer: every file the manifest lists) or a spec
edited since the build is reported with the file and the rebuild command."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvgen.cli import main
from kvgen.runtime.lookup import spec_file_sha256

from .conftest import SPECS_DIR
from .test_runtime_registry import fake_registry

FAMILY = "qwen3-8b"


@pytest.fixture
def setup(tmp_path: Path) -> tuple[Path, Path]:
    specs = tmp_path / "specs"
    specs.mkdir()
    shutil.copy(SPECS_DIR / f"{FAMILY}.yaml", specs)
    registry = fake_registry(tmp_path / "reg", "sm_90a", [FAMILY], spec_sha256=spec_file_sha256(specs / f"{FAMILY}.yaml"),
                             ops=("codec", "score", "pack"))
    return registry, specs


def verify(registry: Path, specs: Path) -> int:
    return main(["--specs", str(specs), "verify", "--registry", str(registry)])


def test_clean_registry_verifies(setup, capsys) -> None:
    assert verify(*setup) == 0
    assert "1 manifests, 1 families, 3 artifacts: all verified" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["libkvgen_qwen3_8b.so", "libkvgen_qwen3_8b_score.so", "libkvgen_qwen3_8b_pack.so"])
def test_tampered_artifact_is_reported(setup, capsys, name: str) -> None:
    registry, specs = setup
    artifact = registry / "sm_90a" / name
    artifact.write_bytes(artifact.read_bytes() + b"!")
    assert verify(registry, specs) == 1
    captured = capsys.readouterr()
    assert f"{name}: sha256 mismatch" in captured.err and "kvgen build --arch sm_90a --family qwen3-8b" in captured.err
    assert "1 problems" in captured.out and "Traceback" not in captured.err


def test_missing_or_unreadable_manifest_is_reported_without_a_traceback(setup, capsys) -> None:
    registry, specs = setup
    (registry / "sm_90a" / "libkvgen_qwen3_8b_pack.so").unlink()
    assert verify(registry, specs) == 1
    assert "artifact missing" in capsys.readouterr().err
    (registry / "sm_90a" / "manifest.json").write_text("{not json")
    assert verify(registry, specs) == 1
    captured = capsys.readouterr()
    assert "not a kvgen manifest" in captured.err and "1 manifests, 0 families" in captured.out


def test_spec_changed_since_the_build_is_reported(setup, capsys) -> None:
    registry, specs = setup
    spec = specs / f"{FAMILY}.yaml"
    spec.write_text(spec.read_text().replace("budget: 2048", "budget: 1024"))
    assert verify(registry, specs) == 1
    err = capsys.readouterr().err
    assert "changed since qwen3-8b was built" in err


def test_empty_registry_says_what_to_run(tmp_path: Path, capsys) -> None:
    assert verify(tmp_path / "nothing", tmp_path) == 1
    assert "no manifests; run: kvgen build" in capsys.readouterr().err


def test_verify_json_lists_the_counts_and_every_problem(setup, capsys) -> None:
    registry, specs = setup
    assert main(["--specs", str(specs), "verify", "--json", "--registry", str(registry)]) == 0
    assert json.loads(capsys.readouterr().out) == {"registry": str(registry), "ok": True, "manifests": 1,
                                                   "families": 1, "artifacts": 3, "problems": []}
    (registry / "sm_90a" / "libkvgen_qwen3_8b_pack.so").unlink()
    assert main(["--specs", str(specs), "verify", "--json", "--registry", str(registry)]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["ok"] and "artifact missing" in report["problems"][0]


def test_verify_of_an_empty_registry_fails(tmp_path: Path, capsys) -> None:
    assert main(["verify", "--json", "--registry", str(tmp_path)]) == 1
    assert json.loads(capsys.readouterr().out)["problems"] == [f"{tmp_path}: no manifests; run: kvgen build"]
