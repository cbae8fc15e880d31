"""One workload per op -- inputs for a size, the oracle check, the timed call -- shared by the
benchmarks (``kvgen bench``) and the tuner's measurement worker (``kvgen.tuning.measure``).

A workload is built from what the tools lowered (a ``FamilyLayout`` for the codec, a
``TriGeometry`` and dtype for compaction and scoring, the ``TriGeometry`` for selection) and drives an artifact given by path:

- ``load(path)``: the runtime library (``Failure("load")`` when it cannot be used);
- ``inputs(size, seed)``: device inputs for one problem size, in enough copies that the timed
  calls touch at least 3x the L2 (``kvgen.measure.timing.rotation_sets``); ``inputs.size`` is the
  problem size they really have (recorded with each measurement);
- ``check(library, seed)``: the artifact against the oracle on small fresh inputs
  (``Failure("wrong")`` on a difference, ``Failure("launch")`` when a call fails);
- ``time(library, inputs, reps)``: median and quantiles (ms) of the timed call.
"""

from __future__ import annotations

from kvgen.measure.workloads.base import Failure, Workload, launch

__all__ = ["Failure", "Workload", "launch", "workload_class"]


def workload_class(op: str) -> type:
    """The workload class of ``op`` (its module imports torch and the runtime)."""
    if op == "codec":
        from kvgen.measure.workloads.codec import CodecWorkload

        return CodecWorkload
    if op == "compact":
        from kvgen.measure.workloads.compact import CompactWorkload

        return CompactWorkload
    if op == "score":
        from kvgen.measure.workloads.score import ScoreWorkload

        return ScoreWorkload
    if op == "select":
        from kvgen.measure.workloads.select import SelectWorkload

        return SelectWorkload
    raise ValueError(f"op: expected codec, compact, score or select, got {op!r}")
