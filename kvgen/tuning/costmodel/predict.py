"""The model's time for one candidate of (family, op, bucket) on a target: the candidate's SASS
features and the bucket's size in, ``model.Estimate`` out. The size is the one
``kvgen.tuning.measure`` records for the bucket (codec: hot/cold bytes and pages; compact: batch and
budget; score: batch and width), or the bucket's declared size where no measurement exists."""

from __future__ import annotations

import math
from typing import Mapping

from kvgen.kernels.cute.geometry import effective_lanes, row_chunks
from kvgen.lower.layout import layer_record
from kvgen.lower.plan import compact_geometry, score_geometry
from kvgen.spec.schema import FamilySpec
from kvgen.tuning.costmodel.features import KernelFeatures
from kvgen.tuning.costmodel.model import Estimate, estimate
from kvgen.tuning.costmodel.targets import Target
from kvgen.tuning.costmodel.workload import codec_launches, compact_launches, score_launches


def codec_size(spec: FamilySpec, size: Mapping) -> dict:
    """A codec bucket's hot/cold bytes: the measured ones, or computed from ``hot_mib`` as the
    measurement sizes them (whole pages of lifecycle 0, every layer of a page)."""
    if "hot_bytes" in size:
        return dict(size)
    record = layer_record(spec)
    per_page_hot = record.hot_bytes * spec.layers
    pages = max(1, math.ceil(size["hot_mib"] * 2**20 / per_page_hot))
    return {"pages": pages, "hot_bytes": pages * per_page_hot, "cold_bytes": pages * record.bytes * spec.layers,
            "cold": size["cold"]}


def predict(spec: FamilySpec, op: str, params: Mapping[str, int], size: Mapping,
            features: Mapping[str, KernelFeatures], target: Target) -> Estimate:
    if op == "codec":
        return estimate(codec_launches(features, params, codec_size(spec, size), layer_record(spec).bytes), target)
    if op == "compact":
        g = compact_geometry(spec)
        windows = [w for w in (spec.layer_window(layer) for layer in range(spec.layers)) if w]
        budget = max(size["budget"], *windows) if windows else size["budget"]
        return estimate(compact_launches(features, params, g, size["batch"], budget), target)
    if op == "score":
        g = score_geometry(spec)
        elem = 1 if g["dtype"].startswith("fp8") else 2
        chunks = row_chunks(g["rotary_start"], g["rotary_dim"], g["pairing"], elem)
        lanes = effective_lanes(params["lanes"], chunks)
        passes = math.ceil(g["query_heads"] // g["kv_heads"] / params["max_heads"])
        return estimate(score_launches(features, params, g, size["batch"], size["width"], lanes, passes), target)
    raise ValueError(f"no cost model for op {op!r}")
