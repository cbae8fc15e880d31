"""What every workload shares: the failure kinds, the checked first launch, the timed call."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


@dataclass(frozen=True)
class Failure(Exception):
    """A candidate's failure, recorded as a value: ``kind`` is "load", "launch" or "wrong" here
    (the tuner adds "build", "crash", "timeout")."""

    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.detail}"


@dataclass
class Inputs:
    """Device inputs for one problem size: ``sets`` (one per rotation copy) and the size recorded."""

    sets: list[Any]
    size: dict[str, Any] = field(default_factory=dict)


class Workload(Protocol):
    op: str

    def load(self, path: Path) -> Any: ...

    def inputs(self, size: dict[str, Any], seed: int) -> Inputs: ...

    def check(self, library: Any, seed: int) -> None: ...

    def time(self, library: Any, inputs: Inputs, reps: int) -> dict[str, float]: ...


def launch(fn: Callable[[], Any]) -> None:
    """Run once and synchronize: a failed launch is a "launch" failure (sticky errors kill the process)."""
    from kvgen.measure.timing import synchronize

    try:
        fn()
        synchronize()
    except Failure:
        raise
    except Exception as exc:  # noqa: BLE001 - LibraryError, ValueError, RuntimeError from the call
        raise Failure("launch", f"{type(exc).__name__}: {exc}") from None


def timed(calls: Sequence[Callable[[], Any]], reps: int) -> dict[str, float]:
    """The first call checked by ``launch``, then median and quantiles (ms) of ``reps`` CUDA-event
    timed calls rotating over ``calls`` (samples dropped: what a measurement line records)."""
    from kvgen.measure.timing import summary, time_calls

    launch(calls[0])
    return summary(time_calls(calls, reps))


def loading(make: Callable[[], Any], errors: tuple[type[BaseException], ...] = (Exception,)) -> Any:
    """``make()``; ``errors`` raised loading or configuring a library are a "load" failure."""
    try:
        return make()
    except errors as exc:
        raise Failure("load", str(exc)) from None
