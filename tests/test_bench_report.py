"""``kvgen bench`` on the CPU: the report from the recorded H200 run, tuned vs default, the run's
bookkeeping with the GPU parts stubbed, and a clear refusal without a GPU."""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from kvgen.bench import add_arguments
from kvgen.bench import run as bench_run
from kvgen.bench.report import FIGURES, merge_recorded, write_report
from kvgen.bench.suite import RESULT, tuned_vs_default, write_json

ROOT = Path(__file__).resolve().parent.parent
RECORDED = ROOT / "results" / "2026-11-30-h200"


def assert_png(path: Path) -> None:
    """A complete PNG: signature, IHDR first with a non-empty image, every chunk's CRC, IEND last."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, f"{path}: bad CRC in {kind!r}"
        chunks.append((kind, body))
        pos += 12 + length
    assert chunks[0][0] == b"IHDR" and chunks[-1][0] == b"IEND", path
    width, height = struct.unpack(">II", chunks[0][1][:8])
    assert width > 100 and height > 100, (path, width, height)


def recorded_doc() -> dict:
    return merge_recorded(RECORDED)


def test_merge_recorded_run_keeps_each_benchmark_with_its_own_ceilings():
    doc = recorded_doc()
    assert doc["merged_from"] == ["bench_codec.json", "bench_compact.json", "bench_score.json"]
    bench = doc["benchmarks"]
    assert len(bench["codec"]["results"]) == 4 and len(bench["compact"]["results"]) == 3
    assert len(bench["score"]["score"]) == 5 and "round" in bench["score"] and "oracle" in bench["score"]
    for name in ("codec", "compact", "score"):   # the score record's "copy" is normalized
        assert bench[name]["ceilings"]["device_copy"]["gbps_read_plus_write"] > 4000
        assert bench[name]["environment"]["gpu"] == "NVIDIA H200"
    assert "pinned" in doc["ceilings"] and doc["environment"]["commit"] == "1cf176f"


def test_report_of_the_recorded_h200_run(tmp_path):
    pytest.importorskip("matplotlib")
    write_json(tmp_path / RESULT, recorded_doc())
    md = write_report(tmp_path, tuning=tmp_path / "no-tuning-here").read_text()

    # the machine and the claim that every ratio is against a ceiling of the same run
    for text in ("NVIDIA H200", "580.159.04", "1cf176f", "d9851fc", "2026-11-30", "same process"):
        assert text in md, text
    for header in ("## Ceilings", "## Fraction of the ceiling, per kernel and size", "## Against the peers",
                   "## Tuned vs default parameters", "## Tuned configurations", "## One eviction round"):
        assert header in md, header
    assert "| kernel | family | size | time | GB/s | ceiling | fraction | goal |" in md
    assert "| codec encode → pinned | qwen3-8b | 1.20 GiB hot, 274 pages | 6.98 ms | 52 | pinned d2h | **0.94** |" in md
    assert "| compaction | qwen3-8b | batch 32 | 5.05 ms | 3855 | device copy | **0.92** |" in md
    assert "| TriAttention score | qwen3-8b | batch 32, 16384 tokens, 36 layers | 14.8 ms |" in md
    # peers: oracle eager and torch.compile from the record, plain copy computed from its bytes
    assert "| codec encode → device | qwen3-8b | 1.20 GiB hot, 274 pages | 0.74 ms | — | 141 ms | 25.0 ms |" in md
    assert "| TriAttention score, per layer | qwen3-8b | batch 32, 16384 tokens | 0.41 ms | — | 34.5 ms | 4.89 ms |" in md
    assert "Not measured in this run" in md   # no default registry in the recorded run
    assert "| 4217 GB/s | 2 GiB | 55.3 GB/s | 55.5 GB/s |" in md

    for name in (FIGURES["fraction"], FIGURES["peers"]):
        assert f"]({name})" in md
        assert_png(tmp_path / name)
    assert not (tmp_path / FIGURES["tuned"]).exists()


def test_report_with_tuned_vs_default_and_tuning_records(tmp_path):
    pytest.importorskip("matplotlib")
    doc = recorded_doc()
    bench = doc["benchmarks"]
    for r in bench["codec"]["results"]:
        r["default"] = {k: {**r[k], "median_ms": 1.25 * r[k]["median_ms"]}
                        for k in ("encode_device", "decode_device", "encode_pinned", "decode_pinned")}
    for r in bench["compact"]["results"]:
        r["default"] = {"compact": {**r["compact"], "median_ms": 0.5 * r["compact"]["median_ms"]}}
    bench["compact"]["results"][0]["same_size_copy"] = {"bytes": 3.04e8, "of_copy": 0.95, "compact_of_it": 0.93}
    decode = bench["codec"]["results"][0]["decode_device"]        # the mix ceiling of a newer record
    bench["codec"]["results"][0]["mix"] = {"decode_device": {"gbps": 2700.0, "of_copy": 0.9, "median_ms": 0.5}}
    decode.update(fraction_of_ceiling=0.81, fraction_of_mix=0.9)
    for s in bench["score"]["score"]:
        tuned = {**s["variants"][0], "role": "tuned"}
        s["variants"] = [tuned, {**tuned, "role": "default", "params": {**tuned["params"], "lanes": 1},
                                 "median_ms": 2.0 * tuned["median_ms"]}]
    params = {("codec", "tuned"): {"threads": 512}, ("codec", "default"): {"threads": 256},
              ("compact", "tuned"): {"threads": 256, "tile_tokens": 64}, ("compact", "default"): {"threads": 128}}
    doc["tuned_vs_default"] = tuned_vs_default(bench, lambda family, op: params.get((op, "tuned"), {}),
                                               lambda family, op: params.get((op, "default"), {}))
    entries = {(e["kernel"], e["family"], e["size"]): e for e in doc["tuned_vs_default"]}
    assert len(entries) == 4 * 4 + 3 + 5
    assert entries[("codec.encode_pinned", "qwen3-8b", "1.20 GiB hot, 274 pages")]["speedup"] == pytest.approx(1.25)
    assert entries[("compact", "qwen3-8b", "batch 1")]["speedup"] == pytest.approx(0.5)
    score = entries[("score", "gemma-2-9b", "batch 32, 16384 tokens")]
    assert score["speedup"] == pytest.approx(2.0) and score["default_params"]["lanes"] == 1
    assert set(score) >= {"kernel", "family", "size", "tuned_ms", "default_ms", "speedup", "tuned_params",
                          "default_params"}
    bench["compact"]["results"][2]["default"] = {"error": "LibraryError: stub"}
    bench["score"]["score"][4]["default_error"] = "no score library"
    doc["config"] = {"registry": "build/registry", "default_registry": "build/registry-default"}
    write_json(tmp_path / RESULT, doc)

    tuning = tmp_path / "tuning" / "sm_90a"
    tuning.mkdir(parents=True)
    (tuning / "qwen3-8b.json").write_text(json.dumps({
        "schema": 1, "family": "qwen3-8b", "arch": "sm_90a", "environment": {"gpu": "NVIDIA H200"},
        "ops": {"codec": {"params": {"threads": 512}, "default": {"threads": 256},
                          "buckets": {"large": {"best": {"threads": 512}, "best_ms": 0.61, "default_ms": 0.74,
                                                "params_ms": 0.61, "speedup": 1.21, "trials": 9, "failed": 1,
                                                "strategy": "exhaustive"},
                                      "small": {"best_ms": 0.02}}},          # keys missing: tolerated
                "score": {"params": {"lanes": 2}}}}))                       # no buckets, no default
    (tuning / "broken.json").write_text("{not json")
    md = write_report(tmp_path, tuning=tmp_path / "tuning").read_text()

    assert "| codec.encode_pinned | qwen3-8b | 1.20 GiB hot, 274 pages | 6.98 ms | 8.73 ms | 1.25× | threads=512 | " \
           "threads=256 |" in md
    assert "| compact | qwen3-8b | batch 32 | 5.05 ms | 2.52 ms | 0.50× | threads=256, tile_tokens=64 | " \
           "threads=128 |" in md
    assert "- compaction batch 256: LibraryError: stub" in md
    assert "- score qwen3.5-397b-a17b batch 32: no score library" in md
    assert "lanes=1, max_heads=16, threads=128, token_tiles=1" in md
    assert "| sm_90a | qwen3-8b | codec | threads=512 | threads=256 | large | threads=512 | 0.61 ms | 0.74 ms | " \
           "0.61 ms | 1.21× | 9 | 1 | exhaustive |" in md
    assert "| sm_90a | qwen3-8b | codec | threads=512 | threads=256 | small | — | 0.020 ms |" in md
    assert "| sm_90a | qwen3-8b | score | lanes=2 | — | — |" in md
    assert "broken.json | unreadable |" in md
    assert "| codec decode ← device | qwen3-8b | 2700 | 0.90 | 0.81 | 0.90 |" in md
    assert "| 1 | 0.30 GB | 0.95 | " in md
    assert f"]({FIGURES['tuned']})" in md
    for name in FIGURES.values():
        assert_png(tmp_path / name)


def test_run_bookkeeping_with_the_gpu_parts_stubbed(tmp_path, monkeypatch):
    """One bench.json: environment, the ceilings measured once and passed to every benchmark, each
    benchmark's document as it returns it, a failing one recorded while the next still runs."""
    import torch

    from kvgen.bench import suite
    from kvgen.measure import environment, timing

    recorded = recorded_doc()["benchmarks"]
    ceilings = {"device_copy": {"gbps_read_plus_write": 4000.0}, "pinned": {"d2h": {"gbps": 55.0},
                                                                            "h2d": {"gbps": 55.0}}}
    measured, seen = [], []
    monkeypatch.setattr(timing, "require_cuda", lambda: None)
    monkeypatch.setattr(timing, "measure_ceilings", lambda pinned=True: measured.append(pinned) or ceilings)
    monkeypatch.setattr(environment, "environment", lambda: {"gpu": "stub", "commit": "abc1234"})
    monkeypatch.setattr(suite, "release", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (100 << 30, 141 << 30))

    def codec(c, o):
        seen.append(("codec", c))
        results = [dict(r) for r in recorded["codec"]["results"][:1]]
        results[0]["default"] = {k: {**results[0][k], "median_ms": 2 * results[0][k]["median_ms"]}
                                 for k in suite.CODEC_RUNS}
        return {"results": results}

    def compact(c, o):
        seen.append(("compact", c))
        raise RuntimeError("out of memory (stub)")

    def score(c, o):
        seen.append(("score", c))
        return {k: v for k, v in recorded["score"].items() if k not in ("environment", "ceilings", "source")}

    monkeypatch.setattr(suite, "RUNNERS", {"codec": codec, "compact": compact, "score": score})
    registry = tmp_path / "registry"
    options = suite.Options(out=tmp_path / "out", registry=registry, default_registry=tmp_path / "default")
    doc = suite.run_suite(options)

    assert measured == [True] and [name for name, _ in seen] == ["codec", "compact", "score"]
    assert all(c is ceilings for _, c in seen)
    on_disk = json.loads((tmp_path / "out" / RESULT).read_text())
    assert on_disk == json.loads(json.dumps(doc))
    assert on_disk["schema"] == 1 and on_disk["environment"]["commit"] == "abc1234"
    assert on_disk["ceilings"] == ceilings and set(on_disk["benchmarks"]) == {"codec", "score"}
    assert "out of memory (stub)" in on_disk["errors"]["compact"]
    assert on_disk["config"]["default_registry"] == str(tmp_path / "default")
    kernels = [e["kernel"] for e in on_disk["tuned_vs_default"]]
    assert kernels == ["codec.encode_device", "codec.decode_device", "codec.encode_pinned", "codec.decode_pinned"]
    assert on_disk["tuned_vs_default"][0]["speedup"] == pytest.approx(2.0)
    assert on_disk["tuned_vs_default"][0]["tuned_params"] == {}      # no manifest in the stub registry


def test_manifest_params_reads_the_per_op_entries(tmp_path):
    from kvgen.artifacts.manifest import ArtifactEntry, FamilyEntry, Manifest, OpEntry, manifest_path, write_manifest
    from kvgen.bench.suite import manifest_params

    lib = "libkvgen_qwen3_8b.so"
    entry = FamilyEntry(family="qwen3-8b", arch="sm_90a", symbol="kvgen_qwen3_8b", spec_sha256="0",
                        ops=(OpEntry("codec", lib, "codec.cu.j2", "k1", {"threads": 512}),
                             OpEntry("compact", lib, "compact.cu.j2", "k2", {"threads": 128, "tile_tokens": 32})),
                        artifacts=(ArtifactEntry(lib, "0", "nvcc", "0", {"nvcc": "13.0"}),))
    write_manifest(manifest_path(tmp_path, "sm_90a"), Manifest(arch="sm_90a", families=(entry,)))
    params = manifest_params(tmp_path, "sm_90a")
    assert params("qwen3-8b", "codec") == {"threads": 512}
    assert params("qwen3-8b", "compact") == {"threads": 128, "tile_tokens": 32}
    assert params("qwen3-8b", "score") == {} and params("gemma-2-9b", "codec") == {}
    assert manifest_params(tmp_path / "missing", "sm_90a")("qwen3-8b", "codec") == {}


def test_command_line_parses_under_a_parent_parser():
    parser = argparse.ArgumentParser(prog="kvgen")
    parser.add_argument("--specs", type=Path, default=None)   # kvgen's own top-level option
    sub = parser.add_subparsers(dest="verb", required=True)
    add_arguments(sub.add_parser("bench"))
    args = parser.parse_args(["bench", "run", "--out", "o", "--default-registry", "build/registry-default",
                              "--only", "codec,score", "--no-peers"])
    assert args.bench_command == "run" and args.default_registry == Path("build/registry-default")
    assert args.out == Path("o") and args.no_peers and args.only == "codec,score"
    args = parser.parse_args(["bench", "report", "results/x", "--tuning", "tuning"])
    assert args.bench_command == "report" and args.dir == Path("results/x")
    args = parser.parse_args(["bench", "run", "--only", "codec,nope"])
    assert bench_run(args) == 2


def test_run_without_cuda_says_it_needs_a_gpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    proc = subprocess.run([sys.executable, "-m", "kvgen.bench", "run", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert proc.returncode != 0
    assert "needs a CUDA GPU" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_report_command_needs_a_bench_json(tmp_path, capsys):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert bench_run(parser.parse_args(["report", str(tmp_path)])) == 2
    assert "bench.json" in capsys.readouterr().err


def test_the_benchmarks_live_in_the_package_only():
    assert not (ROOT / "benchmarks").exists()
    for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "scripts").glob("*.sh")]:
        text = path.read_text()
        assert not any(old in text for old in ("benchmarks/", "benchmarks.common", "benchmarks.bench_")), path


def test_compaction_sizes_say_which_layers_moved_and_on_whose_pools():
    """Records before the twelfth session gave the layers beyond memory fill moves (layers_moved);
    since then every layer moves and the record says how many have pools of their own."""
    from kvgen.bench.report import _size_compact

    assert _size_compact({"batch": 256, "layers_moved": 25, "layers": 36}) == "batch 256 (25 of 36 layers)"
    assert _size_compact({"batch": 256, "layers_moved": 36, "layers_with_own_pools": 14, "layers": 36}) == \
        "batch 256 (36 layers on 14 layers' pools)"
    assert _size_compact({"batch": 32, "layers_moved": 36, "layers_with_own_pools": 36, "layers": 36}) == "batch 32"
    # since the fourteenth session: the parameters of the library that served the batch (a size variant's)
    assert _size_compact({"batch": 32, "params": {"threads": 128, "tile_tokens": 64, "slices": 2}}) == \
        "batch 32 [threads 128, tile_tokens 64, slices 2]"
