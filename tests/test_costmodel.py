"""The static cost model (kvgen.tuning.costmodel), on the CPU.

- feature extraction: a committed cuobjdump listing of a tiny kernel (tests/data/costmodel/tiny.cu,
  compiled for sm_90a and sm_100a): resources, the loop, its bytes per thread, the SM100 hardware
  E2M1 cvt counted where it is and nowhere else;
- the model: residency limits, what more bytes in flight or more registers do, a launch that does
  not fit, a walk step bounded by its prefetched loads' latency (model 6);
- compaction's tile: the model's ``compact_tile`` against the kernel's own ``tile_moves``
  (tests/csrc/compact_tile_check.cu, built on the host by nvcc);
- the targets: the H100 table (``validate --gpu h100``);
- validation arithmetic (Spearman, the flat-study rule);
- precedence at build time: a measured entry for the build's toolchain always wins over a
  model-tuned one, which is used where no measured entry applies;
- ``kvgen tune --measurements`` replacing a model-tuned pick and recording how far it was off.
"""

from __future__ import annotations

import itertools
import json
import math
import subprocess
from pathlib import Path

import pytest

from kvgen.lower.plan import default_params
from kvgen.lower.tuned import MEASURED, MODEL, BuildEnvironment, load_tuned, tuning_path
from kvgen.lower.plan import TUNABLES
from kvgen.tuning.costmodel.features import KernelFeatures, Mix, kernel_features, parse_resources, parse_sass
from kvgen.tuning.costmodel.model import (
    VERSION, Launch, Phase, Walk, estimate, l1_wavefronts, resident_ctas, walk_time)
from kvgen.tuning.costmodel.targets import TARGETS, gpu_target, target
from kvgen.tuning.costmodel.validate import noise_band, spearman, spearman_ceiling, study_verdict
from kvgen.tuning.costmodel.workload import compact_launches, compact_tile, score_wavefronts
from kvgen.tuning.space import config_id

from .tuning_data import use_grid_space, write_codec_measurements

DATA = Path(__file__).parent / "data" / "costmodel"
TILE_SRC = Path(__file__).parent / "csrc" / "compact_tile_check.cu"
H200 = target("sm_90a")


def tiny(arch: str):
    sass = parse_sass((DATA / f"tiny.{arch}.sass").read_text())
    resources = parse_resources((DATA / f"tiny.{arch}.resources").read_text())
    (name,) = sass
    return kernel_features(name, sass[name], resources[name])


# ---------------------------------------------------------------- features


@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_the_tiny_kernels_resources_and_loop_are_read(arch: str) -> None:
    k = tiny(arch)
    assert "tiny_kernel" in k.name
    # cuobjdump's SHARED: the 128-byte stage plus the 1 KiB the driver reserves per CTA
    assert 0 < k.registers <= 255 and k.shared_bytes == 128 + 1024 and k.local_bytes == 0
    (loop,) = k.loops                                   # one grid-stride loop
    assert loop.memory["global_load"] == 1 and loop.memory["global_store"] == 1
    assert loop.memory["shared_store"] == 1 and loop.memory["shared_load"] == 1
    assert loop.load_bytes == 8 and loop.global_bytes == 9      # a float2 in, a byte out
    assert loop.per_pipe["control"] >= 3                        # the two barriers and the branch


def test_the_sm100_hardware_fp4_cvt_is_visible_and_sm90_rounds_in_software() -> None:
    hopper, blackwell = tiny("sm_90a"), tiny("sm_100a")
    assert blackwell.loops[0].hardware_fp4 == 1 and blackwell.static.hardware_fp4 == 1
    assert hopper.static.hardware_fp4 == 0
    assert hopper.loops[0].per_pipe["conversion"] == 2          # F2I per code on sm_90a
    assert blackwell.loops[0].per_pipe["conversion"] == 1       # one F2FP.E2M1 for both


# ---------------------------------------------------------------- the model


def _mix(load_bytes: int = 16, alu: int = 10) -> Mix:
    per_pipe = {"alu": alu, "fma": 0, "imad": 0, "conversion": 0, "mufu": 0, "memory": 2, "uniform": 0,
                "control": 1, "other": 0}
    return Mix(sum(per_pipe.values()), per_pipe, {"global_load": 1, "global_store": 1}, 2 * load_bytes,
               load_bytes, 0, 0)


def _launch(registers: int = 32, threads: int = 256, ctas: int = 10_000, in_flight: float = 16.0,
            shared: int = 1024) -> Launch:
    kernel = tiny("sm_90a")
    kernel = type(kernel)(kernel.name, registers, shared, 0, 0, kernel.static, kernel.loops)
    return Launch("k", kernel, ctas, threads, 0, (Phase("copy", 1e9, "hbm", _mix(int(in_flight)), in_flight),))


def test_residency_takes_the_tightest_limit() -> None:
    k = _launch().kernel
    assert resident_ctas(k, 256, 0, H200) == 8                                    # 64 warps / 8
    heavy = type(k)(k.name, 128, 0, 0, 0, k.static, k.loops)
    assert resident_ctas(heavy, 256, 0, H200) == 2                                # 65536 / (128 * 256)
    assert resident_ctas(k, 64, 100 * 1024, H200) == 2                             # 228 KiB of shared memory
    assert resident_ctas(k, 32, 0, H200) == 32                                    # the CTA limit


def test_more_bytes_in_flight_or_fewer_registers_is_never_slower() -> None:
    few, many = estimate([_launch(in_flight=4)], H200), estimate([_launch(in_flight=64)], H200)
    assert many.seconds <= few.seconds
    assert estimate([_launch(registers=32)], H200).seconds <= estimate([_launch(registers=200)], H200).seconds


def test_a_streaming_launch_is_bound_by_hbm_bandwidth() -> None:
    e = estimate([_launch(in_flight=64)], H200)
    floor = 1e9 / (H200.hbm_gbs * H200.hbm_efficiency * 1e9)
    assert floor <= e.seconds <= 1.2 * floor + H200.launch_us * 1e-6


def _walk(threads: int, tile: int, ctas: int = 288, moves: int = 2048, row: int = 256) -> Launch:
    kernel = _launch().kernel
    walk = Walk(math.ceil(moves / tile), 2.0 * tile * 2 * row, ("hbm", "l2"), prologue=3)
    return Launch("compact", kernel, ctas, threads, 0,
                  (Phase("move", 4.0 * ctas * moves * row, "hbm", _mix(16), 16.0, walk=walk),))


def test_a_dependent_chain_walk_pays_its_latency_per_tile_and_little_per_warp() -> None:
    """Model 2's walk: few CTAs are chain-bound, four times the tiles take over twice as long (each
    tile a chain, less to move per tile); the same tile over fewer warps (less in flight) is slower;
    many CTAs per SM make it bandwidth-bound."""
    small, large = estimate([_walk(256, 8, ctas=32)], H200).seconds, estimate([_walk(256, 32, ctas=32)], H200).seconds
    chain = (H200.dram_latency_ns + H200.l2_latency_ns) * 1e-9
    assert small >= 2048 / 8 * chain and small > 2 * large
    assert estimate([_walk(64, 32, ctas=32)], H200).seconds > large
    crowded = estimate([_walk(256, 32, ctas=9216)], H200).seconds
    floor = 4.0 * 9216 * 2048 * 256 / (H200.hbm_gbs * H200.hbm_efficiency * 1e9)
    assert floor <= crowded <= 1.6 * floor


def test_a_prefetched_load_bounds_a_walk_step_at_its_latency_over_steps_ahead() -> None:
    """Model 6: a load issued n steps before the step that uses it has n steps to arrive, so however
    short the step's own chain (none, or an L2 hit) and with nothing to move, the walk takes at least
    steps x waves x the HBM latency / n: a step ahead, the whole latency; two steps ahead, half."""
    launch = _launch(ctas=3 * H200.sms * 2)                 # three whole waves at 2 CTAs per SM

    def seconds(chain: tuple[str, ...], ahead: tuple[tuple[str, int], ...]) -> float:
        return walk_time(Walk(100, 0.0, chain, ahead=ahead), _mix(), launch, 2, H200)

    bound = 100 * 3 * H200.dram_latency_ns * 1e-9
    assert seconds((), ()) < bound / 10                     # the step's instructions alone
    assert seconds((), (("hbm", 1),)) == pytest.approx(bound)
    assert seconds((), (("hbm", 2),)) == pytest.approx(bound / 2)
    assert seconds(("l2",), (("hbm", 1),)) == pytest.approx(bound)          # the L2 hit is shorter
    assert seconds(("l2",), (("hbm", 2), ("hbm", 1))) == pytest.approx(bound)   # the nearest one bounds it
    # a chain longer than the bound is not shortened by it
    assert seconds(("hbm", "l2"), (("hbm", 1),)) == pytest.approx(seconds(("hbm", "l2"), ()))
    assert seconds(("hbm", "l2"), (("hbm", 1),)) > bound
    # bytes to move only add to the step
    moving = walk_time(Walk(100, 2.0 * 32 * 512, (), ahead=(("hbm", 2),)), _mix(), launch, 2, H200)
    assert moving > bound / 2


@pytest.fixture(scope="module")
def kernel_tiles(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, int, int, int], int]:
    """The kernel's tile_moves, (threads, tile_tokens, load_ahead, per_move) -> moves, from
    tests/csrc/compact_tile_check.cu built on the host as test_compact_cpu builds its host check."""
    from .test_compact_cpu import ROOT, _nvcc          # skips without nvcc

    exe = tmp_path_factory.mktemp("compact_tile_check") / "compact_tile_check"
    cmd = [_nvcc(), "-x", "cu", "-std=c++17", "-O2", "-I", str(ROOT), str(TILE_SRC), "-o", str(exe)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60, check=True).stdout
    rows = [tuple(int(x) for x in line.split()) for line in out.splitlines()]
    return {row[:4]: row[4] for row in rows}


def test_the_models_compaction_tile_is_the_kernels_tile_moves(kernel_tiles) -> None:
    """Model 6 takes the tile from compact_tile, a Python restatement of the kernel's tile_moves
    (model 5 read it off the SASS and was wrong for narrow tiles): the two must agree for every
    threads, tile_tokens and load_ahead choice, over move widths from a sliced short row to one too
    long for more than one move (per_move: 16-byte vectors of a move one CTA copies)."""
    threads, tokens, ahead = (TUNABLES["compact"][name][0] for name in ("threads", "tile_tokens", "load_ahead"))
    assert set(threads) == {64, 128, 256, 512} and set(tokens) == {8, 16, 32, 64, 128} and set(ahead) == {1, 2}
    per_move = (1, 2, 4, 8, 16, 32, 36, 64, 1024)
    assert set(kernel_tiles) == set(itertools.product(threads, tokens, ahead, per_move))
    for (t, tile_tokens, load_ahead, p), moves in sorted(kernel_tiles.items()):
        params = {"threads": t, "tile_tokens": tile_tokens, "load_ahead": load_ahead}
        assert compact_tile(params, p) == moves, (params, p)
    # the cases the caps decide: 8 moves of 4 vectors on 256 threads stay 8 (model 5 saw 64); the
    # ring of three tiles on 512 threads leaves 5 vectors a thread; a move wider than a tile's worth
    assert kernel_tiles[(256, 8, 1, 4)] == 8
    assert kernel_tiles[(512, 128, 2, 36)] == 5 * 512 // 36 == 71
    assert kernel_tiles[(64, 128, 2, 1024)] == 1


def test_compaction_walks_compact_tile_moves_a_step_with_its_prefetches_ahead() -> None:
    """compact_launches: a step moves compact_tile moves; the tile's row loads are issued load_ahead
    steps ahead, and with index_ahead the index load a step ahead while the chain keeps the
    page-table load alone."""
    features = {"compact_kernel": KernelFeatures("compact_kernel", 64, 1024, 0, 0, Mix.of([]), [_mix()])}
    geometry = {"kv_heads": 8, "layers": 36, "head_dim": 128, "elem_bytes": 2}   # 32 vectors a move
    cases = {(1, 0): (("hbm", "l2"), (("hbm", 1),)), (2, 0): (("hbm", "l2"), (("hbm", 2),)),
             (1, 1): (("l2",), (("hbm", 1), ("hbm", 1))), (2, 1): (("l2",), (("hbm", 2), ("hbm", 1)))}
    for (load_ahead, index_ahead), (chain, ahead) in cases.items():
        params = {"threads": 256, "tile_tokens": 128, "slices": 1, "load_ahead": load_ahead,
                  "index_ahead": index_ahead}
        (launch,) = compact_launches(features, params, geometry, batch=1, moves=2048)
        walk = launch.phases[0].walk
        tile = compact_tile(params, 32)
        assert tile == (128 if load_ahead == 1 else 80)       # 16 or 10 vectors a thread
        assert walk.chain == chain and walk.ahead == ahead
        assert walk.steps == math.ceil(2048 / tile) and walk.step_bytes == 2.0 * tile * 512


def _scorer_mix(lanes: int, span: int = 256) -> Mix:
    """One thread's iteration of a scorer: its LDG.128 share of the span, 192 / lanes coefficient
    LDS.128 (the thread's chunks), a page-table load and a score store."""
    k_loads, lds = span // 16 // lanes, 192 // lanes
    per_pipe = {"alu": 10, "fma": 40, "imad": 0, "conversion": 0, "mufu": 0, "memory": k_loads + lds + 2,
                "uniform": 0, "control": 1, "other": 0}
    return Mix(sum(per_pipe.values()), per_pipe,
               {"global_load": k_loads + 1, "global_store": 1, "shared_load": lds, "shared_store": 0, "local": 0},
               span // lanes, span // lanes, 0, 16 * lds)


def test_the_l1_data_pipe_counts_rows_per_warp_load_and_broadcast_coefficients() -> None:
    """Model 3 (docs/tuning-evidence/scorer-warp-form-postmortem.md, qwen3-8b thread form, lanes=2:
    8 K wavefronts and 12 coefficient wavefronts per token, 2.0 per broadcast LDS.128)."""
    per_token = {lanes: score_wavefronts(_scorer_mix(lanes), 256 // lanes, lanes) * lanes / 32 for lanes in (1, 2, 4)}
    assert per_token[2] == pytest.approx(8 + 12 + 2 * 2 / 32)          # K rows + coefficients + 2 others
    assert per_token[1] == pytest.approx(16 + 12 + 2 / 32)             # an LDS.128 costs at least two
    assert per_token[4] == pytest.approx(4 + 24 + 2 * 4 / 32)          # four distinct coefficient addresses
    # without a workload count: the shared loads' and global accesses' bytes at 128 B a wavefront
    assert l1_wavefronts(_scorer_mix(2), H200) == pytest.approx(32 * (16 * 96 + 128) / 128)


def test_an_l1_bound_phase_takes_the_wavefronts_at_one_per_clock() -> None:
    mix = _scorer_mix(2)
    kernel = _launch().kernel
    phase = Phase("scores", 1e9, "hbm", mix, 128.0, l1_wavefronts=score_wavefronts(mix, 128, 2))
    e = estimate([Launch("score", kernel, 100_000, 256, 0, (phase,))], H200)
    terms = e.terms["score/scores"]
    warp_iterations = 1e9 / 128 / 32
    assert terms["issue:l1"] == pytest.approx(
        warp_iterations * score_wavefronts(mix, 128, 2) / (H200.sms * H200.clock_ghz * 1e9))
    assert terms["issue"] == terms["issue:l1"] > terms["memory"]


def test_a_launch_that_does_not_fit_an_sm_is_infinitely_slow() -> None:
    assert math.isinf(estimate([_launch(shared=300 * 1024)], H200).seconds)


def test_every_target_has_a_table_and_sources_for_its_estimates() -> None:
    assert set(TARGETS) == {"sm_90a", "sm_100a", "sm_103a", "sm_107a"}
    with pytest.raises(ValueError, match="sm_120a"):
        target("sm_120a")


def test_the_h100_table_is_sm90as_with_the_h100s_hbm() -> None:
    """validate --gpu h100 judges H100 measurements with the H100's table: the sm_90a table (the
    H200's 132 SMs, clock and every per-SM limit and rate) with HBM3 at 3.35 TB/s. A part of another
    arch, or one without a table, is refused, naming the tables there are."""
    h100 = gpu_target("h100", "sm_90a")
    assert h100.arch == "sm_90a" and "H100" in h100.gpu
    assert (h100.hbm_gbs, h100.sms) == (3350, 132)
    assert {k for k, v in h100.asdict().items() if v != H200.asdict()[k]} == {"gpu", "hbm_gbs"}
    assert resident_ctas(_launch().kernel, 256, 0, h100) == resident_ctas(_launch().kernel, 256, 0, H200)
    with pytest.raises(ValueError, match="H100 .* is sm_90a, not sm_100a"):
        gpu_target("h100", "sm_100a")
    with pytest.raises(ValueError, match="no cost-model table for GPU 'a100'; tables: h100"):
        gpu_target("a100", "sm_90a")
    with pytest.raises(ValueError, match="GPU 'H100'"):                # names are exact (lower case)
        gpu_target("H100", "sm_90a")


def test_validate_refuses_an_unknown_gpu(tmp_path: Path, capsys) -> None:
    from kvgen.tuning.costmodel.validate import main

    with pytest.raises(SystemExit) as exit_:
        main([str(tmp_path / "m.jsonl"), "--features", str(tmp_path / "f.json"), "--out", str(tmp_path),
              "--gpu", "a100"])
    assert exit_.value.code == 2 and "invalid choice: 'a100'" in capsys.readouterr().err


# ---------------------------------------------------------------- validation arithmetic


def test_spearman_and_the_flat_study_rule() -> None:
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert math.isnan(spearman([1, 2, 3], [5, 5, 5]))
    measured = {"a": 1.00, "b": 1.01, "c": 1.02}
    flat = study_verdict(measured, {"a": 3.0, "b": 2.0, "c": 1.0})   # ranking reversed, within noise
    assert flat["flat"] and flat["passes"] and flat["top_pick_gap"] == pytest.approx(0.02)
    steep = study_verdict({"a": 1.0, "b": 2.0, "c": 3.0}, {"a": 3.0, "b": 2.0, "c": 1.0})
    assert not steep["flat"] and not steep["passes"]


def _record(ms: float, band: float = 0.01) -> dict:
    return {"median_ms": ms, "p20_ms": ms * (1 - band / 2), "p80_ms": ms * (1 + band / 2)}


def test_the_noise_band_takes_the_rerun_and_limits_what_a_ranking_can_show() -> None:
    """A study whose candidates differ by less than their noise has a Spearman ceiling under the
    goal: the noise-aware verdict judges its pick (within 5 % plus the band) only; the plain verdict
    still fails it."""
    times = {f"c{i}": 1.0 + 0.002 * i for i in range(10)} | {"slow": 1.5}
    records = {c: _record(ms) for c, ms in times.items()}
    rerun = {c: _record(ms * (1.03 if i % 2 else 0.97)) for i, (c, ms) in enumerate(times.items())}
    noise = noise_band(records, rerun)
    assert noise["within_run"] == pytest.approx(0.01) and noise["band"] == pytest.approx(0.03)
    assert noise["rerun_candidates"] == 11 and noise["rerun_spearman"] < 0.8
    assert spearman_ceiling(list(times.values()), 0.0) == pytest.approx(1.0)
    reversed_model = {c: -ms for c, ms in times.items()} | {"slow": 9.0, "c9": -2.0}
    v = study_verdict(times, reversed_model, noise)
    assert not v["passes"] and v["top_pick_gap"] == pytest.approx(0.018)
    assert not v["noise"]["rank_judged"] and v["passes_noise_aware"]


# ---------------------------------------------------------------- precedence at build time


def _file(tmp_path: Path, ops: dict | None, model_ops: dict | None) -> Path:
    data = {"schema": 1, "family": "qwen3-8b", "arch": "sm_100a", "ops": ops or {}}
    if model_ops is not None:
        data["model_ops"] = model_ops
    path = tuning_path(tmp_path, "sm_100a", "qwen3-8b")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def _entry(threads: int, nvcc: str, method: str | None = None) -> dict:
    entry = {"params": {"threads": threads, "in_flight": 2},
             "environment": {"kvgen": "0.1.0", "toolchain": {"nvcc": nvcc}}}
    return {**entry, "method": method} if method else entry


ENV = {"sm_100a": BuildEnvironment("0.1.0", {"nvcc": "13.5.37"})}


def test_a_measured_entry_for_the_builds_toolchain_wins_over_the_model(tmp_path: Path) -> None:
    _file(tmp_path, {"codec": _entry(128, "13.5.37")}, {"codec": _entry(512, "13.5.37", "model")})
    tuned = load_tuned(tmp_path, ENV, ["qwen3-8b"], environ={})
    assert tuned.for_family("sm_100a", "qwen3-8b")["codec"]["threads"] == 128
    assert tuned.method("sm_100a", "qwen3-8b", "codec") == MEASURED


def test_the_model_entry_is_used_where_no_measured_one_applies(tmp_path: Path) -> None:
    _file(tmp_path, {"codec": _entry(128, "13.0.88")}, {"codec": _entry(512, "13.5.37", "model")})
    tuned = load_tuned(tmp_path, ENV, ["qwen3-8b"], environ={})
    assert tuned.for_family("sm_100a", "qwen3-8b")["codec"]["threads"] == 512
    assert tuned.method("sm_100a", "qwen3-8b", "codec") == MODEL == "model-tuned"
    assert any("measured entry not used" in note and "13.0.88" in note for note in tuned.notes)


def test_a_model_entry_for_another_toolchain_falls_back_to_the_defaults(tmp_path: Path) -> None:
    _file(tmp_path, None, {"codec": _entry(512, "13.0.88", "model")})
    tuned = load_tuned(tmp_path, ENV, ["qwen3-8b"], environ={})
    assert tuned.for_family("sm_100a", "qwen3-8b") == {}
    assert tuned.method("sm_100a", "qwen3-8b", "codec") == "default"
    assert any("model-tuned entry" in note and "safe defaults" in note for note in tuned.notes)


def test_a_model_entry_must_say_it_is_one(tmp_path: Path) -> None:
    from kvgen.lower.tuned import TuningFileError, read_file

    path = _file(tmp_path, None, {"codec": _entry(512, "13.5.37")})
    with pytest.raises(TuningFileError, match="model_ops.codec"):
        read_file(path)


# ---------------------------------------------------------------- measurements replace the model


def test_tune_measurements_replace_the_models_pick_and_record_how_far_off_it_was(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvgen.cli import main

    use_grid_space(monkeypatch.setitem)   # a whole grid is searched
    measurements = write_codec_measurements(tmp_path / "m.jsonl", arch="sm_100a")
    tuning = tmp_path / "tuning"
    model_pick = {**default_params("codec"), "threads": 256, "in_flight": 2, "rounding": 1, "min_blocks": 1}
    model = {**_entry(256, "13.0.88", "model"), "params": model_pick, "model_version": "1",
             "buckets": {b: {"best": config_id("codec", model_pick)} for b in ("small", "large", "offload")}}
    path = tuning_path(tuning, "sm_100a", "qwen3-8b")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"schema": 1, "family": "qwen3-8b", "arch": "sm_100a", "ops": {},
                                "model_ops": {"codec": model}}))
    rc = main(["tune", "--family", "qwen3-8b", "--op", "codec", "--arch", "sm_100a", "--strategy", "grid",
               "--measurements", str(measurements), "--storage", "sqlite:///:memory:", "--tuning", str(tuning)])
    assert rc == 0
    data = json.loads(path.read_text())
    assert "model_ops" not in data                                   # the measurement replaced it
    replaced = data["ops"]["codec"]["replaced_model"]
    assert replaced["model_params"] == model_pick and replaced["model_version"] == "1"
    for bucket, off in replaced["buckets"].items():
        assert off["model_pick_off"] >= 0 and off["model_pick_ms"] >= off["measured_best_ms"]
    assert replaced["buckets"]["small"]["model_pick_off"] > 0        # the bowl's optimum is elsewhere


# ---------------------------------------------------------------- kvgen tune --model


def _validation(tmp_path: Path, passes: bool, version: str = VERSION) -> Path:
    path = tmp_path / "validation.json"
    path.write_text(json.dumps({"model_version": version, "ops": {"compact": {"passes": passes,
                                                                          "failed": [] if passes else ["x/b1"]}}}))
    return path


def test_tune_model_refuses_an_op_that_failed_validation(tmp_path: Path, capsys) -> None:
    from kvgen.cli import main

    rc = main(["tune", "--model", "--family", "qwen3-8b", "--op", "compact", "--arch", "sm_100a",
               "--validation", str(_validation(tmp_path, False)), "--tuning", str(tmp_path / "tuning")])
    assert rc == 1
    assert "failed its H200 validation" in capsys.readouterr().out
    assert not (tmp_path / "tuning").exists()


def test_tune_model_refuses_a_validation_of_another_model_version(tmp_path: Path, capsys) -> None:
    from kvgen.cli import main

    rc = main(["tune", "--model", "--family", "qwen3-8b", "--op", "compact", "--arch", "sm_100a",
               "--validation", str(_validation(tmp_path, True, version="2")), "--tuning", str(tmp_path / "tuning")])
    assert rc == 1
    assert f"validates cost model '2', this is model {VERSION!r}" in capsys.readouterr().out
    assert not (tmp_path / "tuning").exists()


def test_tune_model_writes_a_model_tuned_entry_the_build_uses(tmp_path: Path) -> None:
    """A real sm_100a cubin (one candidate: the searched subspace fixed to one configuration): the
    entry says model, its version, inputs and predicted times; load_tuned uses it as model-tuned."""
    from kvgen.cli import main

    tuning = tmp_path / "tuning"
    rc = main(["tune", "--model", "--family", "qwen3-8b", "--op", "compact", "--arch", "sm_100a",
               "--fix", "threads=256,tile_tokens=64,slices=1,load_ahead=1,index_ahead=0,tail_split=1",
               "--validation", str(_validation(tmp_path, True)), "--tuning", str(tuning)])
    assert rc == 0
    entry = json.loads(tuning_path(tuning, "sm_100a", "qwen3-8b").read_text())["model_ops"]["compact"]
    assert entry["method"] == "model" and entry["model_version"] == VERSION
    params = {"threads": 256, "tile_tokens": 64, "slices": 1, "load_ahead": 1, "index_ahead": 0, "tail_split": 1}
    assert entry["params"] == params
    assert entry["searched"] == {"fixed": params, "candidates": 1}
    (inputs,) = entry["inputs"].values()
    assert any("compact_kernel" in name and k["registers"] > 0 for name, k in inputs.items())
    assert all(b["predicted_best_ms"] > 0 for b in entry["buckets"].values())
    env = BuildEnvironment("0.1.0", {"nvcc": entry["environment"]["toolchain"]["nvcc"]})
    tuned = load_tuned(tuning, {"sm_100a": env}, ["qwen3-8b"], environ={})
    assert tuned.method("sm_100a", "qwen3-8b", "compact") == MODEL


def test_the_manifest_and_show_config_say_how_params_were_chosen(tmp_path: Path) -> None:
    from kvgen.artifacts.manifest import FamilyEntry, Manifest, OpEntry, manifest_path, parse_manifest, write_manifest
    from kvgen.cli import _registry_tuning

    op = OpEntry("codec", "libx.so", "codec.cu.j2", "k", {"threads": 256}, MODEL)
    family = FamilyEntry(family="qwen3-8b", arch="sm_100a", symbol="s", spec_sha256="0", ops=(op,), artifacts=())
    path = manifest_path(tmp_path, "sm_100a")
    write_manifest(path, Manifest(arch="sm_100a", families=(family,)))
    assert parse_manifest(path).families[0].ops[0].tuning == "model-tuned"
    assert _registry_tuning(tmp_path) == {"sm_100a qwen3-8b codec": "model-tuned"}


def test_the_record_load_route_sets_decode_bytes_in_flight_and_round_trips() -> None:
    """decode_load 0 keeps in_flight 16-byte words per thread outstanding, round after round; the
    asynchronous routes put the whole record in flight in one round trip (qwen3-8b: 36864 bytes)."""
    from kvgen.tuning.costmodel.workload import record_load

    base = {"threads": 256, "in_flight": 4}
    assert record_load({**base, "decode_load": 0}, 36864) == (64.0, 3)
    assert record_load({**base, "decode_load": 1}, 36864) == (144.0, 1)
    assert record_load({**base, "decode_load": 2}, 36864) == (144.0, 1)
    assert record_load({"threads": 512, "in_flight": 8, "decode_load": 0}, 4096) == (8.0, 1)


def test_decode_pages_takes_fewer_ctas_with_twice_the_shared_memory() -> None:
    """decode_pages: the model sees its occupancy cost (what lost on the H100), not its overlap."""
    from kvgen.tuning.costmodel.workload import codec_launches, decode_pages

    assert decode_pages({"decode_load": 0, "decode_pages": 4}) == 1   # the register copy folds it
    from kvgen.tuning.costmodel.features import KernelFeatures

    features = {name: KernelFeatures(name, 32, 1024, 0, 0, Mix.of([]), []) for name in ("encode_kernel", "decode_kernel")}
    size = {"hot_bytes": 4 * 36864 * 4, "cold_bytes": 4 * 36864}
    base = {**default_params("codec"), "decode_load": 1}
    one = codec_launches(features, {**base, "decode_pages": 1}, size, 36864)[1]
    two = codec_launches(features, {**base, "decode_pages": 2}, size, 36864)[1]
    assert (one.ctas, one.dynamic_shared) == (4, 36864) and (two.ctas, two.dynamic_shared) == (2, 2 * 36864)
