"""The no-op fast path of ``kvgen build`` (``kvgen.build.stamp``): a build whose inputs and outputs
are as the last build left them returns that build's report without rendering or probing a
toolchain, and any change to what decides an artifact -- spec, template, kvgen code, toolchain,
tuning, the published files themselves -- takes the full build again. Correctness, not timing
(``scripts/bench_noop_build.py`` times it).

The stamp logic is the same for every backend, so these tests build the Triton AOT ops (packer and
selection) through a stand-in for their compile that caches the rendered module's text as the
"library": fast, and the artifact shows which template made it.
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from kvgen import __version__
from kvgen.artifacts.manifest import read_manifest
from kvgen.build import compile as compile_module
from kvgen.build.cache import entry_dir, get_or_build
from kvgen.build.job import BuildJob, BuildOutcome
from kvgen.build.nvcc import Toolchain
from kvgen.build.pipeline import BuildReport, build
from kvgen.build.stamp import code_roots, tree_digest
from kvgen.lower.tuned import TuningFileError
from kvgen.render.source import TEMPLATES_DIR

from .conftest import SPECS_DIR

FAMILY = "qwen3-8b"
OTHER = "mistral-7b"


class Probe:
    """A ``toolchains`` function that counts its calls (the fast path must make none)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> list:
        self.calls += 1
        return [Toolchain(nvcc="/stand-in/nvcc", version="13.0.88", version_sha256="a" * 64, archs=("sm_90",))]


def _text_as_library(job: BuildJob, cache_dir: Path, toolchain: Toolchain) -> BuildOutcome:
    (text,) = job.rendered.values()
    key = hashlib.sha256(text.encode()).hexdigest()
    entry = entry_dir(cache_dir, __version__, job.arch, f"{job.family}-{job.ops[0]}", key)

    def write(tmp: Path) -> dict:
        (tmp / job.artifact).write_text(text, encoding="utf-8")
        return {"artifact": job.artifact}

    meta, hit = get_or_build(entry, key, write)
    return BuildOutcome(job.family, job.arch, job.backend, "hit" if hit else "built", 0.0, entry / meta["artifact"],
                        key, sha256=meta["artifact_sha256"])


@pytest.fixture(autouse=True)
def _stand_in_compile(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compile_module, "compile_aot", _text_as_library)


@pytest.fixture
def work(tmp_path: Path) -> Path:
    (tmp_path / "specs").mkdir()
    for family in (FAMILY, OTHER):
        shutil.copy(SPECS_DIR / f"{family}.yaml", tmp_path / "specs")
    shutil.copytree(TEMPLATES_DIR, tmp_path / "templates")
    (tmp_path / "nvcc").write_text("#!/bin/sh\n")      # stands for a toolchain file the probe would read
    return tmp_path


def _build(work: Path, toolchains: Probe | list[Toolchain], families=(FAMILY,), environ: dict | None = None
           ) -> BuildReport:
    return build([work / "specs" / f"{f}.yaml" for f in families], ["sm_90a"], work / "generated", work / "cache",
                 toolchains=toolchains, registry_dir=work / "registry", tuning_dir=work / "tuning",
                 tuning_environ=environ or {}, templates_dir=work / "templates", kernels_dir=work / "kernels",
                 backends=("triton-aot",), noop_stamps=True, toolchain_files=[work / "nvcc"])


def _warm(work: Path) -> Probe:
    probe = Probe()
    first = _build(work, probe)
    assert first.ok and not first.noop and probe.calls == 1
    assert [o.status for o in first.outcomes] == ["built", "built"]   # pack and select
    return probe


def test_a_no_op_build_replays_the_report_without_rendering_or_probing(work: Path) -> None:
    probe = _warm(work)
    full = _build(work, Probe())                  # stamps from the first build; this one rewrote nothing
    again = _build(work, probe)
    assert again.noop and probe.calls == 1
    assert again.outcomes == full.outcomes and again.manifests == full.manifests and again.rendered == []
    assert [(o.status, o.artifact) for o in again.outcomes] == [
        ("hit", work / "registry" / "sm_90a" / "libkvgen_qwen3_8b_pack.so"),
        ("hit", work / "registry" / "sm_90a" / "libkvgen_qwen3_8b_select.so")]


def test_a_changed_spec_rebuilds(work: Path) -> None:
    probe = _warm(work)
    spec = work / "specs" / f"{FAMILY}.yaml"
    spec.write_text(spec.read_text().replace("budget: 2048", "budget: 1024"))
    report = _build(work, probe)
    assert not report.noop and probe.calls == 2
    entry = read_manifest(work / "registry" / "sm_90a" / "manifest.json").family(FAMILY)
    assert entry.spec_sha256 == hashlib.sha256(spec.read_bytes()).hexdigest()
    spec.write_text(spec.read_text() + "# a comment changes the bytes, so the manifest's spec sha256 too\n")
    assert not _build(work, probe).noop and _build(work, probe).noop


def test_a_changed_template_rebuilds(work: Path) -> None:
    probe = _warm(work)
    template = work / "templates" / "pack.py.j2"
    template.write_text(template.read_text() + "\n# one more line\n")
    report = _build(work, probe)
    assert not report.noop and [o.status for o in report.outcomes] == ["built", "hit"]   # pack rebuilt, select not
    assert "# one more line" in (work / "registry" / "sm_90a" / "libkvgen_qwen3_8b_pack.so").read_text()


def test_the_code_digest_covers_the_package_and_outside_folders(work: Path) -> None:
    roots = code_roots(work / "templates", work / "kernels")
    before = tree_digest(roots)
    (work / "templates" / "README.md").write_text("changed")
    assert tree_digest(roots) != before
    assert Path(roots[0], "build", "stamp.py").is_file()      # kvgen's own code is the first root


def test_a_changed_toolchain_file_rebuilds(work: Path) -> None:
    probe = _warm(work)
    (work / "nvcc").write_text("#!/bin/sh\n# another nvcc\n")
    assert not _build(work, probe).noop and probe.calls == 2
    assert _build(work, probe).noop and probe.calls == 2


def test_tampered_or_missing_outputs_are_rebuilt(work: Path) -> None:
    probe = _warm(work)
    artifact = work / "registry" / "sm_90a" / "libkvgen_qwen3_8b_pack.so"
    good = artifact.read_bytes()
    artifact.write_bytes(b"tampered")
    assert not _build(work, probe).noop and artifact.read_bytes() == good
    generated = next((work / "generated" / FAMILY).glob("pack.py"))
    generated.unlink()
    assert not _build(work, probe).noop and generated.is_file()
    (work / "registry" / "sm_90a" / "manifest.json").unlink()
    report = _build(work, probe)
    assert not report.noop and read_manifest(report.manifests[0]).family(FAMILY) is not None


def test_tuning_inputs_are_part_of_the_key(work: Path) -> None:
    probe = _warm(work)
    override = {"KVGEN_TUNED_PARAMS": f"{FAMILY}:pack:block=64"}
    tuned = _build(work, probe, environ=override)
    assert not tuned.noop and tuned.tuning_notes == [f"KVGEN_TUNED_PARAMS overrides: {FAMILY}:pack:block=64"]
    replayed = _build(work, probe, environ=override)
    assert replayed.noop and replayed.tuning_notes == tuned.tuning_notes
    off = _build(work, probe, environ={"KVGEN_TUNING": "off"})
    assert not off.noop and off.tuning_notes[0].startswith("KVGEN_TUNING=off")
    (work / "tuning" / "sm_90a").mkdir(parents=True)
    (work / "tuning" / "sm_90a" / f"{FAMILY}.json").write_text("not json")
    broken = _build(work, probe)
    assert not broken.noop and "not a readable tuned-config file" in broken.tuning_notes[0]
    assert _build(work, probe).tuning_notes == broken.tuning_notes     # replayed with the file's note
    with pytest.raises(TuningFileError, match="KVGEN_TUNED_PARAMS item 'nonsense'"):
        _build(work, probe, environ={"KVGEN_TUNED_PARAMS": "nonsense"})


def test_building_another_family_keeps_the_first_ones_stamp(work: Path) -> None:
    probe = _warm(work)
    assert not _build(work, probe, families=(OTHER,)).noop       # rewrites the shared manifest
    both = _build(work, probe, families=(FAMILY, OTHER))
    assert both.noop and probe.calls == 2 and [o.family for o in both.outcomes] == [OTHER, OTHER, FAMILY, FAMILY]


def test_given_toolchains_are_named_by_identity(work: Path) -> None:
    chain = Toolchain(nvcc=str(work / "nvcc"), version="13.0.88", version_sha256="a" * 64, archs=("sm_90",))
    assert not _build(work, [chain]).noop
    assert _build(work, [chain]).noop
    assert not _build(work, [replace(chain, version="13.5.37")]).noop
