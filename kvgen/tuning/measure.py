"""GPU side of tuning: prove each candidate correct on fresh random inputs, then time it per bucket.

Runs where the GPU is; needs torch, the kvgen runtime and the specs (no optuna, no compiler):

    python -m kvgen.tuning.measure BUNDLE(.tar.xz or directory) --out measurements.jsonl

One JSON line per (candidate, bucket): the configuration, ``status`` ("ok", or the failure kind:
"build", "load", "launch", "wrong", "crash", "timeout"), and for "ok" the median and quantiles of
CUDA-event times over ``reps`` calls after warm-up, inputs rotated over enough copies that the
calls touch at least 3x the L2 cache (a candidate is never timed on data a previous call left in
L2). Lines are appended as they are measured, so a killed run keeps everything it finished and a
rerun skips it.

Isolation: a wrong memory access poisons the CUDA context for the rest of the process, so the
candidates of one (family, op) run in a worker process; when it dies, the candidate it was on is
recorded as "crash" and a fresh worker continues with the next one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from kvgen.bench.paths import spec_path
from kvgen.tuning.candidates import Candidate, read_bundle, read_index, unpack_bundle
from kvgen.tuning.space import BUCKETS, parse_config

DEFAULT_REPS = 20
WORKER_SILENCE_S = 180        # a worker that writes nothing for this long is hung: killed, "timeout"


@dataclass(frozen=True)
class Failure(Exception):
    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"


def record_key(record: dict[str, Any]) -> tuple:
    return record["family"], record["op"], record["arch"], record["config"], record["bucket"]


def read_records(path: Path) -> list[dict[str, Any]]:
    """Measurement lines of a file (a torn last line from a killed run is ignored)."""
    if not Path(path).is_file():
        return []
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


# ---------------------------------------------------------------------------------------------
# Per op: inputs per bucket, a correctness check, a timed call
# ---------------------------------------------------------------------------------------------


class _Bench:
    """Inputs per bucket (``inputs``) and the problem size each really has (``sizes``, recorded)."""

    inputs: dict[str, Any]
    sizes: dict[str, dict[str, Any]]

    def size(self, bucket) -> dict[str, Any]:
        return self.sizes[bucket.name]

    @staticmethod
    def copies(touched_bytes: int) -> int:
        """Input copies to rotate over so that the timed calls touch >= 3x the L2."""
        from kvgen.bench.common import rotation_sets

        return rotation_sets(touched_bytes)

    @staticmethod
    def timed(calls: list[Callable[[], Any]], reps: int) -> dict[str, float]:
        """Median and quantiles (ms) of ``reps`` CUDA-event-timed calls, rotating over ``calls``."""
        from kvgen.bench.common import summary, time_rotated

        return summary(time_rotated(calls, reps))


class CodecBench(_Bench):
    """Encode + decode of one lifecycle-0 batch of pages (the objective: both directions use the
    same launch configuration), cold pages in device or pinned memory as the bucket says."""

    def __init__(self, family: str, buckets: Iterable[Any], seed: int):
        import torch

        from kvgen.lower.layout import family_layout
        from kvgen.spec.schema import load_spec

        self.spec = load_spec(spec_path(family))
        self.layout = family_layout(self.spec)
        self.lc = self.layout.lifecycles[0]
        self.seed = seed
        self.inputs, self.sizes = {}, {}
        for b in buckets:
            pages = max(1, math.ceil(b.size["hot_mib"] * (1 << 20) / self.lc.hot_page_bytes))
            sets = self.copies(pages * self.lc.hot_page_bytes)
            pools = self._pools(pages * sets, torch.Generator(device="cuda").manual_seed(seed))
            cold = torch.empty(pages * sets, self.lc.cold_page_bytes, dtype=torch.uint8,
                               device="cuda" if b.size["cold"] == "device" else "cpu")
            cold = cold if cold.is_cuda else cold.pin_memory()
            pairs = []
            for s in range(sets):
                slots = torch.arange(s * pages, (s + 1) * pages, dtype=torch.int32)
                pairs.append(torch.stack([slots, slots[torch.randperm(pages)]], dim=1))
            self.inputs[b.name] = (pools, cold, pairs)
            self.sizes[b.name] = {"pages": pages, "hot_bytes": pages * self.lc.hot_page_bytes,
                                  "cold_bytes": pages * self.lc.cold_page_bytes, "cold": b.size["cold"],
                                  "rotation": sets}

    def _pools(self, pages: int, gen) -> list[list[Any]]:
        """Hot pages with an outlier channel (what KV caches look like), side buffers random."""
        import torch

        from kvgen.reference.codec import HOT_TORCH_DTYPES

        dtype = HOT_TORCH_DTYPES[self.spec.dtype]
        pools = []
        for _ in range(self.spec.layers):
            layer = []
            for b in self.layout.record.buffers:
                x = torch.randn(pages, b.rows, b.row_dim, device="cuda", generator=gen) * 2
                x[:, :, 3] *= 40
                if self.spec.dtype == "fp8_e4m3":
                    x = x.clamp(-448, 448)
                layer.append(x.to(dtype))
            layer += [torch.randint(0, 256, (pages, s.bytes), device="cuda", dtype=torch.uint8, generator=gen)
                      for s in self.layout.record.sides]
            pools.append(layer)
        return pools

    def _codec(self, library, pools):
        from kvgen.runtime import ColdPageCodec
        from kvgen.runtime.library import LibraryError

        try:
            return ColdPageCodec(library, self.layout, pools)
        except LibraryError as exc:
            raise Failure("load", str(exc)) from None

    def check(self, library, seed: int) -> None:
        """Encoded bytes and decoded pages byte-identical to the oracle on 6 fresh pages."""
        import torch

        from kvgen.reference import decode_records, encode_records

        pools = self._pools(6, torch.Generator(device="cuda").manual_seed(seed))
        codec = self._codec(library, pools)
        record, lc = self.layout.record, self.lc
        pairs = torch.tensor([[5, 0], [0, 3], [2, 5], [1, 1], [4, 2], [3, 4]], dtype=torch.int32)
        cold = torch.full((6, lc.cold_page_bytes), 0xA5, dtype=torch.uint8, device="cuda")
        _launch(lambda: codec.encode(cold, pairs))
        nq = len(record.buffers)
        src, dst = pairs[:, 1].long().cuda(), pairs[:, 0].long().cuda()
        for j, layer in enumerate(lc.layers):
            buffers = {b.name: pools[layer][i][src] for i, b in enumerate(record.buffers)}
            sides = {s.name: pools[layer][nq + i][src] for i, s in enumerate(record.sides)}
            want = encode_records(record, buffers, sides)
            if not torch.equal(cold[dst, j * lc.record_bytes:(j + 1) * lc.record_bytes], want):
                raise Failure("wrong", f"encoded layer {layer} differs from the oracle")
        out = [[torch.zeros_like(p) for p in layer] for layer in pools]
        decoder = self._codec(library, out)
        _launch(lambda: decoder.decode(cold, torch.stack([pairs[:, 1], pairs[:, 0]], dim=1).contiguous()))
        for j, layer in enumerate(lc.layers):
            buffers, sides = decode_records(record, cold[dst, j * lc.record_bytes:(j + 1) * lc.record_bytes],
                                            self.spec.dtype)
            for pool, want in zip(out[layer], list(buffers.values()) + list(sides.values())):
                if not torch.equal(pool[src].contiguous().view(torch.uint8).flatten(),
                                   want.contiguous().view(torch.uint8).flatten()):
                    raise Failure("wrong", f"decoded layer {layer} differs from the oracle")
        codec.close()
        decoder.close()

    def time(self, library, bucket: str, reps: int) -> dict[str, float]:
        pools, cold, pairs = self.inputs[bucket]
        codec = self._codec(library, pools)
        back = [reverse_pairs(p) for p in pairs]
        calls = [lambda p=p, q=q: (codec.encode(cold, p), codec.decode(cold, q)) for p, q in zip(pairs, back)]
        _launch(calls[0])
        t = self.timed(calls, reps)
        codec.close()
        return t


def reverse_pairs(pairs):
    """(dst, src) pairs of the way back: decode slot -> the page it came from."""
    return pairs.flip(1).contiguous()


class ScoreBench(_Bench):
    """The TriAttention scorer over every scored layer, B requests of ``width`` decode tokens."""

    def __init__(self, family: str, buckets: Iterable[Any], seed: int):
        import torch

        from kvgen.bench.score import Cache

        torch.manual_seed(seed)
        self.family = family
        self.inputs, self.sizes = {}, {}
        for b in buckets:
            sets = []
            while True:   # rotate whole caches: one B=1 cache is a few hundred MB at most
                cache = Cache(family, b.size["batch"], b.size["width"])
                sets.append((cache, cache.kernel_inputs()))
                k_bytes = sum(p.numel() * p.element_size() for p in cache.k_pools.values())
                if len(sets) >= self.copies(k_bytes):
                    break
            self.inputs[b.name] = sets
            self.sizes[b.name] = {"batch": b.size["batch"], "width": b.size["width"], "rotation": len(sets)}

    def _library(self, path: Path):
        from kvgen.runtime.score import ScoreLibrary

        try:
            return ScoreLibrary(path, family=self.family)
        except Exception as exc:  # noqa: BLE001 - any load problem is this candidate's failure
            raise Failure("load", str(exc)) from None

    def check(self, path: Path, seed: int) -> None:
        """Scores of 2 fresh requests within 1e-4 x the largest |score| of the float64 oracle
        (float32 accumulation over <= 128 frequencies is ~1e-6 relative; a wrong index is O(1))."""
        import torch

        from kvgen.bench.score import Cache
        from kvgen.reference.triattention import score_paged

        torch.manual_seed(seed)
        library = self._library(path)
        cache = Cache(self.family, 2, 300)
        inputs = cache.kernel_inputs()
        _launch(lambda: library.score(**inputs))
        g = cache.geometry
        zeros = torch.zeros(2, dtype=torch.long, device="cuda")
        for index, layer in enumerate(g.scored_layers):
            ref, _ = score_paged(cache.k_pools[layer], cache.page_table, inputs["P"], inputs["S"], zeros,
                                 cache.calibration, layer, g, torch.float64)
            err = (inputs["scores"][index].double() - ref).abs().max()
            if not bool(err <= 1e-4 * ref.abs().max().clamp(min=1e-30)):
                raise Failure("wrong", f"layer {layer}: max error {float(err):.3g} vs max |score| "
                                       f"{float(ref.abs().max()):.3g}")

    def time(self, path: Path, bucket: str, reps: int) -> dict[str, float]:
        library = self._library(path)
        calls = [lambda inputs=inputs: library.score(**inputs) for _, inputs in self.inputs[bucket]]
        _launch(calls[0])
        return self.timed(calls, reps)


class CompactBench(_Bench):
    """In-place compaction of B due requests (budget kept of ``decode`` generated tokens), every
    layer, moves from the oracle's packer; K/V pools of the family's geometry."""

    PROMPT, MAX_TAIL = 512, 31

    def __init__(self, family: str, buckets: Iterable[Any], seed: int):
        from kvgen.lower.triattention import tri_geometry
        from kvgen.spec.schema import load_spec

        self.spec = load_spec(spec_path(family))
        self.geometry = tri_geometry(self.spec)
        self.seed = seed
        self.inputs, self.sizes = {}, {}
        for b in buckets:
            batch, decode, budget = self._size(b.size)
            moves, table, pages = self._moves(batch, decode, budget, seed)
            layer_bytes = 2 * pages * self._page_elems() * self.spec.elem_bytes
            sets = [self._pools(pages, fill=False) for _ in range(self.copies(self.spec.layers * layer_bytes // 2))]
            self.inputs[b.name] = (moves, table, sets)
            self.sizes[b.name] = {"batch": batch, "decode": decode, "budget": budget, "rotation": len(sets)}

    def _size(self, size) -> tuple[int, int, int]:
        """The bucket's (batch, decode, budget), the budget raised to the widest sliding window (the
        contract requires it) and the batch halved until the pools take at most 40 % of free memory."""
        import torch

        windows = [w for w in self.geometry.swa_window if w]
        budget = max(size["budget"], *windows) if windows else size["budget"]
        decode = max(size["decode"], budget + 1024)
        batch = size["batch"]
        tokens = self.PROMPT + decode + self.MAX_TAIL
        per_request = 2 * self.spec.layers * math.ceil(tokens / self.geometry.tokens_per_block) * self._page_elems() \
            * self.spec.elem_bytes
        free, _ = torch.cuda.mem_get_info()
        while batch > 1 and batch * per_request > 0.4 * free:
            batch //= 2
        return batch, decode, budget

    def _page_elems(self) -> int:
        g = self.geometry
        return g.kv_heads * g.tokens_per_block * g.head_dim

    def _moves(self, batch: int, decode: int, budget: int, seed: int):
        import torch

        from kvgen.reference.triattention import Moves, pack_moves

        g = self.geometry
        gen = torch.Generator().manual_seed(seed)
        P = torch.full((batch,), self.PROMPT, dtype=torch.long)
        S = P + decode
        tail = torch.randint(0, self.MAX_TAIL + 1, (batch,), generator=gen)
        kept = torch.rand(batch, 1, decode, generator=gen).argsort(dim=-1)[..., :budget].sort(dim=-1).values + P[:, None, None]
        active = torch.ones(batch, dtype=torch.bool)
        packed = pack_moves(kept, P, S, tail, active, budget, "union", g, batch)
        moves = Moves(packed.src.cuda(), packed.dst.cuda(), packed.offsets.cuda())
        per_request = math.ceil((self.PROMPT + decode + self.MAX_TAIL) / g.tokens_per_block)
        table = torch.randperm(batch * per_request, generator=gen).to(torch.int32).reshape(batch, per_request)
        return moves, table.cuda(), batch * per_request

    def _pools(self, pages: int, fill: bool, seed: int = 0):
        import torch

        from kvgen.runtime.score import TORCH_DTYPES

        g = self.geometry
        shape = ((pages, g.kv_heads, g.tokens_per_block, g.head_dim) if g.layout == "HND"
                 else (pages, g.tokens_per_block, g.kv_heads, g.head_dim))
        gen = torch.Generator(device="cuda").manual_seed(seed)
        pools = ([], [])
        for _ in range(self.spec.layers):
            for side in pools:
                pool = torch.empty(shape, dtype=TORCH_DTYPES[self.spec.dtype], device="cuda")
                if fill:
                    pool.view(torch.uint8).random_(0, 256, generator=gen)
                side.append(pool)
        return pools

    def _compactor(self, path: Path, pools):
        from kvgen.runtime.compact import CompactLibrary, Compactor

        try:
            return Compactor(CompactLibrary(path), *pools)
        except Exception as exc:  # noqa: BLE001 - any load problem is this candidate's failure
            raise Failure("load", str(exc)) from None

    def check(self, path: Path, seed: int) -> None:
        """Pools byte-identical to the oracle's compact_paged after one compaction of 2 fresh requests."""
        import torch

        from kvgen.reference.triattention import compact_paged

        _, decode, budget = self._size({"batch": 2, "decode": 300, "budget": 100})
        moves, table, pages = self._moves(2, decode, budget, seed)
        pools = self._pools(pages, fill=True, seed=seed)
        ref = ([p.clone() for p in pools[0]], [p.clone() for p in pools[1]])
        compact_paged(ref[0], ref[1], table, moves, self.geometry)
        compactor = self._compactor(path, pools)
        _launch(lambda: compactor(table, moves.src, moves.dst, moves.offsets))
        for got, want in zip(pools[0] + pools[1], ref[0] + ref[1]):
            if not torch.equal(got.view(torch.uint8), want.view(torch.uint8)):
                raise Failure("wrong", "compacted pools differ from the oracle")

    def time(self, path: Path, bucket: str, reps: int) -> dict[str, float]:
        moves, table, sets = self.inputs[bucket]
        compactors = [self._compactor(path, pools) for pools in sets]
        calls = [lambda c=c: c(table, moves.src, moves.dst, moves.offsets) for c in compactors]
        _launch(calls[0])
        return self.timed(calls, reps)


BENCHES = {"codec": CodecBench, "score": ScoreBench, "compact": CompactBench}


def _launch(fn: Callable[[], Any]) -> None:
    """Run once and synchronize: a failed launch is a "launch" failure (sticky errors kill the worker)."""
    import torch

    try:
        fn()
        torch.cuda.synchronize()
    except Failure:
        raise
    except Exception as exc:  # noqa: BLE001 - LibraryError, ValueError, RuntimeError from the call
        raise Failure("launch", f"{type(exc).__name__}: {exc}") from None


# ---------------------------------------------------------------------------------------------
# Worker: one (family, op), its candidates in order
# ---------------------------------------------------------------------------------------------


def _library_for(op: str, path: Path):
    if op == "codec":
        from kvgen.runtime import FamilyLibrary
        from kvgen.runtime.library import LibraryError

        try:
            return FamilyLibrary(path)
        except LibraryError as exc:
            raise Failure("load", str(exc)) from None
    return path


def worker(bundle: Path, family: str, op: str, configs: list[str], out: Path, reps: int, seed: int) -> int:
    index = read_bundle(bundle)
    candidates = {c["config"]: Candidate(**c) for c in index["candidates"] if (c["family"], c["op"]) == (family, op)}
    buckets = BUCKETS[op]
    bench = BENCHES[op](family, buckets, seed)
    env = {**environment(), "toolchain": index.get("toolchains", {})}
    with open(out, "a", encoding="utf-8") as sink:
        for n, config in enumerate(configs):
            c = candidates[config]
            rows = measure_candidate(bench, bundle, c, buckets, reps, seed + 1 + n)
            for row in rows:
                sink.write(json.dumps({**row, "environment": env}) + "\n")
            sink.flush()
    return 0


def measure_candidate(bench, bundle: Path, c: Candidate, buckets, reps: int, seed: int) -> list[dict[str, Any]]:
    base = {"family": c.family, "op": c.op, "arch": c.arch, "config": c.config, "params": c.params}
    try:
        if c.status == "failed":
            raise Failure("build", c.error.splitlines()[0] if c.error else "build failed")
        library = _library_for(c.op, bundle / c.artifact)
        bench.check(library, seed)
    except Failure as failure:
        return [{**base, "bucket": b.name, "status": failure.kind, "failure": failure.detail[:500]} for b in buckets]
    except Exception:  # noqa: BLE001 - a harness error is recorded (same for every candidate: visible)
        detail = traceback.format_exc()[-500:]
        return [{**base, "bucket": b.name, "status": "error", "failure": detail} for b in buckets]
    rows = []
    for b in buckets:
        try:
            rows.append({**base, "bucket": b.name, "status": "ok", "reps": reps, "size": bench.size(b),
                         **bench.time(library, b.name, reps)})
        except Failure as failure:
            rows.append({**base, "bucket": b.name, "status": failure.kind, "failure": failure.detail[:500]})
    return rows


def environment() -> dict[str, str]:
    """What a tuned configuration is valid for (compared by ``kvgen.lower.tuned``)."""
    import torch

    from kvgen import __version__
    from kvgen.bench.common import environment as bench_environment

    env = bench_environment()
    return {"gpu": env["gpu"], "compute_capability": env["compute_capability"], "driver": env["driver"],
            "cuda_runtime": env["cuda_runtime"], "torch": torch.__version__, "kvgen": __version__}


# ---------------------------------------------------------------------------------------------
# Parent: every (family, op) of a bundle, workers restarted past crashes
# ---------------------------------------------------------------------------------------------


def measure_bundle(bundle: Path, out: Path, *, families: set[str] | None = None, ops: set[str] | None = None,
                   reps: int = DEFAULT_REPS, seed: int = 0, log: Callable[[str], None] = print) -> Path:
    done = {record_key(r) for r in read_records(out)}
    groups: dict[tuple[str, str, str], list[str]] = {}
    for c in read_index(bundle):
        if (families and c.family not in families) or (ops and c.op not in ops):
            continue
        if all((c.family, c.op, c.arch, c.config, b.name) in done for b in BUCKETS[c.op]):
            continue
        groups.setdefault((c.family, c.op, c.arch), []).append(c.config)
    for (family, op, arch), configs in groups.items():
        start = time.perf_counter()
        _run_group(bundle, family, op, arch, configs, out, reps, seed, log)
        log(f"{family} {op}: {len(configs)} candidates in {time.perf_counter() - start:.1f} s")
    return out


def _run_group(bundle: Path, family: str, op: str, arch: str, configs: list[str], out: Path, reps: int, seed: int,
               log: Callable[[str], None]) -> None:
    todo = list(configs)
    while todo:
        cmd = [sys.executable, "-m", "kvgen.tuning.measure", "--worker", str(bundle), "--family", family,
               "--op", op, "--configs", ";".join(todo), "--out", str(out), "--reps", str(reps), "--seed", str(seed)]
        status, stderr = _supervise(cmd, out)
        finished = {r["config"] for r in read_records(out) if r["family"] == family and r["op"] == op}
        todo = [c for c in todo if c not in finished]
        if status == 0 or not todo:
            if todo:
                log(f"{family} {op}: worker exited without measuring {len(todo)} candidates")
            return
        culprit = todo.pop(0)
        kind = "timeout" if status is None else "crash"
        log(f"{family} {op} {culprit}: {kind}; {stderr.strip().splitlines()[-1] if stderr.strip() else ''}")
        with open(out, "a", encoding="utf-8") as sink:
            for b in BUCKETS[op]:
                sink.write(json.dumps({"family": family, "op": op, "arch": arch, "config": culprit, "bucket": b.name,
                                       "params": parse_config(culprit), "status": kind,
                                       "failure": stderr.strip()[-500:]}) + "\n")


def _supervise(cmd: list[str], out: Path) -> tuple[int | None, str]:
    """Run a worker; kill it when ``out`` stops growing for WORKER_SILENCE_S (status None)."""
    with tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen(cmd, stderr=err, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        size, last = -1, time.monotonic()
        while proc.poll() is None:
            time.sleep(0.5)
            now_size = out.stat().st_size if out.exists() else 0
            if now_size != size:
                size, last = now_size, time.monotonic()
            elif time.monotonic() - last > WORKER_SILENCE_S:
                proc.kill()
                proc.wait()
                err.seek(0)
                return None, err.read()
        err.seek(0)
        return proc.returncode, err.read()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle", type=Path, help="candidate bundle: a directory or its .tar.xz")
    parser.add_argument("--out", type=Path, required=True, help="measurements (JSON lines, appended)")
    parser.add_argument("--families", default="", help="comma-separated (default: all in the bundle)")
    parser.add_argument("--ops", default="", help="comma-separated (default: all in the bundle)")
    parser.add_argument("--reps", type=int, default=DEFAULT_REPS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--specs", type=Path, default=None, help="spec directory (default: $KVGEN_SPECS_DIR, "
                                                                 "else ./specs)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--family", help=argparse.SUPPRESS)
    parser.add_argument("--op", help=argparse.SUPPRESS)
    parser.add_argument("--configs", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.specs is not None:   # workers inherit it through the environment
        os.environ["KVGEN_SPECS_DIR"] = str(args.specs.resolve())
    if args.worker:
        return worker(args.bundle, args.family, args.op, args.configs.split(";"), args.out, args.reps, args.seed)
    import torch

    if not torch.cuda.is_available():
        print("kvgen.tuning.measure needs a CUDA GPU (build candidates anywhere, measure them on the GPU machine)",
              file=sys.stderr)
        return 2
    bundle = args.bundle
    split = lambda s: {x for x in s.split(",") if x}  # noqa: E731
    try:
        if bundle.is_file():
            bundle = unpack_bundle(bundle, Path(tempfile.mkdtemp(prefix="kvgen-bundle-")))
        measure_bundle(bundle, args.out, families=split(args.families) or None, ops=split(args.ops) or None,
                       reps=args.reps, seed=args.seed)
    except (OSError, ValueError, tarfile.TarError) as exc:
        print(f"error: {args.bundle}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
