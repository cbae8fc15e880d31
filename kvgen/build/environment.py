"""The environment tuned configurations are checked against: what each arch will be compiled with
(kvgen version, nvcc release, CuTe DSL version) and the build machine's GPU, if it has one.

``kvgen.lower.tuned.load_tuned`` uses a tuned file only where its recorded environment matches
this one; the build assembles it here so that every caller of ``build()`` applies the same files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

from kvgen import __version__, paths
from kvgen.build.cute_aot import CuteToolchain
from kvgen.build.nvcc import Toolchain, ToolchainError, toolchain_for
from kvgen.lower.tuned import BuildEnvironment

DSL_DISTRIBUTION = "nvidia-cutlass-dsl"


def gpu_name() -> str | None:
    """The build machine's GPU, if it has one (a tuned config from another GPU is then not used)."""
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - no usable torch/CUDA: no GPU to compare with
        return None


def gpu_fingerprint(environ: Mapping[str, str] | None = None) -> list[str]:
    """What decides ``gpu_name()``, read without importing torch (the no-op stamps' key): the GPUs
    the NVIDIA driver lists and ``$CUDA_VISIBLE_DEVICES``. A torch install or upgrade shows in the
    site-packages state the stamps record."""
    listed = sorted(Path("/proc/driver/nvidia/gpus").glob("*/information"))
    return [f"visible={paths.cuda_visible_devices(environ)}"] + [_read_text(p) for p in listed]


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return f"{path}: unreadable"


def build_environments(archs: Sequence[str], toolchains: Sequence[Toolchain], cute: CuteToolchain | None,
                       gpu: str | None) -> Mapping[str, BuildEnvironment]:
    """arch -> the environment its artifacts are built in. A compiler that is not there is left
    out (its ops' tuned files are then not checked against a version)."""
    dsl = dict(cute.dsl_versions).get(DSL_DISTRIBUTION) if cute is not None else None
    envs = {}
    for arch in archs:
        versions = {"cutlass_dsl": dsl} if dsl else {}
        try:
            versions["nvcc"] = toolchain_for(arch, toolchains).version
        except ToolchainError:
            pass
        envs[arch] = BuildEnvironment(__version__, versions, gpu)
    return envs
