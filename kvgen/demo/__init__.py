"""``kvgen demo``: a serving scenario driven the way an inference engine would drive kvgen.

Two parts, each on real model geometry (``specs/qwen3-8b.yaml``; the codec also on the MLA family
``specs/deepseek-v3.yaml``):

1. **Cold tier.** A paged hot pool on the GPU with a fixed number of pages, a cold tier in pinned
   host memory with a fixed byte budget and, with ``--disk DIR``, a disk tier (a file of cold
   blobs). Requests arrive with prompts; when the hot pool is full the least recently used request
   is offloaded (its pages encoded by the generated codec from the registry straight into pinned
   slots) and onboarded (decoded into free hot pages) when it returns. Every onboarded page is
   compared with the oracle's ``decode(encode(original))``, byte for byte, and attention over the
   restored K/V is compared with attention over the original.
2. **Eviction.** Long-decode requests compacted by TriAttention rounds (``TriAttentionManager``
   with the generated score, pack and compact kernels) at several budgets; attention over the
   kept tokens is compared with attention over all of them.

K/V are synthetic but shaped like a real cache: per-channel outliers (10-50x), K rotated by RoPE
at its real positions with the spec's theta, scaling and pairing. Attention is the real formula,
``softmax(q K^T * scale) V`` with the spec's GQA grouping.

``--device cpu`` runs the same scenario with the oracle as the codec (``kvgen.reference``) and as
the TriAttention backends (``score_keys``, ``pack_moves``, ``compact_paged``); the report says so
(``"backend": "oracle (cpu)"``) and its times are wall-clock times of the oracle, not kernel times.

Results are plain dataclasses (``DemoResult`` holding ``CodecFamilyResult`` per family with its
``PageBytes``, ``CodecChecks``, ``TransferResult``, and an ``EvictionResult`` with one
``BudgetResult`` per budget); ``dataclasses.asdict`` of the ``DemoResult`` is the JSON report.
The CLI wires ``kvgen demo`` to ``add_arguments`` and ``run``; importing this module imports
neither torch nor the oracle (they load when the demo runs).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kvgen.lower.layout import FamilyLayout, family_layout
from kvgen.artifacts.manifest import RegistryError
from kvgen.spec.schema import FamilySpec, SpecError, load_spec


class _Deferred:
    """A module imported on first use. The CLI imports this file to build its parser, so torch and
    the torch-based oracle are imported when the demo runs, not when any other verb starts."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(importlib.import_module(self._name), attr)


torch = _Deferred("torch")
reference = _Deferred("kvgen.reference")                    # cold-page oracle: encode_records, decode_records
oracle = _Deferred("kvgen.reference.triattention")         # RoPE, calibration, TriAttention oracle
spec_tri = _Deferred("kvgen.lower.triattention")                     # a spec's TriAttention geometry and RoPE

FORMAT_VERSION = 1
CODEC_FAMILIES = ("qwen3-8b", "deepseek-v3")   # GQA and MLA
EVICTION_FAMILY = "qwen3-8b"
GENERATED_BACKEND = "generated (registry)"
ORACLE_BACKEND = "oracle (cpu)"
CALIBRATION_QUERIES = 256   # synthetic_calibration's default sample count; the demo's queries are from it
CALIBRATION_SPREAD = 0.3


class DemoError(RuntimeError):
    """A setup the demo cannot run (no GPU for --device cuda, a family it does not model)."""


# ----------------------------------------------------------------------------------------------
# Configuration
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Sizes:
    """Everything sized by the run; ``--small`` picks sizes a CPU oracle runs in seconds."""

    requests: int
    prompt_pages: tuple[int, int]     # inclusive range of pages per prompt
    hot_pages: int
    host_budget_mib: float
    queries_per_head: int
    long_requests: int
    long_prompt: int
    long_generated: int
    budgets: tuple[int, ...]
    transfer_reps: int
    layers: int | None = None         # None: the spec's layer count


# The CPU oracle encodes about 1e6-1e7 elements/s: with --small on the CPU the families keep their
# geometry but only this many layers (a cold page is one record per layer, so every per-page
# ratio is unchanged). The GPU always runs every layer: its libraries are built for them.
CPU_SMALL_LAYERS = 2


FULL = Sizes(requests=32, prompt_pages=(4, 24), hot_pages=160, host_budget_mib=512.0, queries_per_head=4,
             long_requests=4, long_prompt=512, long_generated=4096, budgets=(512, 1024, 2048), transfer_reps=10)
SMALL = Sizes(requests=6, prompt_pages=(1, 2), hot_pages=5, host_budget_mib=6.0, queries_per_head=2,
              long_requests=2, long_prompt=40, long_generated=384, budgets=(64, 128, 256), transfer_reps=3)


@dataclass(frozen=True)
class DemoConfig:
    device: torch.device
    registry: Path
    arch: str | None
    specs_dir: Path
    generated_dir: Path
    disk: Path | None
    seed: int
    out: Path
    small: bool
    sizes: Sizes

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    @property
    def backend(self) -> str:
        return GENERATED_BACKEND if self.on_gpu else ORACLE_BACKEND


def _budgets(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--budgets {text!r}: expected a comma list of integers, "
                                         "e.g. 512,1024,2048") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--budgets {text!r}: expected positive integers")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``kvgen demo`` (defaults of sizes depend on ``--small``)."""
    parser.add_argument("--registry", type=Path, default=Path("build/registry"),
                        help="registry directory (default: build/registry)")
    parser.add_argument("--arch", default=None, help="target arch of the libraries (default: detect from GPU 0)")
    parser.add_argument("--requests", type=int, default=None, help=f"requests of the offload scenario "
                        f"(default {FULL.requests}, small {SMALL.requests})")
    parser.add_argument("--hot-pages", type=int, default=None, help=f"pages of the GPU hot pool "
                        f"(default {FULL.hot_pages}, small {SMALL.hot_pages})")
    parser.add_argument("--host-budget-mib", type=float, default=None, help=f"pinned host bytes of the cold "
                        f"tier, MiB (default {FULL.host_budget_mib:g}, small {SMALL.host_budget_mib:g})")
    parser.add_argument("--disk", type=Path, default=None, help="directory of a disk tier below the cold tier")
    parser.add_argument("--budgets", type=_budgets, default=None, help="TriAttention budgets, comma list "
                        "(default 512,1024,2048 of 4096 generated tokens; small 64,128,256 of 384)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default=None,
                        help="cuda: generated kernels from the registry; cpu: the oracle, slow: use it with "
                             "--small (default: cuda if present)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="JSON report (default: $OUT/demo.json if OUT is "
                        "set, else results/demo.json)")
    parser.add_argument("--small", action="store_true", help="tiny sizes (tests, CPU)")


def _default_dir(name: str) -> Path:
    """``./name`` when run from the repository, else the one beside the package."""
    local = Path(name)
    return local if local.is_dir() else Path(__file__).resolve().parent.parent / name


def config_from_args(args: argparse.Namespace, environ: dict[str, str] | None = None) -> DemoConfig:
    environ = dict(os.environ) if environ is None else environ
    base = SMALL if args.small else FULL
    sizes = Sizes(
        requests=args.requests or base.requests,
        prompt_pages=base.prompt_pages,
        hot_pages=args.hot_pages or base.hot_pages,
        host_budget_mib=args.host_budget_mib or base.host_budget_mib,
        queries_per_head=base.queries_per_head,
        long_requests=base.long_requests,
        long_prompt=base.long_prompt,
        long_generated=base.long_generated,
        budgets=tuple(args.budgets) if args.budgets else base.budgets,
        transfer_reps=base.transfer_reps,
    )
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu":   # wall-clock of the oracle: one rep says as much as ten
        sizes = replace(sizes, transfer_reps=1, layers=CPU_SMALL_LAYERS if args.small else None)
    if device == "cuda" and not torch.cuda.is_available():
        raise DemoError("--device cuda: no CUDA device here; use --device cpu for the oracle run")
    out = args.out or (Path(environ["OUT"]) / "demo.json" if environ.get("OUT") else Path("results/demo.json"))
    specs = getattr(args, "specs", None) or _default_dir("specs")
    return DemoConfig(device=torch.device(device), registry=Path(args.registry), arch=args.arch,
                      specs_dir=Path(specs), generated_dir=_default_dir("generated"), disk=args.disk,
                      seed=args.seed, out=Path(out), small=args.small, sizes=sizes)


# ----------------------------------------------------------------------------------------------
# Timing: CUDA events on the GPU, wall clock on the CPU (labelled in the report)
# ----------------------------------------------------------------------------------------------

def timer_label(device: torch.device) -> str:
    return "cuda events" if device.type == "cuda" else "wall-clock (cpu)"


def time_once_ms(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    """``fn()`` and its time in ms; on the GPU bracketed by CUDA events and synchronized."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        value = fn()
        end.record()
        end.synchronize()
        return value, start.elapsed_time(end)
    begin = time.perf_counter()
    value = fn()
    return value, (time.perf_counter() - begin) * 1e3


def median_ms(fn: Callable[[], Any], device: torch.device, reps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    samples = sorted(time_once_ms(fn, device)[1] for _ in range(reps))
    return samples[len(samples) // 2]


# ----------------------------------------------------------------------------------------------
# Geometry of a cache family, as the scenario needs it
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RopeSpan:
    """The rotated span of a row (duck-types the fields of ``TriGeometry`` that ``split_pairs``
    and ``apply_rope`` read, so MLA latents, which ``TriGeometry`` refuses, rotate the same way)."""

    rotary_start: int
    rotary_dim: int
    pairing: str

    @property
    def freqs(self) -> int:
        return self.rotary_dim // 2


@dataclass(frozen=True)
class CacheGeometry:
    family: str
    attention: str
    layers: int
    query_heads: int
    kv_heads: int            # 1 for an MLA latent
    row_dim: int             # K/V head_dim, or the latent width
    value_dim: int           # width of the attention values: head_dim, or kv_lora_rank for MLA
    tokens_per_block: int
    layout: str              # HND | NHD
    dtype: str
    buffers: tuple[str, ...]  # quantized buffers of a layer, in codec order (k, v) or (latent,)
    rope: RopeSpan
    omega: torch.Tensor      # float32 [F], RoPE angular frequencies (HF inv_freq, scaling applied)

    @classmethod
    def from_spec(cls, spec: FamilySpec, layout: FamilyLayout) -> CacheGeometry:
        if layout.record.sides:
            raise DemoError(f"{spec.name}: side buffers are not part of this demo")
        rotary = spec.rotary_dim
        start = spec.row_dim - rotary if spec.rope.placement == "trailing" else 0
        value_dim = spec.mla.kv_lora_rank if spec.attention == "mla" and spec.mla else spec.row_dim
        return cls(family=spec.name, attention=spec.attention, layers=spec.layers, query_heads=spec.query_heads,
                   kv_heads=spec.kv_heads, row_dim=spec.row_dim, value_dim=value_dim,
                   tokens_per_block=spec.tokens_per_block, layout=spec.layout, dtype=spec.dtype,
                   buffers=tuple(b.name for b in layout.record.buffers),
                   rope=RopeSpan(start, rotary, spec.rope.pairing),
                   omega=oracle.rope_omega(rotary, spec.rope.theta, spec_tri.rope_scaling(spec)))

    @property
    def page_shape(self) -> tuple[int, int, int]:
        if self.layout == "HND":
            return self.kv_heads, self.tokens_per_block, self.row_dim
        return self.tokens_per_block, self.kv_heads, self.row_dim

    @property
    def torch_dtype(self) -> torch.dtype:
        return reference.codec.HOT_TORCH_DTYPES[self.dtype]

    @property
    def softmax_scale(self) -> float:
        # 1/sqrt(width of the dot product): head_dim for GQA, the latent width for MLA's absorbed form.
        return 1.0 / math.sqrt(self.row_dim)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.tokens_per_block)


def to_pages(rows: torch.Tensor, geometry: CacheGeometry) -> torch.Tensor:
    """``[Hkv, T, D]`` token rows (T a multiple of the page size) -> ``[pages, *page_shape]``."""
    heads, tokens, width = rows.shape
    pages = tokens // geometry.tokens_per_block
    paged = rows.reshape(heads, pages, geometry.tokens_per_block, width)
    if geometry.layout == "HND":
        return paged.permute(1, 0, 2, 3).contiguous()
    return paged.permute(1, 2, 0, 3).contiguous()


def from_pages(pages: torch.Tensor, geometry: CacheGeometry) -> torch.Tensor:
    """Inverse of ``to_pages``: ``[pages, *page_shape]`` -> ``[Hkv, pages * tokens_per_block, D]``."""
    if geometry.layout == "HND":
        rows = pages.permute(1, 0, 2, 3)
    else:
        rows = pages.permute(2, 0, 1, 3)
    return rows.reshape(geometry.kv_heads, -1, geometry.row_dim)


# ----------------------------------------------------------------------------------------------
# Synthetic K/V: outlier channels, RoPE at real positions (one generator for every family)
# ----------------------------------------------------------------------------------------------

OUTLIER_SCALE = (10.0, 50.0)
ROTATED_OUTLIER_PAIRS = 2     # per (layer, head): massive values sit in low-frequency RoPE pairs
PLAIN_OUTLIER_CHANNELS = 2    # per (layer, head): outlier channels of V (and the latent's non-RoPE part)
CHANNEL_MEAN_STD = 0.5        # channels have a small per-channel mean, as real K/V do


def _pair_elements(span: RopeSpan, freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row indices of the two elements of RoPE pairs ``freqs`` (half: f, f+F; interleaved: 2f, 2f+1)."""
    if span.pairing == "half":
        return span.rotary_start + freqs, span.rotary_start + freqs + span.freqs
    return span.rotary_start + 2 * freqs, span.rotary_start + 2 * freqs + 1


def channel_statistics(geometry: CacheGeometry, rotated: bool, gen: torch.Generator
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (layer, head, channel) mean and std of one buffer: a property of the model, not of a request.

    Channels of the rotated span (K, the latent's RoPE part) get ``ROTATED_OUTLIER_PAIRS`` outlier
    pairs among the lowest-frequency quarter of the pairs, with a large consistent magnitude (mean
    10-50, phase fixed per pair, std a quarter of it): the "massive values" of K sit in slowly
    rotating pairs in real models. Other channels (V, the latent's non-RoPE part) get
    ``PLAIN_OUTLIER_CHANNELS`` channels whose std is 10-50x.
    """
    shape = (geometry.layers, geometry.kv_heads, geometry.row_dim)
    mean = torch.randn(shape, generator=gen) * CHANNEL_MEAN_STD
    std = torch.ones(shape)
    span = geometry.rope if rotated else RopeSpan(0, 0, "half")
    inside = torch.zeros(geometry.row_dim, dtype=torch.bool)
    inside[span.rotary_start:span.rotary_start + span.rotary_dim] = True
    plain = torch.nonzero(~inside).flatten()
    low, high = OUTLIER_SCALE
    for layer in range(geometry.layers):
        for head in range(geometry.kv_heads):
            if span.rotary_dim:
                slow = torch.arange(span.freqs - max(span.freqs // 4, ROTATED_OUTLIER_PAIRS), span.freqs)
                freqs = slow[torch.randperm(slow.numel(), generator=gen)[:ROTATED_OUTLIER_PAIRS]]
                size = low + (high - low) * torch.rand(freqs.numel(), generator=gen)
                phase = torch.rand(freqs.numel(), generator=gen) * 2 * math.pi
                a, b = _pair_elements(span, freqs)
                mean[layer, head, a], mean[layer, head, b] = size * phase.cos(), size * phase.sin()
                std[layer, head, a], std[layer, head, b] = size / 4, size / 4
            if plain.numel():
                channels = plain[torch.randperm(plain.numel(), generator=gen)[:PLAIN_OUTLIER_CHANNELS]]
                std[layer, head, channels] = low + (high - low) * torch.rand(channels.numel(), generator=gen)
    return mean, std


class KVGenerator:
    """Deterministic synthetic cache of a family: the same (request seed, length) gives the same
    bytes every time, so a request's original K/V can be regenerated to check what came back."""

    def __init__(self, geometry: CacheGeometry, seed: int, device: torch.device):
        self.geometry = geometry
        self.device = device
        self.seed = seed
        gen = torch.Generator().manual_seed(seed * 1_000_003 + sum(map(ord, geometry.family)))
        # K and the latent carry RoPE; V never does (COLD_PAGE_FORMAT.md §1).
        self.stats = {name: tuple(t.to(device) for t in channel_statistics(geometry, name != "v", gen))
                      for name in geometry.buffers}

    def tokens(self, request_seed: int, count: int) -> dict[str, torch.Tensor]:
        """``{buffer: [layers, Hkv, count, D]}`` in the hot dtype, token ``t`` rotated at position ``t``."""
        g = self.geometry
        gen = torch.Generator(device=self.device).manual_seed(self.seed * 7919 + request_seed)
        positions = torch.arange(count, device=self.device).expand(g.kv_heads, count)
        out = {}
        for name in g.buffers:
            mean, std = self.stats[name]
            layers = []
            for layer in range(g.layers):
                noise = torch.randn((g.kv_heads, count, g.row_dim), generator=gen, device=self.device)
                x = mean[layer][:, None, :] + std[layer][:, None, :] * noise
                if name != "v" and g.rope.rotary_dim:
                    x = oracle.apply_rope(x, positions, g.omega.to(self.device), g.rope)
                layers.append(x.to(g.torch_dtype))
            out[name] = torch.stack(layers)
        return out

    def paged(self, request_seed: int, count: int) -> dict[str, torch.Tensor]:
        """``{buffer: [layers, pages, *page_shape]}``; rows past ``count`` in the last page are zero."""
        g = self.geometry
        padded = g.pages_for(count) * g.tokens_per_block
        out = {}
        for name, rows in self.tokens(request_seed, count).items():
            full = rows.new_zeros(rows.shape[:2] + (padded, g.row_dim))
            full[:, :, :count] = rows
            out[name] = torch.stack([to_pages(full[layer], g) for layer in range(g.layers)])
        return out


# ----------------------------------------------------------------------------------------------
# Attention and its error
# ----------------------------------------------------------------------------------------------

def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """``softmax(q k^T * scale) v`` in float32. ``q`` ``[Hq, n, D]``, ``k`` ``[Hkv, T, D]``,
    ``v`` ``[Hkv, T, Dv]``; query head ``h`` reads KV head ``h // (Hq / Hkv)`` (GQA)."""
    heads, n, width = q.shape
    kv_heads = k.shape[0]
    grouped = q.float().reshape(kv_heads, (heads // kv_heads) * n, width)
    logits = grouped @ k.float().transpose(1, 2) * scale
    out = logits.softmax(dim=-1) @ v.float()
    return out.reshape(heads, n, v.shape[-1])


@dataclass
class ErrorStats:
    """Relative L2 error over all output vectors and per-vector cosine similarity."""

    squared_error: float = 0.0
    squared_reference: float = 0.0
    cosines: list[float] = field(default_factory=list)

    def add(self, reference: torch.Tensor, other: torch.Tensor) -> None:
        ref = reference.double().reshape(-1, reference.shape[-1])
        got = other.double().reshape(-1, other.shape[-1])
        self.squared_error += float(((got - ref) ** 2).sum())
        self.squared_reference += float((ref ** 2).sum())
        self.cosines += torch.nn.functional.cosine_similarity(got, ref, dim=-1).tolist()

    def summary(self) -> dict[str, float | int | None]:
        if not self.cosines:
            return {"rel_l2": None, "cos_mean": None, "cos_min": None, "vectors": 0}
        return {"rel_l2": math.sqrt(self.squared_error / max(self.squared_reference, 1e-300)),
                "cos_mean": sum(self.cosines) / len(self.cosines), "cos_min": min(self.cosines),
                "vectors": len(self.cosines)}


def random_queries(geometry: CacheGeometry, count: int, position: int, gen: torch.Generator,
                   device: torch.device) -> torch.Tensor:
    """Gaussian queries ``[layers, Hq, count, D]``, RoPE applied at ``position`` on the rotated span."""
    g = geometry
    q = torch.randn((g.layers, g.query_heads, count, g.row_dim), generator=gen).to(device)
    if g.rope.rotary_dim:
        q = oracle.apply_rope(q, torch.full(q.shape[:-1], position, device=device), g.omega.to(device), g.rope)
    return q


def calibrated_queries(spec: FamilySpec, seed: int, count: int, position: int, device: torch.device) -> torch.Tensor:
    """Queries ``[layers, Hq, count, D]`` from the distribution the calibration was measured on
    (``synthetic_queries`` with the calibration's seed: the calibration is their mean), rotated at
    ``position``: TriAttention ranks keys by the attention such queries give them."""
    geometry = spec_tri.tri_geometry(spec)
    pairs = oracle.synthetic_queries(geometry, seed, CALIBRATION_QUERIES, CALIBRATION_SPREAD)[..., :count]
    pairs = pairs.permute(0, 1, 3, 2)                           # [L, Hq, count, F]
    rows = torch.zeros(pairs.shape[:3] + (geometry.head_dim,), dtype=torch.float32)
    re, im = oracle.split_pairs(rows, geometry)                         # views into rows
    re.copy_(pairs.real)
    im.copy_(pairs.imag)
    omega, _ = spec_tri.calibration_defaults(spec)
    rows = oracle.apply_rope(rows, torch.full(rows.shape[:-1], position), omega, geometry)
    return rows.to(device)


# ----------------------------------------------------------------------------------------------
# Codec backends: the generated codec (registry) or the oracle, behind one interface
# ----------------------------------------------------------------------------------------------

def oracle_encode_pages(layout: FamilyLayout, pages: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
    """Cold pages ``uint8 [n, cold_page_bytes]`` of lifecycle 0 (COLD_PAGE_FORMAT.md §2): the
    records of every layer, ascending. ``pages[layer][buffer]`` is ``[n, *page]``."""
    record = layout.record
    records = [reference.encode_records(record, {b.name: pages[layer][i] for i, b in enumerate(record.buffers)}, {})
               for layer in layout.lifecycles[0].layers]
    return torch.cat(records, dim=1)


def oracle_decode_pages(layout: FamilyLayout, cold: torch.Tensor, dtype: str,
                        page_shape: tuple[int, ...]) -> list[list[torch.Tensor]]:
    """Hot pages ``[layer][buffer] -> [n, *page]`` of cold pages ``uint8 [n, cold_page_bytes]``."""
    record_bytes = layout.record.bytes
    out = []
    for j, _ in enumerate(layout.lifecycles[0].layers):
        buffers, _ = reference.decode_records(layout.record, cold[:, j * record_bytes:(j + 1) * record_bytes], dtype)
        out.append([buffers[b.name].reshape((cold.shape[0],) + page_shape) for b in layout.record.buffers])
    return out


class OracleCodec:
    """``ColdPageCodec``'s interface (``encode``/``decode`` with ``(dst, src)`` pairs,
    ``cold_page_bytes``) over the oracle: the CPU stand-in for the generated codec."""

    def __init__(self, layout: FamilyLayout, pools: Sequence[Sequence[torch.Tensor]], dtype: str):
        self.layout, self.pools, self.dtype = layout, pools, dtype

    def cold_page_bytes(self, lifecycle: int = 0) -> int:
        return self.layout.lifecycles[lifecycle].cold_page_bytes

    def encode(self, cold: torch.Tensor, pairs: torch.Tensor, lifecycle: int = 0) -> None:
        dst, src = pairs[:, 0].long(), pairs[:, 1].long()
        pages = [[pool[src] for pool in layer] for layer in self.pools]
        cold[dst] = oracle_encode_pages(self.layout, pages).to(cold.device)

    def decode(self, cold: torch.Tensor, pairs: torch.Tensor, lifecycle: int = 0) -> None:
        dst, src = pairs[:, 0].long(), pairs[:, 1].long()
        page_shape = tuple(self.pools[0][0].shape[1:])
        decoded = oracle_decode_pages(self.layout, cold[src], self.dtype, page_shape)
        for layer, buffers in zip(self.pools, decoded):
            for pool, pages in zip(layer, buffers):
                pool[dst.to(pool.device)] = pages.to(pool.device)

    def close(self) -> None:
        """Nothing to release (the generated codec frees its device tables here)."""


def open_codec(config: DemoConfig, spec_path: Path, family: str, layout: FamilyLayout,
               pools: Sequence[Sequence[torch.Tensor]]) -> tuple[Any, dict[str, Any]]:
    """The codec of ``family`` over ``pools`` and what it is: on the GPU the generated one from the
    registry (sha256-verified, refused if the spec changed since the build), else the oracle."""
    if not config.on_gpu:
        codec = OracleCodec(layout, pools, family_dtype(layout, pools))
        return codec, {"backend": ORACLE_BACKEND, "library": None, "arch": None}
    from kvgen.runtime import RuntimeRegistry, codec_from_registry

    registry = RuntimeRegistry.default([config.registry], environ=os.environ)
    resolved = registry.resolve(family, config.arch, spec_path)
    codec = codec_from_registry(registry, family, pools, arch=config.arch, index_location="host",
                                spec_path=spec_path)
    return codec, {"backend": GENERATED_BACKEND, "library": str(resolved.artifact("codec")), "arch": resolved.arch}


def family_dtype(layout: FamilyLayout, pools: Sequence[Sequence[torch.Tensor]]) -> str:
    dtype = pools[0][0].dtype
    return next(name for name, torch_dtype in reference.codec.HOT_TORCH_DTYPES.items() if torch_dtype == dtype)


def pairs_tensor(dst: Sequence[int], src: Sequence[int]) -> torch.Tensor:
    """Host ``int32 [n, 2]`` page pairs ``(dst, src)``, the codec ABI's index array."""
    return torch.tensor(list(zip(dst, src)), dtype=torch.int32).reshape(-1, 2)


# ----------------------------------------------------------------------------------------------
# Memory tiers
# ----------------------------------------------------------------------------------------------

class FreeList:
    """Numbered slots handed out and taken back (hot pages, cold slots)."""

    def __init__(self, slots: int):
        self.free = list(range(slots))
        self.slots = slots

    def allocate(self, count: int) -> list[int]:
        taken, self.free = self.free[:count], self.free[count:]
        return taken

    def release(self, slots: Sequence[int]) -> None:
        self.free.extend(slots)

    @property
    def used(self) -> int:
        return self.slots - len(self.free)


class HotPool(FreeList):
    """Paged K/V (or latent) pools on the device: ``pools[layer][buffer]`` is ``[pages, *page]``."""

    def __init__(self, geometry: CacheGeometry, pages: int, device: torch.device):
        super().__init__(pages)
        shape = (pages,) + geometry.page_shape
        self.pools = [[torch.zeros(shape, dtype=geometry.torch_dtype, device=device) for _ in geometry.buffers]
                      for _ in range(geometry.layers)]
        self.pages = pages

    def write(self, pages: Sequence[int], data: dict[str, torch.Tensor], buffers: Sequence[str]) -> None:
        index = torch.tensor(list(pages), device=self.pools[0][0].device)
        for layer, pools in enumerate(self.pools):
            for pool, name in zip(pools, buffers):
                pool[index] = data[name][layer]

    def read(self, pages: Sequence[int]) -> list[list[torch.Tensor]]:
        index = torch.tensor(list(pages), device=self.pools[0][0].device)
        return [[pool[index] for pool in pools] for pools in self.pools]


class ColdTier(FreeList):
    """Fixed-size cold slots in pinned host memory (plain host memory without a GPU)."""

    def __init__(self, slots: int, page_bytes: int, pinned: bool):
        super().__init__(slots)
        storage = torch.zeros((max(slots, 1), page_bytes), dtype=torch.uint8)
        self.storage = storage.pin_memory() if pinned else storage
        self.kind = "pinned host" if pinned else "host (no GPU: not pinned)"


class DiskTier:
    """Cold blobs in one file, at ``slot * cold_page_bytes``; plain file writes and reads."""

    def __init__(self, directory: Path, family: str, page_bytes: int):
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"kvgen-demo-{family}.cold"
        self.file = open(self.path, "w+b")  # noqa: SIM115 - closed by close()
        self.page_bytes = page_bytes
        self.free: list[int] = []
        self.next_slot = 0
        self.bytes_written = 0
        self.bytes_read = 0
        self.seconds = 0.0

    def store(self, blobs: torch.Tensor) -> list[int]:
        """Write ``uint8 [n, page_bytes]`` host blobs; their disk slots."""
        begin = time.perf_counter()
        slots = []
        for blob in blobs:
            slot = self.free.pop() if self.free else self._grow()
            self.file.seek(slot * self.page_bytes)
            self.file.write(blob.numpy().tobytes())
            slots.append(slot)
        self.file.flush()
        self.bytes_written += blobs.numel()
        self.seconds += time.perf_counter() - begin
        return slots

    def load(self, slots: Sequence[int], into: torch.Tensor) -> None:
        """Read the blobs of ``slots`` into the host rows ``into`` (``uint8 [n, page_bytes]``) and free them."""
        begin = time.perf_counter()
        for slot, row in zip(slots, into):
            self.file.seek(slot * self.page_bytes)
            self.file.readinto(memoryview(row.numpy()))
        self.free.extend(slots)
        self.bytes_read += into.numel()
        self.seconds += time.perf_counter() - begin

    def _grow(self) -> int:
        self.next_slot += 1
        return self.next_slot - 1

    def close(self) -> None:
        self.file.close()
        self.path.unlink(missing_ok=True)


# ----------------------------------------------------------------------------------------------
# The offload scenario
# ----------------------------------------------------------------------------------------------

@dataclass
class Request:
    rid: int
    tokens: int
    pages: int
    state: str = "new"            # new | hot | cold | disk | dropped
    hot: list[int] = field(default_factory=list)
    cold: list[int] = field(default_factory=list)
    disk: list[int] = field(default_factory=list)
    last_used: int = 0


@dataclass
class ScenarioCounts:
    admitted: int = 0
    returns: int = 0
    offloads: int = 0
    pages_offloaded: int = 0
    onboards: int = 0
    pages_onboarded: int = 0
    spilled_to_disk: int = 0
    read_from_disk: int = 0
    dropped: int = 0
    recomputed: int = 0
    peak_cold_pages: int = 0
    offload_ms: float = 0.0
    onboard_ms: float = 0.0


@dataclass
class CodecChecks:
    pages_checked: int = 0
    cold_bytes_equal_oracle: bool = True
    restored_equal_oracle_decode: bool = True


def request_trace(count: int, rng: torch.Generator) -> list[int]:
    """Every request arrives once, in order, then returns once in a random order: arrivals fill
    the hot pool and push older requests out; returns bring them back."""
    returns = torch.randperm(count, generator=rng).tolist()
    return list(range(count)) + returns


class OffloadScenario:
    """LRU offload/onboard of requests between a hot pool, a cold tier and an optional disk tier.

    Hot pool full: the least recently used hot request is encoded into cold slots. Cold tier full:
    the least recently used cold request moves to disk (its blobs, byte for byte), or is dropped
    without a disk. A returning request comes back disk -> cold -> hot; every onboarded page is
    checked against the oracle and its attention error measured (``_onboard``).
    """

    def __init__(self, config: DemoConfig, geometry: CacheGeometry, layout: FamilyLayout, hot: HotPool,
                 cold: ColdTier, disk: DiskTier | None, codec: Any, generator: KVGenerator):
        self.config, self.geometry, self.layout = config, geometry, layout
        self.hot, self.cold, self.disk, self.codec, self.generator = hot, cold, disk, codec, generator
        self.counts = ScenarioCounts()
        self.checks = CodecChecks()
        self.errors = {"both": ErrorStats(), "k_only": ErrorStats(), "v_only": ErrorStats()}
        self.buffer_errors = {name: ErrorStats() for name in geometry.buffers}
        self.clock = 0
        self.requests: list[Request] = []
        self.query_gen = torch.Generator().manual_seed(config.seed + 17)

    # ---- the trace

    def run(self, requests: Sequence[Request], trace: Sequence[int]) -> None:
        self.requests = list(requests)
        for rid in trace:
            self.serve(self.requests[rid])

    def serve(self, request: Request) -> None:
        """A request is scheduled: make its K/V hot (prefill, or onboard from cold or disk)."""
        self.clock += 1
        if request.state != "new":
            self.counts.returns += 1
        if request.state in ("new", "dropped"):
            self._prefill(request)
        elif request.state in ("cold", "disk"):
            self._onboard(request)
        request.last_used = self.clock

    def _prefill(self, request: Request) -> None:
        if request.state == "dropped":
            self.counts.recomputed += 1
        else:
            self.counts.admitted += 1
        self._make_hot_room(request.pages, keep=request)
        request.hot = self.hot.allocate(request.pages)
        self.hot.write(request.hot, self.generator.paged(request.rid, request.tokens), self.geometry.buffers)
        request.state = "hot"

    # ---- eviction from the hot pool

    def _make_hot_room(self, pages: int, keep: Request) -> None:
        if pages > self.hot.pages:
            raise ValueError(f"request of {pages} pages cannot fit a hot pool of {self.hot.pages}")
        while len(self.hot.free) < pages:
            victim = min((r for r in self.requests if r.state == "hot" and r is not keep), key=lambda r: r.last_used)
            self._offload(victim)

    def _offload(self, request: Request) -> None:
        """Encode the request's hot pages into cold slots (the store is the transfer), free them."""
        if not self._make_cold_room(request.pages, keep=request):
            self._drop(request)
            return
        slots = self.cold.allocate(request.pages)
        pairs = pairs_tensor(slots, request.hot)
        _, ms = time_once_ms(lambda: self.codec.encode(self.cold.storage, pairs), self.config.device)
        self.counts.offload_ms += ms
        self.counts.offloads += 1
        self.counts.pages_offloaded += request.pages
        self.hot.release(request.hot)
        request.hot, request.cold, request.state = [], slots, "cold"
        self.counts.peak_cold_pages = max(self.counts.peak_cold_pages, self.cold.used)

    def _drop(self, request: Request) -> None:
        """No host room: discard the cache; the request is recomputed (prefilled again) when it
        returns. Happens without a disk tier, or when the only cold pages that could move down
        belong to the request being onboarded."""
        self.hot.release(request.hot)
        self.cold.release(request.cold)
        request.hot, request.cold, request.state = [], [], "dropped"
        self.counts.dropped += 1

    # ---- the cold tier

    def _make_cold_room(self, pages: int, keep: Request) -> bool:
        """Free cold slots by moving the least recently used cold requests down (to disk, or
        dropping them); False when even that cannot make room."""
        if pages > self.cold.slots:
            return False
        while len(self.cold.free) < pages:
            victims = [r for r in self.requests if r.state == "cold" and r is not keep]
            if not victims:
                return False
            victim = min(victims, key=lambda r: r.last_used)
            if self.disk is not None:
                self._spill(victim)
            else:
                self._drop(victim)
        return True

    def _spill(self, request: Request) -> None:
        request.disk = self.disk.store(self.cold.storage[request.cold])
        self.cold.release(request.cold)
        request.cold, request.state = [], "disk"
        self.counts.spilled_to_disk += 1

    def _unspill(self, request: Request) -> None:
        if not self._make_cold_room(request.pages, keep=request):
            raise RuntimeError(f"request {request.rid}: {request.pages} pages do not fit the cold tier")
        slots = self.cold.allocate(request.pages)
        staging = torch.empty((request.pages, self.cold.storage.shape[1]), dtype=torch.uint8)
        self.disk.load(request.disk, staging)
        self.cold.storage[slots] = staging
        request.disk, request.cold, request.state = [], slots, "cold"
        self.counts.read_from_disk += 1

    # ---- onboarding

    def _onboard(self, request: Request) -> None:
        """Decode the request's cold pages into free hot pages, then check what came back."""
        if request.state == "disk":
            self._unspill(request)
        # While room is made in the hot pool, the victims' offloads may need cold room: this
        # request's cold pages must not be the ones moved down or dropped to make it.
        request.state = "onboarding"
        self._make_hot_room(request.pages, keep=request)
        pages = self.hot.allocate(request.pages)
        original = self._original_pages(request)
        expected_cold = oracle_encode_pages(self.layout, original)
        self._check_cold_bytes(request, expected_cold)
        pairs = pairs_tensor(pages, request.cold)
        _, ms = time_once_ms(lambda: self.codec.decode(self.cold.storage, pairs), self.config.device)
        self.counts.onboard_ms += ms
        self.counts.onboards += 1
        self.counts.pages_onboarded += request.pages
        self.cold.release(request.cold)
        request.hot, request.cold, request.state = pages, [], "hot"
        restored = self.hot.read(request.hot)
        self._check_restored(restored, expected_cold)
        self.checks.pages_checked += request.pages
        self._attention_error(request, original, restored)

    def _original_pages(self, request: Request) -> list[list[torch.Tensor]]:
        paged = self.generator.paged(request.rid, request.tokens)
        return [[paged[name][layer] for name in self.geometry.buffers] for layer in range(self.geometry.layers)]

    def _check_cold_bytes(self, request: Request, expected: torch.Tensor) -> None:
        """The cold blobs (after pinned memory, and the disk if they went there) must be the
        oracle's encoding of the original pages (regenerated), byte for byte."""
        got = self.cold.storage[request.cold].to(expected.device)
        self.checks.cold_bytes_equal_oracle &= bool(torch.equal(got, expected))

    def _check_restored(self, restored: list[list[torch.Tensor]], expected_cold: torch.Tensor) -> None:
        """Restored pages must equal the oracle's decode(encode(original)), bit for bit."""
        expected = oracle_decode_pages(self.layout, expected_cold, self.geometry.dtype, self.geometry.page_shape)
        for want_layer, got_layer in zip(expected, restored):
            for want, got in zip(want_layer, got_layer):
                same = torch.equal(want.contiguous().view(torch.uint8), got.contiguous().view(torch.uint8))
                self.checks.restored_equal_oracle_decode &= bool(same)

    def _attention_error(self, request: Request, original: list[list[torch.Tensor]],
                         restored: list[list[torch.Tensor]]) -> None:
        g = self.geometry
        q = random_queries(g, self.config.sizes.queries_per_head, request.tokens, self.query_gen, self.config.device)
        for layer in range(g.layers):
            want = [from_pages(pages, g)[:, :request.tokens] for pages in original[layer]]
            got = [from_pages(pages, g)[:, :request.tokens] for pages in restored[layer]]
            for name, w, r in zip(g.buffers, want, got):
                self.buffer_errors[name].add(w, r)
            k_ref, v_ref = want[0], want[-1][..., :g.value_dim]
            k_got, v_got = got[0], got[-1][..., :g.value_dim]
            reference = attention(q[layer], k_ref, v_ref, g.softmax_scale)
            self.errors["both"].add(reference, attention(q[layer], k_got, v_got, g.softmax_scale))
            if len(g.buffers) > 1:   # K and V are separate buffers: which one costs what
                self.errors["k_only"].add(reference, attention(q[layer], k_got, v_ref, g.softmax_scale))
                self.errors["v_only"].add(reference, attention(q[layer], k_ref, v_got, g.softmax_scale))


# ----------------------------------------------------------------------------------------------
# Transfers: codec to/from the cold tier vs raw copies of the same hot pages
# ----------------------------------------------------------------------------------------------

@dataclass
class TransferResult:
    """Codec to/from the cold tier vs a raw copy of the same hot pages, same path, same run."""

    pages: int
    hot_bytes: int
    cold_bytes: int
    cold_memory: str
    timer: str
    reps: int
    encode_to_cold_ms: float
    decode_from_cold_ms: float
    raw_copy_to_host_ms: float
    raw_copy_from_host_ms: float
    offload_speedup_vs_raw: float      # raw copy time / encode time
    onboard_speedup_vs_raw: float      # raw copy time / decode time
    encode_cold_gbps: float
    decode_cold_gbps: float
    raw_to_host_gbps: float
    raw_from_host_gbps: float
    raw_baseline: str = "pre-gathered hot pages, one copy_ each way (gather not timed)"


def measure_transfers(config: DemoConfig, codec: Any, hot: HotPool, cold: ColdTier, layout: FamilyLayout,
                      gen: torch.Generator) -> TransferResult | None:
    """Encode ``n`` scattered hot pages into the cold tier and decode them back, against a raw copy
    of the same hot bytes over the same path (device -> pinned host and back). The raw copy moves
    pre-gathered pages with one ``copy_`` each way (the gather is not timed): the most favourable
    raw baseline. Runs after the scenario: it overwrites cold slots and hot pages."""
    lc = layout.lifecycles[0]
    n = min(hot.pages, cold.slots)
    if n == 0:
        return None
    sources = torch.randperm(hot.pages, generator=gen)[:n].tolist()
    slots = list(range(n))
    encode_pairs, decode_pairs = pairs_tensor(slots, sources), pairs_tensor(sources, slots)
    reps, warmup = config.sizes.transfer_reps, (2 if config.on_gpu else 0)
    device = config.device
    encode_ms = median_ms(lambda: codec.encode(cold.storage, encode_pairs), device, reps, warmup)
    decode_ms = median_ms(lambda: codec.decode(cold.storage, decode_pairs), device, reps, warmup)
    staging = gather_hot_bytes(hot, sources)
    raw = torch.empty_like(staging, device="cpu")
    raw = raw.pin_memory() if config.on_gpu else raw
    d2h_ms = median_ms(lambda: raw.copy_(staging, non_blocking=True), device, reps, warmup)
    h2d_ms = median_ms(lambda: staging.copy_(raw, non_blocking=True), device, reps, warmup)
    hot_bytes, cold_bytes = n * lc.hot_page_bytes, n * lc.cold_page_bytes
    return TransferResult(
        pages=n, hot_bytes=hot_bytes, cold_bytes=cold_bytes, cold_memory=cold.kind, timer=timer_label(device),
        reps=reps, encode_to_cold_ms=encode_ms, decode_from_cold_ms=decode_ms, raw_copy_to_host_ms=d2h_ms,
        raw_copy_from_host_ms=h2d_ms, offload_speedup_vs_raw=d2h_ms / encode_ms,
        onboard_speedup_vs_raw=h2d_ms / decode_ms, encode_cold_gbps=cold_bytes / encode_ms / 1e6,
        decode_cold_gbps=cold_bytes / decode_ms / 1e6, raw_to_host_gbps=hot_bytes / d2h_ms / 1e6,
        raw_from_host_gbps=hot_bytes / h2d_ms / 1e6)


def gather_hot_bytes(hot: HotPool, pages: Sequence[int]) -> torch.Tensor:
    """``uint8 [n, hot_page_bytes]`` on the device: every layer's pages of ``pages``, contiguous."""
    index = torch.tensor(list(pages), device=hot.pools[0][0].device)
    parts = [pool[index].reshape(len(pages), -1).view(torch.uint8) for layer in hot.pools for pool in layer]
    return torch.cat(parts, dim=1).contiguous()


# ----------------------------------------------------------------------------------------------
# Part 1: the codec scenario of one family
# ----------------------------------------------------------------------------------------------

def make_requests(config: DemoConfig, geometry: CacheGeometry, rng: torch.Generator) -> list[Request]:
    """Prompts of a random number of pages; the last page is partly filled (up to half empty)."""
    low, high = config.sizes.prompt_pages
    high = min(high, config.sizes.hot_pages)
    requests = []
    for rid in range(config.sizes.requests):
        pages = int(torch.randint(low, high + 1, (1,), generator=rng))
        empty = int(torch.randint(0, geometry.tokens_per_block // 2 + 1, (1,), generator=rng))
        requests.append(Request(rid, pages * geometry.tokens_per_block - empty, pages))
    return requests


@dataclass
class PageBytes:
    """Sizes of one page of every layer, and what the host budget holds raw or encoded."""

    hot_page_bytes: int
    cold_page_bytes: int
    codec_cold_page_bytes: int         # as the codec itself reports it (C ABI query on the GPU)
    cold_over_hot: float
    hot_over_cold: float               # how many times more pages the same host bytes hold
    host_budget_bytes: int
    cold_pages_in_budget: int
    raw_pages_in_budget: int


def page_bytes(layout: FamilyLayout, codec_cold_page_bytes: int, budget_bytes: int) -> PageBytes:
    lc = layout.lifecycles[0]
    return PageBytes(hot_page_bytes=lc.hot_page_bytes, cold_page_bytes=lc.cold_page_bytes,
                     codec_cold_page_bytes=codec_cold_page_bytes,
                     cold_over_hot=lc.cold_page_bytes / lc.hot_page_bytes,
                     hot_over_cold=lc.hot_page_bytes / lc.cold_page_bytes, host_budget_bytes=budget_bytes,
                     cold_pages_in_budget=budget_bytes // lc.cold_page_bytes,
                     raw_pages_in_budget=budget_bytes // lc.hot_page_bytes)


def load_family(config: DemoConfig, family: str) -> tuple[Path, FamilySpec]:
    """The spec file and its spec, with the layer count cut for a small CPU run."""
    spec_path = config.specs_dir / f"{family}.yaml"
    spec = load_spec(spec_path)
    if config.sizes.layers is not None and config.sizes.layers < spec.layers:
        spec = spec.model_copy(update={"layers": config.sizes.layers})
    return spec_path, spec


@dataclass
class CodecFamilyResult:
    family: str
    attention_kind: str
    layers: int
    kv_heads: int
    query_heads: int
    row_dim: int
    tokens_per_block: int
    dtype: str
    layout: str
    backend: str                       # "generated (registry)" | "oracle (cpu)"
    library: str | None
    arch: str | None
    bytes: PageBytes
    scenario: dict[str, Any]           # tiers and ScenarioCounts
    checks: CodecChecks
    attention: dict[str, Any]          # ErrorStats summaries: both, k_only, v_only; buffer_rel_l2
    transfer: TransferResult | None    # None when the host budget holds no cold page


def run_codec_family(config: DemoConfig, family: str) -> CodecFamilyResult:
    spec_path, spec = load_family(config, family)
    layout = family_layout(spec)
    if len(layout.lifecycles) != 1:
        raise DemoError(f"{family}: the demo moves lifecycle 0 only; this family has {len(layout.lifecycles)}")
    geometry = CacheGeometry.from_spec(spec, layout)
    lc = layout.lifecycles[0]
    hot = HotPool(geometry, config.sizes.hot_pages, config.device)
    budget = int(config.sizes.host_budget_mib * (1 << 20))
    cold = ColdTier(budget // lc.cold_page_bytes, lc.cold_page_bytes, pinned=config.on_gpu)
    disk = DiskTier(config.disk, family, lc.cold_page_bytes) if config.disk else None
    codec, where = open_codec(config, spec_path, family, layout, hot.pools)
    try:
        codec_bytes = codec.cold_page_bytes(0)
        if codec_bytes != lc.cold_page_bytes:
            raise DemoError(f"{family}: codec says {codec_bytes} bytes per cold page, the layout "
                            f"{lc.cold_page_bytes}")
        rng = torch.Generator().manual_seed(config.seed)
        scenario = OffloadScenario(config, geometry, layout, hot, cold, disk, codec,
                                   KVGenerator(geometry, config.seed, config.device))
        requests = make_requests(config, geometry, rng)
        scenario.run(requests, request_trace(len(requests), rng))
        transfers = measure_transfers(config, codec, hot, cold, layout, rng)
    finally:
        codec.close()
        if disk is not None:
            disk.close()
    counts = asdict(scenario.counts)
    peak = counts["peak_cold_pages"]
    counts.update(peak_cold_bytes=peak * lc.cold_page_bytes, raw_bytes_for_peak=peak * lc.hot_page_bytes,
                  timer=timer_label(config.device))
    errors = {name: stats.summary() for name, stats in scenario.errors.items() if stats.cosines}
    return CodecFamilyResult(
        family=family, attention_kind=spec.attention, layers=spec.layers, kv_heads=spec.kv_heads,
        query_heads=spec.query_heads, row_dim=spec.row_dim, tokens_per_block=spec.tokens_per_block,
        dtype=spec.dtype, layout=spec.layout, **where, bytes=page_bytes(layout, codec_bytes, budget),
        scenario={"requests": len(requests), "prompt_tokens": [r.tokens for r in requests],
                  "hot_pages": hot.pages, "cold_slots": cold.slots, "cold_memory": cold.kind,
                  "disk": str(disk.path) if disk else None,
                  "disk_bytes_written": disk.bytes_written if disk else 0,
                  "disk_bytes_read": disk.bytes_read if disk else 0,
                  "disk_seconds": disk.seconds if disk else 0.0, **counts},
        checks=scenario.checks,
        attention={"queries": f"gaussian, {config.sizes.queries_per_head} per query head, RoPE at the next "
                              f"position; {spec.query_heads} query heads over {spec.kv_heads} KV head(s)",
                   "k_only_v_only": "error with only K (only V) restored, the other original",
                   "softmax_scale": geometry.softmax_scale, **errors,
                   "buffer_rel_l2": {name: stats.summary()["rel_l2"]
                                     for name, stats in scenario.buffer_errors.items()}},
        transfer=transfers)


# ----------------------------------------------------------------------------------------------
# Part 2: TriAttention eviction at several budgets
# ----------------------------------------------------------------------------------------------

class OracleScoreLibrary:
    """Stands in for ``ScoreLibrary`` on the CPU: its call signature, the oracle's ``score_keys``."""

    arch = "cpu"
    path = Path("<oracle score_keys>")

    def __init__(self, family: str, k_pools: Sequence[torch.Tensor], calibration: Any, geometry: Any):
        self.family, self.k_pools, self.calibration, self.geometry = family, k_pools, calibration, geometry

    def check_geometry(self, geometry: Any, dtype: str) -> None:
        if geometry != self.geometry:
            raise ValueError(f"oracle scorer built for {self.geometry}, asked for {geometry}")

    def score(self, k_layer_ptrs, page_stride, page_table, P, S, c, d, qr, qi, mlr, freq_scale_sq,  # noqa: ANN001
              scores, stream=None) -> None:
        P, S = P.long(), S.long()
        j = torch.arange(scores.shape[-1], device=scores.device)
        valid = j[None, :] < (S - P)[:, None]
        for index, layer in enumerate(self.geometry.scored_layers):
            rows = oracle.gather_token_rows(self.k_pools[layer], page_table, P[:, None] + j, valid, self.geometry)
            value = oracle.score_keys(rows.float(), self.calibration, layer, c, d, self.geometry, torch.float32)
            scores[index] = torch.where(valid[:, None, :], value, 0)


@dataclass(frozen=True)
class _Req:
    request_id: int
    prompt_len: int


def eviction_backends(config: DemoConfig, spec: FamilySpec, spec_path: Path, calibration_path: Path,
                      k_pools: list[torch.Tensor], v_pools: list[torch.Tensor]) -> tuple[dict, dict]:
    """Manager arguments (score library, packer, compactor) and their labels. On the GPU: the
    family's score library and library (compaction) from the registry and its generated Triton
    packer; a part that cannot load falls back to the oracle and the label says why."""
    geometry = spec_tri.tri_geometry(spec)
    omega, scale = spec_tri.calibration_defaults(spec)
    calibration = oracle.load_calibration(calibration_path, geometry, omega, scale)
    oracle_scorer = OracleScoreLibrary(spec.name, k_pools, calibration, geometry)
    if not config.on_gpu:
        labels = {"score": "oracle score_keys (cpu)", "pack": "oracle pack_moves (cpu)",
                  "compact": "oracle compact_paged (cpu)"}
        return {"score_library": oracle_scorer}, labels
    from kvgen.runtime import RuntimeRegistry
    from kvgen.runtime.score import ScoreLibrary
    from kvgen.runtime.eviction import generated_backends

    resolved = RuntimeRegistry.default([config.registry], environ=os.environ).resolve(spec.name, config.arch,
                                                                                       spec_path)
    kwargs: dict[str, Any] = {}
    labels = {}
    try:
        kwargs["score_library"] = ScoreLibrary(resolved.artifact("score"), family=spec.name)
        labels["score"] = f"generated CuTe DSL ({kwargs['score_library'].path})"
    except Exception as exc:  # noqa: BLE001 - recorded in the report, never silent
        kwargs["score_library"] = oracle_scorer
        labels["score"] = f"oracle score_keys (generated unavailable: {exc})"
    try:
        pack_module, compact_library = resolved.artifact("pack"), resolved.artifact("compact")
        packer, compactor = generated_backends(spec.name, k_pools, v_pools, pack_module, compact_library)
        kwargs.update(packer=packer, compactor=compactor)
        labels["pack"] = f"generated Triton ({pack_module})"
        labels["compact"] = f"generated CUDA ({compact_library})"
    except Exception as exc:  # noqa: BLE001 - recorded in the report, never silent
        labels["pack"] = f"oracle pack_moves (generated unavailable: {exc})"
        labels["compact"] = f"oracle compact_paged (generated unavailable: {exc})"
    return kwargs, labels


class LongDecode:
    """Long-decode requests in paged K/V pools, fed ``beta`` tokens per generation step.

    Every round point of TriAttention's cadence is a multiple of ``beta`` generated tokens
    (TRIATTENTION.md §5: due when ``⌊(budget + C)/β⌋ < ⌊(L − P)/β⌋``, and after a round
    ``budget + C`` is the generated count), so steps of ``beta`` tokens give exactly the rounds of
    one-token steps, with ``beta`` times fewer hook calls.
    """

    def __init__(self, spec: FamilySpec, originals: list[dict[str, torch.Tensor]], prompt: int, generated: int,
                 device: torch.device, rng: torch.Generator):
        self.geometry = spec_tri.tri_geometry(spec)
        g = self.geometry
        self.originals, self.prompt, self.generated = originals, prompt, generated
        per_request = -(-(prompt + generated) // g.tokens_per_block)
        pages = len(originals) * per_request
        shape = (pages,) + ((g.kv_heads, g.tokens_per_block, g.head_dim) if g.layout == "HND"
                            else (g.tokens_per_block, g.kv_heads, g.head_dim))
        dtype = reference.codec.HOT_TORCH_DTYPES[spec.dtype]
        self.k_pools = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(g.num_layers)]
        self.v_pools = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(g.num_layers)]
        order = torch.randperm(pages, generator=rng)       # scattered pages, as a real allocator leaves them
        self.page_table = order.reshape(len(originals), per_request).to(torch.int32).to(device)
        self.device = device

    def reset(self) -> None:
        """Empty cache: lengths 0, and each (layer, head)'s map from physical to logical tokens."""
        g = self.geometry
        for pool in self.k_pools + self.v_pools:
            pool.zero_()
        self.lengths = [0] * len(self.originals)
        self.logical = [torch.empty((g.num_layers, g.kv_heads, 0), dtype=torch.int64) for _ in self.originals]

    def append(self, request: int, first: int, count: int) -> None:
        """Write logical tokens ``[first, first + count)`` at the request's physical end."""
        g = self.geometry
        start = self.lengths[request]
        physical = torch.arange(start, start + count)
        pages = self.page_table[request].cpu().long()[physical // g.tokens_per_block].to(self.device)
        slots = (physical % g.tokens_per_block).to(self.device)
        for layer in range(g.num_layers):
            for pool, name in ((self.k_pools[layer], "k"), (self.v_pools[layer], "v")):
                rows = self.originals[request][name][layer][:, first:first + count].transpose(0, 1)  # [n, Hkv, D]
                if g.layout == "HND":
                    pool[pages, :, slots, :] = rows
                else:
                    pool[pages, slots] = rows
        span = torch.arange(first, first + count).expand(g.num_layers, g.kv_heads, count)
        self.logical[request] = torch.cat([self.logical[request], span], dim=2)
        self.lengths[request] += count

    def apply_round(self, request: int, kept: torch.Tensor, mode: str) -> None:
        """Follow a round in the physical->logical map: prompt, then the kept tokens of each
        (layer, head)'s decision row (``kept`` ``[R, budget]`` absolute physical positions)."""
        g = self.geometry
        rows = torch.tensor([oracle.decision_rows(mode, layer, g) for layer in range(g.num_layers)])
        picks = kept.cpu()[rows]                                    # [layers, Hkv, budget]
        current = self.logical[request]
        self.logical[request] = torch.cat([current[:, :, :self.prompt], current.gather(2, picks)], dim=2)

    def cached_rows(self, request: int, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V rows ``[Hkv, length, D]`` physically in the cache (what decode attention reads)."""
        g = self.geometry
        length = self.lengths[request]
        positions = torch.arange(length, device=self.device)[None, :]
        valid = torch.ones_like(positions, dtype=torch.bool)
        table = self.page_table[request:request + 1]
        k = oracle.gather_token_rows(self.k_pools[layer], table, positions, valid, g)[0]
        v = oracle.gather_token_rows(self.v_pools[layer], table, positions, valid, g)[0]
        return k, v


@dataclass
class BudgetResult:
    """TriAttention at one budget: rounds, their time, and attention over the kept tokens."""

    budget: int
    rounds: int
    round_ms_median: float | None
    round_ms_total: float
    kept_tokens_mean: float            # physical length per request at the end (prompt + kept + since)
    rel_l2: float | None               # attention over the kept tokens vs over every token
    cos_mean: float | None
    cos_min: float | None
    vectors: int
    recent_window_rel_l2: float | None  # the same for prompt + the latest tokens, as many
    kept_rows_equal_original: bool     # the cache holds exactly the original rows of the kept tokens


@dataclass
class EvictionResult:
    family: str
    backend: dict[str, str]            # score / pack / compact: generated (path) or oracle (why)
    requests: int
    prompt: int
    generated: int
    beta: int
    mode: str
    timer: str
    queries: str
    budgets: list[BudgetResult]


def run_eviction(config: DemoConfig) -> EvictionResult:
    sizes = config.sizes
    spec_path, spec = load_family(config, EVICTION_FAMILY)
    layout = family_layout(spec)
    geometry = CacheGeometry.from_spec(spec, layout)
    tri = spec_tri.tri_geometry(spec)
    prompt, generated = sizes.long_prompt, sizes.long_generated
    total = prompt + generated
    generator = KVGenerator(geometry, config.seed + 1, config.device)
    originals = [generator.tokens(1000 + b, total) for b in range(sizes.long_requests)]
    rng = torch.Generator().manual_seed(config.seed + 2)
    cache = LongDecode(spec, originals, prompt, generated, config.device, rng)
    calibration_seed = config.seed + 3
    queries = calibrated_queries(spec, calibration_seed, sizes.queries_per_head, total, config.device)
    with tempfile.TemporaryDirectory(prefix="kvgen-demo-") as tmp:
        calibration_path = Path(tmp) / "calibration.pt"
        calibration = oracle.synthetic_calibration(tri, calibration_seed, CALIBRATION_QUERIES, CALIBRATION_SPREAD,
                                            theta=spec.rope.theta, scaling=spec_tri.rope_scaling(spec))
        oracle.save_calibration(calibration, calibration_path)
        backends, labels = eviction_backends(config, spec, spec_path, calibration_path, cache.k_pools, cache.v_pools)
        results = [evict_at_budget(config, spec, calibration_path, cache, backends, queries, budget)
                   for budget in sizes.budgets]
    return EvictionResult(
        family=EVICTION_FAMILY, backend=labels, requests=sizes.long_requests, prompt=prompt, generated=generated,
        beta=spec.triattention.beta, mode=spec.triattention.eviction_mode, timer=timer_label(config.device),
        queries=f"{sizes.queries_per_head} per query head from the calibrated distribution "
                f"(synthetic_queries, seed {calibration_seed}), RoPE at position {total}",
        budgets=results)


def evict_at_budget(config: DemoConfig, spec: FamilySpec, calibration_path: Path, cache: LongDecode,
                    backends: dict, queries: torch.Tensor, budget: int) -> BudgetResult:
    """Decode every request from an empty cache with TriAttention rounds at ``budget``, then
    compare attention over what the cache kept with attention over every token."""
    from kvgen.runtime.eviction import GenerationStep, TriAttentionManager

    beta = spec.triattention.beta
    manager = TriAttentionManager(spec, calibration_path, cache.k_pools, cache.v_pools, budget=budget, beta=beta,
                                  max_position=cache.prompt + cache.generated + 1, **backends)
    cache.reset()
    ids = list(range(len(cache.originals)))
    for rid in ids:
        cache.append(rid, 0, cache.prompt)
        manager.on_request_init(_Req(rid, cache.prompt))
    round_ms, rounds = [], 0
    done = 0
    while done < cache.generated:
        step = min(beta, cache.generated - done)
        for rid in ids:
            cache.append(rid, cache.prompt + done, step)
        done += step
        generation = GenerationStep(ids, cache.page_table, list(cache.lengths))
        report, ms = time_once_ms(lambda: manager.on_generation_step_end(generation), config.device)
        if report.due:
            round_ms.append(ms)
            rounds += 1
            for index, rid in enumerate(report.due):
                cache.apply_round(rid, report.kept[index], manager.mode)
        cache.lengths = list(report.lengths)
    for rid in ids:
        manager.on_request_finish(_Req(rid, cache.prompt))
    ordered = sorted(round_ms)
    return BudgetResult(budget=budget, rounds=rounds,
                        round_ms_median=ordered[len(ordered) // 2] if ordered else None,
                        round_ms_total=sum(ordered), kept_tokens_mean=sum(cache.lengths) / len(cache.lengths),
                        **kept_attention(cache, queries, spec))


def kept_attention(cache: LongDecode, queries: torch.Tensor, spec: FamilySpec) -> dict[str, Any]:
    """Attention over the cached (kept) rows vs over every token, every layer; also a check that
    the cache holds exactly the original rows of the tokens the rounds kept, and the same error for
    a recent-window baseline (prompt + the latest tokens, as many as the cache kept)."""
    scale = 1.0 / math.sqrt(spec.row_dim)
    kept, recent = ErrorStats(), ErrorStats()
    exact = True
    total = cache.prompt + cache.generated
    for rid, original in enumerate(cache.originals):
        length = cache.lengths[rid]
        window = torch.cat([torch.arange(cache.prompt), torch.arange(total - (length - cache.prompt), total)])
        window = window.to(cache.device)
        for layer in range(cache.geometry.num_layers):
            k_all, v_all = original["k"][layer], original["v"][layer]
            reference = attention(queries[layer], k_all, v_all, scale)
            k, v = cache.cached_rows(rid, layer)
            index = cache.logical[rid][layer].to(cache.device)[..., None].expand(-1, -1, k_all.shape[-1])
            exact &= bool(torch.equal(k, k_all.gather(1, index)) and torch.equal(v, v_all.gather(1, index)))
            kept.add(reference, attention(queries[layer], k, v, scale))
            recent.add(reference, attention(queries[layer], k_all[:, window], v_all[:, window], scale))
    summary = kept.summary()
    return {"rel_l2": summary["rel_l2"], "cos_mean": summary["cos_mean"], "cos_min": summary["cos_min"],
            "vectors": summary["vectors"], "recent_window_rel_l2": recent.summary()["rel_l2"],
            "kept_rows_equal_original": exact}


# ----------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------

def device_report(config: DemoConfig) -> dict[str, Any]:
    info: dict[str, Any] = {"kind": config.device.type, "torch": torch.__version__}
    if config.on_gpu:
        props = torch.cuda.get_device_properties(config.device)
        info.update(name=props.name, compute_capability=f"{props.major}.{props.minor}")
    return info


@dataclass
class DemoResult:
    """The whole report; ``dataclasses.asdict`` of it is the JSON written to ``--out``."""

    kvgen_demo: int                    # format version of this report
    backend: str                       # "generated (registry)" | "oracle (cpu)"
    timer: str                         # "cuda events" | "wall-clock (cpu)"
    device: dict[str, Any]
    config: dict[str, Any]
    codec: list[CodecFamilyResult]
    eviction: EvictionResult
    elapsed_s: float


def demo(config: DemoConfig) -> DemoResult:
    """Run both parts."""
    begin = time.perf_counter()
    torch.manual_seed(config.seed)
    codec = [run_codec_family(config, family) for family in CODEC_FAMILIES]
    eviction = run_eviction(config)
    return DemoResult(
        kvgen_demo=FORMAT_VERSION, backend=config.backend, timer=timer_label(config.device),
        device=device_report(config),
        config={"small": config.small, "seed": config.seed, "registry": str(config.registry), "arch": config.arch,
                "disk": str(config.disk) if config.disk else None, "sizes": asdict(config.sizes)},
        codec=codec, eviction=eviction, elapsed_s=time.perf_counter() - begin)


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def _table(title: str, columns: Sequence[str]) -> Any:
    from rich.table import Table

    table = Table(title=title)
    for column in columns:
        table.add_column(column)
    return table


def cold_tier_table(report: dict[str, Any]) -> Any:
    table = _table("Cold tier (one page of every layer)", (
        "family", "hot B", "cold B", "cold/hot", "pages in host budget: raw → cold", "pages offloaded",
        "onboarded", "disk spills", "dropped", "bit-exact vs oracle"))
    for fam in report["codec"]:
        b, s, c = fam["bytes"], fam["scenario"], fam["checks"]
        exact = c["cold_bytes_equal_oracle"] and c["restored_equal_oracle_decode"]
        table.add_row(fam["family"], str(b["hot_page_bytes"]), str(b["cold_page_bytes"]), _fmt(b["cold_over_hot"]),
                      f"{b['raw_pages_in_budget']} → {b['cold_pages_in_budget']} (×{b['hot_over_cold']:.3g})",
                      str(s["pages_offloaded"]), str(s["pages_onboarded"]), str(s["spilled_to_disk"]),
                      str(s["dropped"]), f"{exact} ({c['pages_checked']} pages)")
    return table


def transfer_table(report: dict[str, Any]) -> Any:
    table = _table(f"Transfers to/from the cold tier ({report['timer']})", (
        "family", "pages", "encode→host ms", "raw copy→host ms", "offload ×", "decode←host ms",
        "raw copy←host ms", "onboard ×"))
    for fam in report["codec"]:
        t = fam["transfer"] or {}
        table.add_row(fam["family"], str(t.get("pages", 0)), _fmt(t.get("encode_to_cold_ms")),
                      _fmt(t.get("raw_copy_to_host_ms")), _fmt(t.get("offload_speedup_vs_raw")),
                      _fmt(t.get("decode_from_cold_ms")), _fmt(t.get("raw_copy_from_host_ms")),
                      _fmt(t.get("onboard_speedup_vs_raw")))
    return table


def attention_table(report: dict[str, Any]) -> Any:
    table = _table("Attention over the restored K/V vs the original (codec)", (
        "family", "rel L2", "cos mean", "cos min", "K only", "V only", "elements rel L2"))
    for fam in report["codec"]:
        a = fam["attention"]
        both = a.get("both", {})
        table.add_row(fam["family"], _fmt(both.get("rel_l2")), _fmt(both.get("cos_mean"), 4),
                      _fmt(both.get("cos_min")), _fmt(a.get("k_only", {}).get("rel_l2")),
                      _fmt(a.get("v_only", {}).get("rel_l2")),
                      ", ".join(f"{k} {_fmt(v)}" for k, v in a["buffer_rel_l2"].items()))
    return table


def eviction_table(report: dict[str, Any]) -> Any:
    ev = report["eviction"]
    table = _table(f"TriAttention eviction, {ev['family']}: {ev['requests']} requests, prompt {ev['prompt']}, "
                   f"{ev['generated']} generated, β {ev['beta']} ({ev['timer']})", (
                       "budget", "cached tokens", "rounds", "round ms (median)", "rel L2", "cos mean",
                       "recent-window rel L2", "rows exact"))
    for row in ev["budgets"]:
        table.add_row(str(row["budget"]), _fmt(row["kept_tokens_mean"]), str(row["rounds"]),
                      _fmt(row["round_ms_median"]), _fmt(row["rel_l2"]), _fmt(row["cos_mean"], 4),
                      _fmt(row["recent_window_rel_l2"]), str(row["kept_rows_equal_original"]))
    return table


def print_report(report: dict[str, Any]) -> None:
    from rich.console import Console

    console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    console.print(f"kvgen demo: backend [bold]{report['backend']}[/bold], times: {report['timer']}"
                  + ("" if report["backend"] == GENERATED_BACKEND else " (oracle code, not kernel times)"))
    for table in (cold_tier_table(report), transfer_table(report), attention_table(report), eviction_table(report)):
        console.print(table)
    console.print("eviction backends: " + "; ".join(f"{k}: {v}" for k, v in report["eviction"]["backend"].items()))


def write_report(result: dict[str, Any], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")


def run(args: argparse.Namespace) -> int:
    """``kvgen demo``: run, print the tables, write the JSON; 1 with a message on a setup error
    (no GPU, no registry or library: those messages name the file and the command that fixes it)."""
    from kvgen.runtime.library import LibraryError

    try:
        config = config_from_args(args)
        report = asdict(demo(config))
    except (DemoError, RegistryError, LibraryError, SpecError) as exc:
        print(f"error: {exc}")
        return 1
    write_report(report, config.out)
    print_report(report)
    print(f"wrote {config.out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvgen.demo`` until the CLI verb is wired."""
    parser = argparse.ArgumentParser(prog="kvgen demo", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
