"""How kernel wheels are named and found: what the wheel writer produces and the runtime's
lookup searches for (an installed wheel declares an entry point in ``ENTRY_POINT_GROUP``).
"""

from __future__ import annotations

from kvgen import __version__
from kvgen.arch import arch_family

ENTRY_POINT_GROUP = "kvgen.registries"
PACKAGE_PREFIX = "kvgen_kernels_"


def package_name(arch: str) -> str:
    return PACKAGE_PREFIX + arch_family(arch)


def distribution_name(arch: str) -> str:
    return package_name(arch).replace("_", "-")


def pip_fix(arch: str, version: str = __version__) -> str:
    return f"pip install {distribution_name(arch)}=={version}"
