"""Measurement files for tuner tests: the format ``kvgen.tuning.measure`` writes, over the real
search space of a family, with a known landscape (the search is what is under test, not the GPU).

Landscape per bucket: a smooth bowl around a bucket-specific optimum, plus one candidate that is
recorded "wrong" (a failed correctness check: it must never be picked).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from kvgen.lower.plan import TUNABLES
from kvgen.spec.schema import load_spec
from kvgen.tuning.space import BUCKETS, config_id, configurations

from .conftest import SPECS_DIR

# Optuna's GridSampler costs more than linearly in the grid's size, so tests that search a whole grid
# (or write measurements for one) search this part of the codec space: rounding 0-1, min_blocks 1-2,
# decode_min_blocks -1, hot_batch 1, decode_split 1, decode_load 0, decode_pages 1, encode_store 0 (the full
# space is counted by test_space_folds_...).
GRID_SPACE = {"rounding": ((0, 1), 1), "min_blocks": ((1, 2), 1), "decode_min_blocks": ((-1,), -1),
              "hot_batch": ((1,), 1), "decode_split": ((1,), 1), "decode_load": ((0,), 0), "decode_pages": ((1,), 1),
              "encode_store": ((0,), 0)}


def use_grid_space(setitem=None) -> None:
    """Shrink ``TUNABLES["codec"]`` to GRID_SPACE: through ``setitem`` (pytest's
    ``monkeypatch.setitem``, undone after the test), or for the rest of this process."""
    for name, choices in GRID_SPACE.items():
        (setitem or dict.__setitem__)(TUNABLES["codec"], name, choices)

OPTIMUM = {"small": {"threads": 128, "in_flight": 2, "rounding": 1, "decode_route": 1, "min_blocks": 1, "decode_min_blocks": -1,
                     "hot_batch": 1, "decode_split": 1, "decode_load": 0, "decode_pages": 1, "encode_store": 0},
           "large": {"threads": 512, "in_flight": 4, "rounding": 1, "decode_route": 1, "min_blocks": 1, "decode_min_blocks": -1,
                     "hot_batch": 1, "decode_split": 1, "decode_load": 0, "decode_pages": 1, "encode_store": 0},
           "offload": {"threads": 512, "in_flight": 8, "rounding": 0, "decode_route": 0, "min_blocks": 2, "decode_min_blocks": -1,
                       "hot_batch": 1, "decode_split": 1, "decode_load": 0, "decode_pages": 1, "encode_store": 0}}
WRONG = {"threads": 64, "in_flight": 1, "rounding": 1, "decode_route": 1, "min_blocks": 1, "decode_min_blocks": -1,
         "hot_batch": 1, "decode_split": 1, "decode_load": 0, "decode_pages": 1, "encode_store": 0}
ENV = {"gpu": "NVIDIA H200", "compute_capability": "9.0", "driver": "570.00", "kvgen": "0.1.0",
       "toolchain": {"nvcc": "13.0.88", "kvgen": "0.1.0"}}


def bowl(params: dict[str, int], bucket: str) -> float:
    best = OPTIMUM[bucket]
    return 1.0 + 0.3 * abs(math.log2(params["threads"] / best["threads"])) \
        + 0.1 * abs(math.log2(params["in_flight"] / best["in_flight"])) \
        + 0.05 * (params["rounding"] != best["rounding"]) \
        + 0.04 * (params["decode_route"] != best["decode_route"]) \
        + 0.03 * abs(params["min_blocks"] - best["min_blocks"]) \
        + 0.02 * abs(math.log2(params["hot_batch"] / best["hot_batch"])) \
        + 0.02 * (params["decode_split"] != best["decode_split"])


def write_codec_measurements(path: Path, family: str = "qwen3-8b", arch: str = "sm_90a",
                             fixed: dict[str, int] | None = None) -> Path:
    """Every configuration of the space (or of the ``fixed`` subspace, as ``--fix`` builds it)."""
    spec = load_spec(SPECS_DIR / f"{family}.yaml")
    lines = []
    for params in configurations("codec", spec, fixed):
        for b in BUCKETS["codec"]:
            row = {"family": family, "op": "codec", "arch": arch, "config": config_id("codec", params),
                   "params": params, "bucket": b.name, "environment": ENV}
            if params == WRONG:
                row.update(status="wrong", failure="encoded layer 3 differs from the oracle")
            else:
                row.update(status="ok", median_ms=bowl(params, b.name), p20_ms=0.0, p80_ms=0.0, reps=20)
            lines.append(json.dumps(row))
    path.write_text("\n".join(lines) + "\n")
    return path
