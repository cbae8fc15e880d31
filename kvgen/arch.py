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


class ArchError(ValueError):
    """An arch string kvgen does not build for; the message names the accepted spellings."""


# The spellings the ecosystem uses for one target: kvgen's own (``sm_90a``), nvcc's bare number
# (``90a``) and PyTorch's / FlashInfer's compute capability (``9.0a``, as in TORCH_CUDA_ARCH_LIST).
_SPELLINGS = (re.compile(r"^sm_(\d)(\d{1,2})([af]?)$"), re.compile(r"^(\d)(\d{1,2})([af]?)$"),
              re.compile(r"^(\d{1,2})\.(\d)([af]?)$"))
_LOOSE = re.compile(r"^(?:sm_?|compute_)?(\d{1,2})\.?(\d)([af]?)(?:\+ptx)?$", re.IGNORECASE)


def canonical_arch(text: str) -> str:
    """``sm_90a``, ``90a`` or ``9.0a`` -> ``sm_90a``; anything that is not one of ``ARCHS`` is an
    ``ArchError`` that says which target was probably meant."""
    value = text.strip()
    for spelling in _SPELLINGS:
        match = spelling.match(value)
        if match and f"sm_{match.group(1)}{match.group(2)}{match.group(3)}" in ARCHS:
            return f"sm_{match.group(1)}{match.group(2)}{match.group(3)}"
    raise ArchError(f"{text!r} is not a kvgen target{_hint(value)}; accepted: {', '.join(ARCHS)} "
                    f"(also spelled 90a or 9.0a)")


def _hint(value: str) -> str:
    """' (did you mean sm_90a?)' when ``value`` names the same GPU as a target, else ''."""
    match = _LOOSE.match(value)
    if not match:
        return ""
    number = f"{match.group(1)}{match.group(2)}"
    meant = [a for a in ARCHS if a[3:-1] == number and (not match.group(3) or a.endswith(match.group(3)))]
    meant = meant or [a for a in ARCHS if a[3:-1] == number]
    return f" (did you mean {' or '.join(meant)}?)" if meant else " (kvgen does not build for that GPU)"


def parse_arch_list(text: str) -> list[str]:
    """A list in any of the separators TORCH_CUDA_ARCH_LIST and FlashInfer accept (``;``, ``,`` or
    spaces), each entry canonical, duplicates dropped in order; ``ArchError`` on the first bad one."""
    archs: list[str] = []
    for item in re.split(r"[;,\s]+", text.strip()):
        if item and (arch := canonical_arch(item)) not in archs:
            archs.append(arch)
    return archs
