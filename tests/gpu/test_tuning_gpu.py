"""The tuner's GPU side on a real GPU: the correctness gate rejects broken candidates (wrong bytes,
a library of another family, a corrupt file), selection candidates of every route pass it and are
timed, and the one-machine mode builds, measures and writes a tuned config. Candidates are compiled on the GPU machine itself (it has nvcc), so nothing needs
carrying; skipped where there is no nvcc or no optuna.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from kvgen.build.compile import Toolchains, compile_one
from kvgen.build.job import BuildJob, load_spec_source, render_plans
from kvgen.lower.plan import default_params, f32_literal, plans_for
from kvgen.tuning.candidates import Candidate, Request, build_candidates, read_bundle, write_index
from kvgen.tuning.measure import measure_bundle, read_records
from kvgen.tuning.space import BUCKETS, config_id

from ..conftest import SPECS_DIR

pytestmark = pytest.mark.gpu

FAMILY = "qwen3-8b"


@pytest.fixture(scope="module")
def toolchains():
    from kvgen.build.nvcc import ToolchainError
    from kvgen.cli import discover_toolchains

    try:
        return discover_toolchains()
    except ToolchainError as exc:
        pytest.skip(f"no nvcc on this GPU machine: {exc}")


def _wrong_library(tmp: Path, toolchains) -> Path:
    """The family's library with the key buffer's global encode scale doubled: same name, ABI and
    layout, different bytes: only the oracle comparison can tell."""
    source = load_spec_source(SPECS_DIR / f"{FAMILY}.yaml")
    codec, compact = [p for p in plans_for(source.spec) if p.op in ("codec", "compact")]
    geometry = json.loads(json.dumps(codec.as_dict()["geometry"]))
    geometry["buffers"][0]["G"] = f32_literal(2.0)
    plans = [replace(codec, geometry=geometry), compact]
    job = BuildJob(source, "sm_90a", "nvcc", tuple(plans), render_plans(plans))
    outcome = compile_one(job, tmp / "cache", Toolchains(tuple(toolchains)))
    assert outcome.status != "failed", outcome.error
    return outcome.artifact


def codec_params(threads: int, in_flight: int) -> dict[str, int]:
    """A codec configuration with the other tunables at their defaults."""
    return {**default_params("codec"), "threads": threads, "in_flight": in_flight}


def test_the_gate_records_each_broken_candidate_with_its_failure_kind(tmp_path: Path, toolchains) -> None:
    source = load_spec_source(SPECS_DIR / f"{FAMILY}.yaml")
    other = load_spec_source(SPECS_DIR / "qwen3-8b-nhd.yaml")
    bundle = tmp_path / "bundle"
    good = build_candidates([Request(source, "codec", codec_params(256, 4)),
                             Request(other, "codec", codec_params(256, 4))], "sm_90a", bundle,
                            tmp_path / "cache", toolchains=toolchains)
    shutil.copyfile(_wrong_library(tmp_path, toolchains), bundle / "wrong.so")
    (bundle / "corrupt.so").write_bytes(b"\x7fELF not really")
    base = good[0]
    broken = [replace(base, config=config_id("codec", codec_params(128, 4)), params=codec_params(128, 4),
                      artifact="wrong.so"),
              replace(base, config=config_id("codec", codec_params(512, 4)), params=codec_params(512, 4),
                      artifact=good[1].artifact),                       # another family's library
              replace(base, config=config_id("codec", codec_params(64, 4)), params=codec_params(64, 4),
                      artifact="corrupt.so"),
              Candidate(FAMILY, "codec", "sm_90a", config_id("codec", codec_params(256, 8)), codec_params(256, 8),
                        "failed", error="ptxas error: too many resources requested")]
    write_index(bundle, "sm_90a", [base, *broken], read_bundle(bundle)["toolchains"])
    out = tmp_path / "m.jsonl"
    measure_bundle(bundle, out, families={FAMILY}, reps=5)
    status = {(r["config"], r["bucket"]): r["status"] for r in read_records(out)}
    buckets = [b.name for b in BUCKETS["codec"]]
    assert {status[(config_id("codec", codec_params(256, 4)), b)] for b in buckets} == {"ok"}
    assert {status[(config_id("codec", codec_params(128, 4)), b)] for b in buckets} == {"wrong"}
    assert {status[(config_id("codec", codec_params(512, 4)), b)] for b in buckets} == {"load"}
    assert {status[(config_id("codec", codec_params(64, 4)), b)] for b in buckets} == {"load"}
    assert {status[(config_id("codec", codec_params(256, 8)), b)] for b in buckets} == {"build"}
    ok = [r for r in read_records(out) if r["status"] == "ok"]
    assert all(r["median_ms"] > 0 and r["environment"]["toolchain"]["nvcc"] for r in ok)


def test_one_machine_mode_builds_measures_and_writes_a_tuned_config(tmp_path: Path, toolchains) -> None:
    pytest.importorskip("optuna")
    from kvgen.cli import main

    rc = main(["tune", "--family", "qwen3-8b-fp8", "--op", "codec", "--arch", "sm_90a", "--bucket", "small",
               "--trials", "3", "--tuning", str(tmp_path / "tuning"), "--storage", f"sqlite:///{tmp_path / 's.db'}",
               "--cache-dir", str(tmp_path / "cache")])
    assert rc == 0
    data = json.loads((tmp_path / "tuning" / "sm_90a" / "qwen3-8b-fp8.json").read_text())
    small = data["ops"]["codec"]["buckets"]["small"]
    assert small["trials"] == 3 and small["failed"] == 0 and small["best_ms"] <= small["default_ms"]
    env = data["ops"]["codec"]["environment"]
    assert env["gpu"] and env["toolchain"]["nvcc"]


def test_selection_candidates_of_every_route_pass_the_gate(tmp_path: Path, toolchains) -> None:
    """Selection libraries (rows read twice / once, comparison / histogram passes) built here, each
    bit-identical to the oracle in every mode, then timed in both buckets; another family's
    library is refused at load."""
    source = load_spec_source(SPECS_DIR / f"{FAMILY}.yaml")
    other = load_spec_source(SPECS_DIR / "gpt-oss-20b.yaml")
    routes = [{}, {"stats_resident": 16384, "stats_warps": 16, "select_route": 1, "radix_bits": 8, "block": 4096,
                   "select_warps": 16}]
    requests = [Request(source, "select", {**default_params("select"), **r}) for r in routes]
    bundle = tmp_path / "bundle"
    built = build_candidates([*requests, Request(other, "select", default_params("select"))], "sm_90a", bundle,
                             tmp_path / "cache", toolchains=toolchains)
    foreign = replace(built[0], config=config_id("select", {**default_params("select"), "select_warps": 8}),
                      params={**default_params("select"), "select_warps": 8}, artifact=built[2].artifact)
    write_index(bundle, "sm_90a", [*built[:2], foreign], read_bundle(bundle)["toolchains"])
    out = tmp_path / "m.jsonl"
    measure_bundle(bundle, out, families={FAMILY}, reps=5)
    status = {(r["config"], r["bucket"]): r["status"] for r in read_records(out)}
    for c in built[:2]:
        assert {status[(c.config, b.name)] for b in BUCKETS["select"]} == {"ok"}
    assert {status[(foreign.config, b.name)] for b in BUCKETS["select"]} == {"load"}
    assert all(r["environment"]["toolchain"]["triton"] for r in read_records(out) if r["status"] == "ok")
