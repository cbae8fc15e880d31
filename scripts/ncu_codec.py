"""One encode and one decode of a family's registry codec on ~256 MiB of hot pages in device memory,
for Nsight Compute to profile (scripts/device_check.sh ncu):

    ncu --clock-control none -k regex:"encode_kernel|decode_kernel" -c 2 --section SpeedOfLight \
        --section ComputeWorkloadAnalysis --section Occupancy python3 scripts/ncu_codec.py qwen3-8b
"""

from __future__ import annotations

import sys

import torch

from kvgen import paths
from kvgen.lower.layout import family_layout
from kvgen.measure.workloads.codec import CodecWorkload
from kvgen.runtime import RuntimeRegistry, codec_from_registry
from kvgen.spec.schema import load_spec


def main(family: str, hot_mib: int = 256) -> None:
    spec = load_spec(paths.spec_path(family))
    layout = family_layout(spec)
    lc = layout.lifecycles[0]
    pages = max(1, hot_mib * (1 << 20) // lc.hot_page_bytes)
    pools = CodecWorkload(layout, spec.dtype).pools(pages, torch.Generator(device="cuda").manual_seed(0))
    codec = codec_from_registry(RuntimeRegistry([paths.registry_dir()]), family, pools, arch="sm_90a")
    cold = torch.empty(pages, lc.cold_page_bytes, dtype=torch.uint8, device="cuda")
    slots = torch.arange(pages, dtype=torch.int32)
    pairs = torch.stack([slots, slots[torch.randperm(pages)]], dim=1).contiguous()   # scattered sources
    codec.encode(cold, pairs)
    codec.decode(cold, pairs.flip(1).contiguous())
    torch.cuda.synchronize()
    codec.close()


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "qwen3-8b")
