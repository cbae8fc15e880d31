"""What the AOT build compiles of a Triton kernel module: its ``Specialization``s.

Each Triton kernel module (``select.py``, ``pack.py``) lists, per family, every kernel its JIT
launches compile, with the same run-time signature, constants and options
(``aot_specializations``); ``kvgen.build.triton_aot`` compiles exactly those for the target and
links them behind the module's C shim.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Specialization:
    """One kernel as compiled: ``name`` in the AOT library (its shim's kernel table), the Triton
    kernel, its run-time signature (Triton's type strings), compile-time constants and options."""

    name: str
    kernel: Any
    signature: dict[str, str]
    constants: dict[str, int | float]
    options: dict[str, Any] = field(default_factory=dict)

    def triton_signature(self) -> dict[str, str]:
        """The signature ``triton.compile`` takes: the constants as ``constexpr``."""
        return {**self.signature, **{name: "constexpr" for name in self.constants}}
