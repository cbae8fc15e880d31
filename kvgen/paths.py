"""Where kvgen finds and puts things, and every environment knob: the only module that reads
``os.environ``.

Each function takes the caller's explicit value first (a command-line argument) and an optional
``environ`` mapping (tests pass a dict; None means the process environment), so a value is resolved
once at the top and passed down as an argument -- never written back into the environment for a
child process to find.

Directories:
- project root: the current directory when it holds ``specs/`` (a checkout, or the GPU machine's
  copy of one), else the checkout this package lives in;
- specs: argument, ``$KVGEN_SPECS_DIR``, ``./specs``, the specs beside the package;
- generated, registry (``build/registry``), tuning records (``tuning/``): under the project root;
- registry search path: arguments, then ``$KVGEN_REGISTRY`` (``os.pathsep``-separated);
- cache: argument, ``$KVGEN_CACHE_DIR``, ``~/.cache/kvgen``;
- results: argument, ``$OUT`` (device runs collect it), else ``results/`` (or a dated folder in it).

Knobs: ``MAX_JOBS``, ``KVGEN_CUDA_ARCH_LIST``, ``KVGEN_TUNING``, ``KVGEN_TUNED_PARAMS``,
``KVGEN_COMMIT``, the toolchain search (``PATH``, ``KVGEN_NVCC``, ``CUDA_HOME``), ``CUTE_DSL_ARCH``,
``CUDA_VISIBLE_DEVICES`` (read, for the no-op build stamps),
and ``child_environ`` for the environment a worker process is started with.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from kvgen.arch import ArchError, parse_arch_list  # base, like this module

PACKAGE_ROOT = Path(__file__).resolve().parents[1]   # the checkout holding kvgen/

ENV_SPECS = "KVGEN_SPECS_DIR"
ENV_REGISTRY = "KVGEN_REGISTRY"
ENV_CACHE = "KVGEN_CACHE_DIR"
ENV_OUT = "OUT"
ENV_JOBS = "MAX_JOBS"
ENV_ARCHS = "KVGEN_CUDA_ARCH_LIST"
ENV_TUNING = "KVGEN_TUNING"
ENV_TUNED_PARAMS = "KVGEN_TUNED_PARAMS"
ENV_COMMIT = "KVGEN_COMMIT"
ENV_NVCC = "KVGEN_NVCC"
ENV_CUDA_HOME = "CUDA_HOME"
ENV_CUTE_DSL_ARCH = "CUTE_DSL_ARCH"
ENV_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
TUNING_OFF = ("off", "0", "no", "false")


def _env(environ: Mapping[str, str] | None) -> Mapping[str, str]:
    return os.environ if environ is None else environ


# ---------------------------------------------------------------- directories


def project_root(cwd: Path | None = None) -> Path:
    """``cwd`` (default: the current directory) when it holds ``specs/``, else the package's checkout."""
    cwd = Path.cwd() if cwd is None else Path(cwd)
    return cwd if (cwd / "specs").is_dir() else PACKAGE_ROOT


def specs_dir(explicit: Path | str | None = None, environ: Mapping[str, str] | None = None) -> Path:
    """``explicit`` (``kvgen --specs``), ``$KVGEN_SPECS_DIR``, ``./specs``, the specs beside the package."""
    if explicit is not None:
        return Path(explicit)
    env = _env(environ).get(ENV_SPECS)
    if env:
        return Path(env)
    local = Path("specs")   # relative, so messages name it as the user sees it
    return local if local.is_dir() else PACKAGE_ROOT / "specs"


def spec_path(family: str, specs: Path | str | None = None, environ: Mapping[str, str] | None = None) -> Path:
    """The spec file of ``family`` in ``specs_dir(specs, environ)``."""
    return specs_dir(specs, environ) / f"{family}.yaml"


def generated_dir(explicit: Path | str | None = None) -> Path:
    """``explicit``, else the project's ``generated/`` (the rendered sources, the Triton packers)."""
    return Path(explicit) if explicit is not None else project_root() / "generated"


def registry_dir(explicit: Path | str | None = None) -> Path:
    """``explicit``, else the project's ``build/registry`` (what ``kvgen build`` writes by default)."""
    return Path(explicit) if explicit is not None else project_root() / "build" / "registry"


def score_variant_registries() -> list[Path]:
    """The project's ``build/registry-score-*`` (registries holding score-library variants)."""
    return sorted((project_root() / "build").glob("registry-score-*"))


def tuning_dir(explicit: Path | str | None = None) -> Path:
    """``explicit``, else the project's ``tuning/`` (tuned-configuration records)."""
    return Path(explicit) if explicit is not None else project_root() / "tuning"


def registry_search_path(explicit: Iterable[Path | str] = (), environ: Mapping[str, str] | None = None) -> list[Path]:
    """Registry directories in lookup order: ``explicit``, then ``$KVGEN_REGISTRY`` (``os.pathsep``-separated).
    Installed kernel wheels come after these (``kvgen.runtime.lookup.installed_sources``)."""
    env = _env(environ).get(ENV_REGISTRY, "")
    return [Path(p) for p in explicit] + [Path(p) for p in env.split(os.pathsep) if p]


def cache_dir(explicit: Path | str | None = None, environ: Mapping[str, str] | None = None) -> Path:
    """``explicit``, ``$KVGEN_CACHE_DIR``, else ``~/.cache/kvgen`` (the build cache)."""
    if explicit is not None:
        return Path(explicit)
    env = _env(environ).get(ENV_CACHE)
    return Path(env) if env else Path.home() / ".cache" / "kvgen"


def triton_cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Triton's kernel cache for the AOT builds: ``triton/`` in the default build cache
    (``cache_dir(None, environ)``), whatever cache a build was given. Triton keys its entries by
    source, constants, options, target and its own version, so every build of the user may share
    it, and two build caches (a test's, a tune bundle's) do not compile the same kernel twice."""
    return cache_dir(None, environ) / "triton"


def results_dir(explicit: Path | str | None = None, environ: Mapping[str, str] | None = None) -> Path:
    """``explicit``, ``$OUT`` (what a device run brings back), else ``results/``."""
    if explicit is not None:
        return Path(explicit)
    env = _env(environ).get(ENV_OUT)
    return Path(env) if env else Path("results")


def run_dir(prefix: str, explicit: Path | str | None = None, environ: Mapping[str, str] | None = None,
            now: datetime.datetime | None = None) -> Path:
    """One run's own folder: ``explicit``, ``$OUT``, else ``results/<prefix>-<date>-<time>``."""
    if explicit is not None or _env(environ).get(ENV_OUT):
        return results_dir(explicit, environ)
    stamp = (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
    return Path("results") / f"{prefix}-{stamp}"


# ---------------------------------------------------------------- knobs


def max_jobs(environ: Mapping[str, str] | None = None) -> int:
    """``$MAX_JOBS`` when a positive integer, else the CPU count."""
    env = _env(environ).get(ENV_JOBS, "")
    return int(env) if env.isdigit() and int(env) > 0 else (os.cpu_count() or 1)


def cuda_arch_list(environ: Mapping[str, str] | None = None) -> list[str]:
    """``$KVGEN_CUDA_ARCH_LIST`` parsed as TORCH_CUDA_ARCH_LIST is (``;``, ``,`` or spaces; ``sm_90a``,
    ``90a`` or ``9.0a``), canonical names; empty: none given. A bad entry is an ``ArchError``
    naming the variable and the accepted values."""
    try:
        return parse_arch_list(_env(environ).get(ENV_ARCHS, ""))
    except ArchError as exc:
        raise ArchError(f"${ENV_ARCHS}: {exc}") from None


def tuning_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """False when ``$KVGEN_TUNING`` is off/0/no/false: build every op with its safe defaults."""
    return _env(environ).get(ENV_TUNING, "").lower() not in TUNING_OFF


def tuned_params_override(environ: Mapping[str, str] | None = None) -> str:
    """``$KVGEN_TUNED_PARAMS`` (``family:op:name=value,...;...``), "" when unset."""
    return _env(environ).get(ENV_TUNED_PARAMS, "")


def cuda_visible_devices(environ: Mapping[str, str] | None = None) -> str | None:
    """``$CUDA_VISIBLE_DEVICES`` as given (None when unset): which GPU a build machine's torch sees first."""
    return _env(environ).get(ENV_VISIBLE_DEVICES)


def commit(environ: Mapping[str, str] | None = None) -> str | None:
    """``$KVGEN_COMMIT`` (a device copy has no git; the caller names the commit), None when unset."""
    return _env(environ).get(ENV_COMMIT) or None


@dataclass(frozen=True)
class ToolchainSearch:
    """Where ``kvgen build`` looks for nvcc: ``$KVGEN_NVCC``, ``$CUDA_HOME``, ``$PATH``."""

    path: str
    nvcc: str | None
    cuda_home: str | None


def toolchain_search(environ: Mapping[str, str] | None = None) -> ToolchainSearch:
    env = _env(environ)
    return ToolchainSearch(path=env.get("PATH", ""), nvcc=env.get(ENV_NVCC) or None,
                           cuda_home=env.get(ENV_CUDA_HOME) or None)


def cute_dsl_arch(environ: Mapping[str, str] | None = None) -> str | None:
    """``$CUTE_DSL_ARCH``: the arch a CuTe DSL export process was started for."""
    return _env(environ).get(ENV_CUTE_DSL_ARCH)


def child_environ(environ: Mapping[str, str] | None = None, **extra: str) -> dict[str, str]:
    """The environment to start a child process with: a copy of ``environ`` (default: this
    process's) plus ``extra`` -- settings for a tool's own process (``CUTE_DSL_ARCH``,
    ``PYTHONUNBUFFERED``), never kvgen values a worker should get as arguments."""
    return {**_env(environ), **extra}
