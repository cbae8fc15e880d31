"""Codec backends behind one interface: the generated codec from the registry, or the oracle."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from kvgen import paths
from kvgen.demo.config import GENERATED_BACKEND, ORACLE_BACKEND, DemoConfig
from kvgen.lower.layout import FamilyLayout
from kvgen.reference import codec as oracle_codec
from kvgen.runtime.lookup import RuntimeRegistry, installed_sources


def oracle_encode_pages(layout: FamilyLayout, pages: Sequence[Sequence[torch.Tensor]]) -> torch.Tensor:
    """Cold pages ``uint8 [n, cold_page_bytes]`` of lifecycle 0 (COLD_PAGE_FORMAT.md §2): the
    records of every layer, ascending. ``pages[layer][buffer]`` is ``[n, *page]``."""
    record = layout.record
    records = [oracle_codec.encode_records(record, {b.name: pages[layer][i] for i, b in enumerate(record.buffers)}, {})
               for layer in layout.lifecycles[0].layers]
    return torch.cat(records, dim=1)


def oracle_decode_pages(layout: FamilyLayout, cold: torch.Tensor, dtype: str,
                        page_shape: tuple[int, ...]) -> list[list[torch.Tensor]]:
    """Hot pages ``[layer][buffer] -> [n, *page]`` of cold pages ``uint8 [n, cold_page_bytes]``."""
    record_bytes = layout.record.bytes
    out = []
    for j, _ in enumerate(layout.lifecycles[0].layers):
        buffers, _ = oracle_codec.decode_records(layout.record, cold[:, j * record_bytes:(j + 1) * record_bytes], dtype)
        out.append([buffers[b.name].reshape((cold.shape[0],) + page_shape) for b in layout.record.buffers])
    return out


class OracleCodec:
    """``ColdPageCodec``'s interface (``encode``/``decode`` with ``(dst, src)`` pairs,
    ``cold_page_bytes``) over the oracle: the CPU stand-in for the generated codec."""

    def __init__(self, layout: FamilyLayout, pools: Sequence[Sequence[torch.Tensor]], dtype: str):
        self.layout, self.pools, self.dtype = layout, pools, dtype

    def cold_page_bytes(self, lifecycle: int = 0) -> int:
        return self.layout.lifecycles[lifecycle].cold_page_bytes

    def encode(self, cold: torch.Tensor, pairs: torch.Tensor, lifecycle: int = 0) -> None:
        dst, src = pairs[:, 0].long(), pairs[:, 1].long()
        pages = [[pool[src] for pool in layer] for layer in self.pools]
        cold[dst] = oracle_encode_pages(self.layout, pages).to(cold.device)

    def decode(self, cold: torch.Tensor, pairs: torch.Tensor, lifecycle: int = 0) -> None:
        dst, src = pairs[:, 0].long(), pairs[:, 1].long()
        page_shape = tuple(self.pools[0][0].shape[1:])
        decoded = oracle_decode_pages(self.layout, cold[src], self.dtype, page_shape)
        for layer, buffers in zip(self.pools, decoded):
            for pool, pages in zip(layer, buffers):
                pool[dst.to(pool.device)] = pages.to(pool.device)

    def close(self) -> None:
        """Nothing to release (the generated codec frees its device tables here)."""


def runtime_registry(config: DemoConfig) -> RuntimeRegistry:
    """``--registry``, then ``$KVGEN_REGISTRY``, then installed kernel wheels (``kvgen.paths``)."""
    return RuntimeRegistry([*paths.registry_search_path([config.registry]), *installed_sources()])


def open_codec(config: DemoConfig, spec_path: Path, family: str, layout: FamilyLayout,
               pools: Sequence[Sequence[torch.Tensor]]) -> tuple[Any, dict[str, Any]]:
    """The codec of ``family`` over ``pools`` and what it is: on the GPU the generated one from the
    registry (sha256-verified, refused if the spec changed since the build), else the oracle."""
    if not config.on_gpu:
        codec = OracleCodec(layout, pools, family_dtype(layout, pools))
        return codec, {"backend": ORACLE_BACKEND, "library": None, "arch": None}
    from kvgen.runtime import codec_from_registry

    registry = runtime_registry(config)
    resolved = registry.resolve(family, config.arch, spec_path)
    codec = codec_from_registry(registry, family, pools, arch=config.arch, index_location="host",
                                spec_path=spec_path)
    return codec, {"backend": GENERATED_BACKEND, "library": str(resolved.artifact("codec")), "arch": resolved.arch}


def family_dtype(layout: FamilyLayout, pools: Sequence[Sequence[torch.Tensor]]) -> str:
    dtype = pools[0][0].dtype
    return next(name for name, torch_dtype in oracle_codec.HOT_TORCH_DTYPES.items() if torch_dtype == dtype)


def pairs_tensor(dst: Sequence[int], src: Sequence[int]) -> torch.Tensor:
    """Host ``int32 [n, 2]`` page pairs ``(dst, src)``, the codec ABI's index array."""
    return torch.tensor(list(zip(dst, src)), dtype=torch.int32).reshape(-1, 2)
