"""A static performance model of compiled candidates, for targets no GPU of which can be run here.

``features`` (resources and SASS instruction mix per pipe, read from a cubin) -> ``workload`` (what
one measured call launches per op) -> ``model`` (time = memory, issue and latency terms over a
``targets`` table per arch) -> ``predict`` (one candidate, one size bucket); ``validate`` ranks the
model against recorded H200 measurements, ``tune`` writes model-tuned entries (``kvgen tune
--model``) only for ops whose validation passed. See docs/tuning.md, "Static cost model".
"""
