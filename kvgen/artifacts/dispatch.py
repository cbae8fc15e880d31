"""Size-dispatched variants: which of an op's artifacts serves a call of a given size.

One configuration does not win at every problem size: fp8 scoring at batch 1 wants 16 tiles per
CTA, at batch 32 of 16384 tokens 64 (1.08x faster there, 2x slower at batch 1); gpt-oss-20b's
compaction at batch 32 wants 64-move tiles where batch 1 wants 128 (1.22x); qwen3-8b's selection
at batch 32 wants 256-column aggregation items of 2 warps where batch 1 wants 64 of 8 (1.09x). So
an op may ship one library per size range. ``kvgen.tuning.space.dispatch_variants`` decides the
ranges from the tuner's per-bucket measurements; the manifest lists each variant with
``from_work``; the runtime measures every call's work in the op's unit and takes the last variant
whose ``from_work`` it reaches (``serving``), else the op's main artifact.

Plain arithmetic, shared by the tuner (which writes the thresholds) and the runtime (which measures
each call), so both count work the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

# An op's main file and its size-dispatched variants as (from_work, file), ascending
# (``kvgen.runtime.lookup.Resolved.dispatch``).
DispatchFiles = tuple[Path, list[tuple[int, Path]]]


def score_work(batch: int, width: int) -> int:
    """A score call's work: it reads each of ``batch`` requests' ``width`` tokens once per layer."""
    return int(batch) * int(width)


def select_work(batch: int, width: int) -> int:
    """A selection call's work: every scored row (layers x query heads, fixed by the family) of
    ``batch`` requests is read over ``width`` columns by the statistics and the aggregation."""
    return int(batch) * int(width)


def compact_work(max_requests: int) -> int:
    """A compaction call's work: its grid holds every (request slot, KV head, layer), and each CTA's
    moves do not depend on the batch, so the request slots set the launch's shape."""
    return int(max_requests)


def bucket_work(op: str, size: Mapping[str, int | str]) -> int:
    """The work of a tuning bucket's problem (``kvgen.tuning.space.BUCKETS``)."""
    if op == "score":
        return score_work(int(size["batch"]), int(size["width"]))
    if op == "compact":
        return compact_work(int(size["batch"]))
    if op == "select":
        return select_work(int(size["batch"]), int(size["width"]))
    raise ValueError(f"{op}: no unit of work: it takes one configuration for every size")


def serving(from_work: Sequence[int], work: int) -> int | None:
    """Index of the variant serving a call of ``work`` (thresholds ascending), None for the main
    artifact."""
    chosen = None
    for i, start in enumerate(from_work):
        if work >= start:
            chosen = i
    return chosen


def dispatch_rows(main: object, variants: Sequence[tuple[int, object]]) -> list[dict[str, object]]:
    """Which file serves which calls, for a report: the main one from 0, then each variant's."""
    return [{"from_work": 0, "library": str(main)}] + [{"from_work": start, "library": str(file)}
                                                       for start, file in variants]
