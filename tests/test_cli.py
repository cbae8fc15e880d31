"""The ``kvgen`` command line as a newcomer meets it: exit statuses (0 ok, 1 a check failed, 2 bad
usage), ``--json`` documents, arch strings, missing specs folders, plain-text errors, progress
lines without a TTY, and a base install (no extras) that still runs every verb needing none.

In-process through ``kvgen.cli.main``; a subprocess only for the base install and ``python -m kvgen``.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvgen import cli
from kvgen.build.job import BuildOutcome
from kvgen.build.pipeline import BuildReport
from kvgen.cli import main

from .conftest import ROOT, SPECS_DIR

FAMILY = "qwen3-8b"


@pytest.fixture
def specs(tmp_path: Path) -> Path:
    folder = tmp_path / "specs"
    folder.mkdir()
    shutil.copy(SPECS_DIR / f"{FAMILY}.yaml", folder)
    return folder


def json_out(capsys) -> dict:
    """The one JSON document a ``--json`` verb prints: stdout must hold nothing else."""
    return json.loads(capsys.readouterr().out)


# ---------------------------------------------------------------- exit statuses and --json


def test_help_documents_the_exit_statuses(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    assert "exit status: 0 ok, 1 a check failed" in capsys.readouterr().out


def test_list_and_validate_json(specs: Path, capsys) -> None:
    assert main(["--specs", str(specs), "list", "--json"]) == 0
    listed = json_out(capsys)
    row = listed["families"][0]
    assert row["family"] == FAMILY and row["rope"] == {"placement": "full", "start": 0, "width": 128,
                                                       "pairing": "half"}
    assert main(["--specs", str(specs), "validate", "--json"]) == 0
    assert json_out(capsys) == {"valid": [FAMILY], "invalid": []}


def test_invalid_spec_is_a_failed_check_reported_as_plain_text(specs: Path, capsys) -> None:
    folder = specs / "odd[" / "x]"            # the path holds "[/x]", a rich closing tag
    folder.mkdir(parents=True)
    bad = folder / "broken.yaml"
    bad.write_text((specs / f"{FAMILY}.yaml").read_text().replace("layers: 36", "layers: many"))
    assert main(["--specs", str(specs), "validate", str(specs / f"{FAMILY}.yaml"), str(bad)]) == 1
    captured = capsys.readouterr()
    assert "1 valid, 1 invalid" in captured.out
    assert f"error {bad}:" in captured.err and "layers" in captured.err and "Traceback" not in captured.err
    assert main(["--specs", str(specs), "validate", "--json", str(bad)]) == 1
    invalid = json_out(capsys)["invalid"]
    assert invalid[0]["file"] == str(bad) and invalid[0]["issues"][0]["key"] == "layers"


def test_validate_shows_an_accepted_regex_unchanged(specs: Path, capsys) -> None:
    spec = specs / f"{FAMILY}.yaml"
    spec.write_text(spec.read_text().replace(f"name: {FAMILY}", "name: Bad_Name!"))
    assert main(["--specs", str(specs), "validate"]) == 1
    assert "'^[a-z][a-z0-9]*([-_.][a-z0-9]+)*$'" in capsys.readouterr().err


@pytest.mark.parametrize("verb", [["list"], ["validate"], ["build", "--render-only"], ["build", "--check"]])
def test_missing_or_empty_specs_folder_is_bad_usage(tmp_path: Path, capsys, verb: list[str]) -> None:
    missing = tmp_path / "nowhere"
    assert main(["--specs", str(missing), *verb]) == 2
    assert f"{missing}: no such specs folder" in capsys.readouterr().err
    missing.mkdir()
    assert main(["--specs", str(missing), *verb]) == 2
    assert f"{missing}: no spec files" in capsys.readouterr().err


def test_unknown_family_is_bad_usage(specs: Path, capsys) -> None:
    assert main(["--specs", str(specs), "show", "nope"]) == 2
    assert f"no family 'nope' in {specs}; known families: {FAMILY}" in capsys.readouterr().err


def test_show_names_the_rope_span_pairing_and_policy(capsys) -> None:
    assert main(["show", FAMILY]) == 0
    assert "rope: full, span start 0 width 128, pairing half; cold page stores it quantized" in capsys.readouterr().out
    assert main(["show", "deepseek-v3-lossless-rope"]) == 0
    assert "rope: trailing, span start 512 width 64, pairing interleaved; cold page stores it lossless" in \
        capsys.readouterr().out


def test_show_config_json(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(cli, "discover_toolchains", lambda: [])
    assert main(["show-config", "--json", "--cache-dir", str(tmp_path)]) == 0
    config = json_out(capsys)
    assert config["toolchains"] == [] and config["paths"]["cache dir"].startswith(str(tmp_path))
    assert config["versions"]["python"] == sys.version.split()[0]


def test_build_check_json(specs: Path, tmp_path: Path, capsys) -> None:
    generated = tmp_path / "generated"
    args = ["--specs", str(specs), "build", "--generated", str(generated)]
    assert main([*args, "--check", "--json"]) == 1
    assert not json_out(capsys)["current"]
    assert main([*args, "--render-only", "--json"]) == 0
    assert json_out(capsys)["families"] == [FAMILY]
    assert main([*args, "--check", "--json"]) == 0
    assert json_out(capsys) == {"generated": str(generated), "current": True, "differ": []}


# ---------------------------------------------------------------- arch strings


@pytest.mark.parametrize("arch", ["sm_89", "sm_120", "sm90a", "9.0", "sm_90a;8.0"])
def test_unknown_arch_is_bad_usage_before_anything_is_built(specs: Path, tmp_path: Path, capsys, arch: str) -> None:
    generated = tmp_path / "generated"
    assert main(["--specs", str(specs), "build", "--arch", arch, "--generated", str(generated)]) == 2
    err = capsys.readouterr().err
    assert "--arch:" in err and "accepted: sm_90a, sm_100a, sm_100f, sm_103a, sm_107a" in err
    assert not generated.exists()


def test_bad_arch_list_variable_is_bad_usage(specs: Path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("KVGEN_CUDA_ARCH_LIST", "9.0")
    assert main(["--specs", str(specs), "build"]) == 2
    assert "$KVGEN_CUDA_ARCH_LIST: '9.0' is not a kvgen target (did you mean sm_90a?)" in capsys.readouterr().err


def test_an_arch_no_selected_spec_targets_is_bad_usage(specs: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(cli, "discover_toolchains", lambda: pytest.fail("nothing may build"))
    assert main(["--specs", str(specs), "build", "--arch", "sm_100f"]) == 2
    assert "no selected spec targets sm_100f (their targets: sm_90a, sm_100a, sm_103a, sm_107a)" in \
        capsys.readouterr().err


def test_tune_arch_takes_the_same_spellings(specs: Path, capsys) -> None:
    assert main(["--specs", str(specs), "tune", "--arch", "9.0b"]) == 2
    assert "--arch: '9.0b' is not a kvgen target" in capsys.readouterr().err


# ---------------------------------------------------------------- build output


def fake_build(outcomes: list[BuildOutcome]):
    """A ``kvgen.build.pipeline.build`` that reports ``outcomes`` through the progress it is given."""
    def build(sources, archs, *args, progress, **kwargs):  # noqa: ANN001, ANN002, ANN003 - build()'s signature
        progress.start(len(outcomes))
        for outcome in outcomes:
            progress.advance(outcome)
        return BuildReport(outcomes=outcomes, manifests=[Path("reg/sm_90a/manifest.json")])
    return build


OUTCOMES = [BuildOutcome(FAMILY, "sm_90a", "nvcc", "built", 12.5, Path("reg/sm_90a/libkvgen_qwen3_8b.so")),
            BuildOutcome(FAMILY, "sm_90a", "cute", "failed", 3.0, error="error: [bold] not markup")]


def test_build_without_a_tty_prints_a_line_per_finished_job_and_json(specs: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(cli, "discover_toolchains", lambda: [])
    monkeypatch.setattr("kvgen.build.pipeline.build", fake_build(OUTCOMES))
    assert main(["--specs", str(specs), "build", "--arch", "90a", "--json"]) == 1
    captured = capsys.readouterr()
    assert captured.err.splitlines()[:2] == [f"[1/2] {FAMILY} sm_90a nvcc: built (12.5 s)",
                                             f"[2/2] {FAMILY} sm_90a cute: failed (3.0 s)"]
    report = json.loads(captured.out)
    assert not report["ok"] and report["counts"] == {"built": 1, "hit": 0, "failed": 1, "skipped": 0}
    assert report["outcomes"][1]["error"] == "error: [bold] not markup"
    assert main(["--specs", str(specs), "build", "--arch", "sm_90a"]) == 1
    captured = capsys.readouterr()
    assert "1 built, 0 hit, 1 failed, 0 skipped" in captured.out and "[bold] not markup" in captured.err


def test_a_bad_tuned_params_override_is_bad_usage(specs: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(cli, "discover_toolchains", lambda: [])
    monkeypatch.setenv("KVGEN_TUNED_PARAMS", "nonsense")
    assert main(["--specs", str(specs), "build", "--arch", "sm_90a", "--generated", str(tmp_path / "g"),
                 "--cache-dir", str(tmp_path / "c"), "--registry", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "KVGEN_TUNED_PARAMS item 'nonsense'" in err and "Traceback" not in err


@pytest.mark.parametrize("value, reason", [
    ("nonsense", "expected family:op:assignments"),
    (f"{FAMILY}:codec:threads=abc", "threads='abc' is not an integer"),
    (f"{FAMILY}:nosuch:x=1", "unknown op 'nosuch'; ops: codec, compact, pack, score"),
    (f"{FAMILY}:codec:threads=100", "codec: threads=100 is not one of (64, 128, 256, 512)"),
    (f"{FAMILY}:codec:threads=1=2", "'threads=1=2' is not name=value"),
    ("tuning/sm_90a/qwen3-8b.json", "an override string, not JSON or a file"),
    ('{"qwen3-8b": {"codec": {"threads": 512}}}', "an override string, not JSON or a file"),
])
def test_every_bad_tuned_params_value_is_one_line_naming_the_variable(specs: Path, tmp_path: Path, capsys,
                                                                       monkeypatch, value: str, reason: str) -> None:
    monkeypatch.setattr(cli, "discover_toolchains", lambda: pytest.fail("a bad override is refused first"))
    monkeypatch.setenv("KVGEN_TUNED_PARAMS", value)
    assert main(["--specs", str(specs), "build", "--arch", "sm_90a", "--generated", str(tmp_path / "g"),
                 "--cache-dir", str(tmp_path / "c"), "--registry", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error KVGEN_TUNED_PARAMS ") and reason in err and err.count("\n") == 1, err


# ---------------------------------------------------------------- tune, demo


def test_tune_prints_the_files_it_wrote_and_a_line_per_finished_study(specs: Path, tmp_path: Path, capsys,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("optuna")
    from .tuning_data import use_grid_space, write_codec_measurements

    use_grid_space(monkeypatch.setitem)   # every configuration it may sample is measured
    measurements = write_codec_measurements(tmp_path / "m.jsonl")
    tuning = tmp_path / "tuning"
    # a few trials: what is printed is the point here (whole grids: tests/test_tuning.py)
    argv = ["--specs", str(specs), "tune", "--family", FAMILY, "--op", "codec", "--arch", "sm_90a", "--strategy",
            "random", "--trials", "6", "--measurements", str(measurements), "--storage",
            f"sqlite:///{tmp_path / 's.db'}", "--tuning", str(tuning)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert f"wrote {tuning / 'sm_90a' / f'{FAMILY}.json'} (codec)" in captured.out
    lines = [line for line in captured.err.splitlines() if line.startswith(f"{FAMILY} codec sm_90a ")]
    assert [line.split(":")[0] for line in lines] == [f"{FAMILY} codec sm_90a {b}" for b in ("small", "large",
                                                                                              "offload")]
    assert all(" trials (" in line and ", best threads=" in line for line in lines), lines
    assert main([*argv, "--no-write"]) == 0
    assert f"--no-write: nothing written to {tuning}" in capsys.readouterr().out


def test_demo_without_a_gpu_asks_for_the_cpu_oracle_and_warns_at_full_size(capsys, monkeypatch) -> None:
    ran = []
    monkeypatch.setattr(cli, "_has_cuda", lambda: False)
    monkeypatch.setattr("kvgen.demo.run", lambda args: ran.append(args.device) or 0)
    assert main(["demo"]) == 2 and ran == []
    err = capsys.readouterr().err
    assert "no CUDA device here" in err and "--device cpu --small (seconds)" in err and err.count("\n") == 1
    assert main(["demo", "--device", "cpu"]) == 0 and ran == ["cpu"]
    err = capsys.readouterr().err
    assert err.startswith("warning --device cpu without --small: the CPU oracle runs the full-size scenario")
    assert err.count("\n") == 1
    assert main(["demo", "--device", "cpu", "--small"]) == 0 and capsys.readouterr().err == ""


# ---------------------------------------------------------------- base install


# Makes the extras' modules absent, as on a base install: the same ModuleNotFoundError Python raises.
ABSENT = """
import importlib.abc, sys
ABSENT = ("optuna", "psycopg2", "triton", "cutlass", "matplotlib")
class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Absent())
"""


def run_without_extras(*argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``python -m kvgen ARGV`` in a fresh interpreter where the extras' modules are absent."""
    code = ABSENT + f"sys.argv = ['kvgen', *{list(argv)!r}]\nimport runpy\nrunpy.run_module('kvgen', run_name='__main__')\n"
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_base_install_runs_every_verb_that_needs_no_extra(tmp_path: Path) -> None:
    """A base install (``pip install kvgen``, no extras), emulated: a throwaway venv would have to
    install torch (a base dependency) and takes minutes, so the extras' modules (optuna, psycopg2,
    triton, cutlass, matplotlib) are made unimportable by a ``sys.meta_path`` finder in a fresh
    interpreter, which then runs ``python -m kvgen`` for each verb."""
    registry = tmp_path / "registry"
    for argv, status in [(["--help"], 0), (["validate"], 0), (["list", "--json"], 0), (["show", FAMILY], 0),
                         (["build", "--check"], 0), (["show-config"], 0), (["tune", "--help"], 0),
                         (["demo", "--help"], 0), (["bench", "--help"], 0),
                         (["verify", "--registry", str(registry)], 1),
                         (["clear-cache", "--cache-dir", str(tmp_path / "cache")], 0),
                         (["wheel", "--registry", str(registry), "--out", str(tmp_path / "dist")], 1)]:
        proc = run_without_extras(*argv)
        assert proc.returncode == status, (argv, proc.stderr)
        assert "Traceback" not in proc.stderr, (argv, proc.stderr)


def test_a_verb_needing_an_extra_names_it_in_one_line(tmp_path: Path) -> None:
    measurements = tmp_path / "m.jsonl"
    measurements.write_text("")
    proc = run_without_extras("tune", "--family", FAMILY, "--op", "codec", "--measurements", str(measurements),
                              "--no-write")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip() == "error kvgen tune needs optuna: pip install 'kvgen[tune]'"
