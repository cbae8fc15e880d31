"""``kvgen demo`` configuration: sizes, the run's settings from its arguments, the family specs.

Imports neither torch nor the runtime (the CLI builds its parser from ``add_arguments``)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from kvgen import paths
from kvgen.spec.schema import FamilySpec, load_spec

if TYPE_CHECKING:
    import torch


FORMAT_VERSION = 1
CODEC_FAMILIES = ("qwen3-8b", "deepseek-v3")   # GQA and MLA
EVICTION_FAMILY = "qwen3-8b"
GENERATED_BACKEND = "generated (registry)"
ORACLE_BACKEND = "oracle (cpu)"
CALIBRATION_QUERIES = 256   # synthetic_calibration's default sample count; the demo's queries are from it
CALIBRATION_SPREAD = 0.3


class DemoError(RuntimeError):
    """A setup the demo cannot run (no GPU for --device cuda, a family it does not model)."""



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


def timer_label(device: torch.device) -> str:
    return "cuda events" if device.type == "cuda" else "wall-clock (cpu)"


def config_from_args(args: argparse.Namespace, environ: dict[str, str] | None = None) -> DemoConfig:
    """The run's settings; ``environ`` (default: the process environment) supplies ``$OUT`` and
    ``$KVGEN_SPECS_DIR`` when the arguments do not say."""
    import torch  # here, not at import: the CLI builds its parser from this module

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
    out = args.out or paths.results_dir(environ=environ) / "demo.json"
    specs = paths.specs_dir(getattr(args, "specs", None), environ)
    return DemoConfig(device=torch.device(device), registry=Path(args.registry), arch=args.arch,
                      specs_dir=specs, disk=args.disk,
                      seed=args.seed, out=Path(out), small=args.small, sizes=sizes)


def load_family(config: DemoConfig, family: str) -> tuple[Path, FamilySpec]:
    """The spec file and its spec, with the layer count cut for a small CPU run."""
    spec_path = config.specs_dir / f"{family}.yaml"
    spec = load_spec(spec_path)
    if config.sizes.layers is not None and config.sizes.layers < spec.layers:
        spec = spec.model_copy(update={"layers": config.sizes.layers})
    return spec_path, spec
