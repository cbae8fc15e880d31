"""CUDA arch names: the one place that parses them (the spec, the build, the wheels and the
runtime's lookup all ask here).

kvgen's targets are arch-specific (``sm_90a``: Hopper; ``sm_100a``/``sm_103a``: Blackwell;
``sm_107a``: Rubin) or a Blackwell-and-later family build (``sm_100f`` runs on every 10.x).
"""

from __future__ import annotations

import re

# Every target a spec may name and the build can compile (nvcc, CuTe DSL and Triton all take them).
ARCHS = ("sm_90a", "sm_100a", "sm_100f", "sm_103a", "sm_107a")
# What a spec targets when it says nothing.
DEFAULT_TARGETS = ("sm_90a", "sm_100a", "sm_103a", "sm_107a")

_ARCH = re.compile(r"^sm_(\d{2,3})([af]?)$")


def parse_arch(arch: str) -> tuple[int, int, str]:
    """``sm_103a`` -> (10, 3, "a"): major, minor, variant ("a" arch-specific, "f" family, "")."""
    match = _ARCH.match(arch)
    if not match:
        raise ValueError(f"{arch!r} is not a CUDA arch (accepted: {', '.join(ARCHS)}, ...)")
    number = int(match.group(1))
    return number // 10, number % 10, match.group(2)


def arch_for_capability(major: int, minor: int) -> str:
    """The arch-specific target of a device: compute capability 9.0 -> ``sm_90a``."""
    return f"sm_{major}{minor}a"


def family_target(arch: str) -> str | None:
    """The family build that also runs on ``arch`` (``sm_100f`` for every 10.x), or None.

    CUDA family targets exist from Blackwell on; Hopper has only ``sm_90a``.
    """
    major, _, _ = parse_arch(arch)
    return f"sm_{major}0f" if major >= 10 else None


def arch_family(arch: str) -> str:
    """Which wheel holds an arch: ``sm_90a`` -> ``sm90``; ``sm_100a/100f/103a/107a`` -> ``sm100``."""
    major, _, _ = parse_arch(arch)
    return f"sm{major}0"
