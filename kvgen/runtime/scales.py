"""Per-layer second-level scales: the scales file a family with ``cold_page.scales.<buffer>: per_layer``
is configured with (docs/specs.md, "Per-layer scales").

A scales file maps names to 1-D floating tensors with one value per layer of the family:

- ``<buffer>.G``: the encode multiplier of that buffer in each layer (required);
- ``<buffer>.Q``: the decode multiplier (optional; default ``1/G``),

for every per-layer buffer and nothing else. It is a ``.safetensors`` file (read with the
``safetensors`` package) or a torch file loaded with ``weights_only=True`` (a dict of tensors).
Values are rounded to binary32, as the kernels use them, and must be finite and in 2^-64..2^64 (the
spec's range for G and Q). Any problem is a ``ScalesFileError`` naming the file and what is wrong.

This module reads only a layout (the manifest's ``RegistryLayout`` or the build side's
``FamilyLayout``): the runtime needs neither the spec nor pydantic to configure a codec.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# The spec's range for G and Q (kvgen.spec.schema MIN_SCALE, MAX_SCALE): G, Q and 1/G stay normal.
MIN_SCALE, MAX_SCALE = 2.0 ** -64, 2.0 ** 64
MULTIPLIERS = ("G", "Q")


class ScalesFileError(ValueError):
    """A scales file that cannot configure the family; the message names the file."""


@dataclass(frozen=True)
class LayerScales:
    """(G, Q) of every per-layer buffer in every layer, binary32 values as Python floats.

    ``values[layer][j]`` is the pair of ``buffers[j]`` (per-layer buffers in descriptor order)."""

    family: str
    buffers: tuple[str, ...]
    values: tuple[tuple[tuple[float, float], ...], ...]
    source: str = ""

    def of_layer(self, layer: int) -> dict[str, tuple[float, float]]:
        """One layer's pairs by buffer name (what ``kvgen.reference.codec`` takes per layer)."""
        return dict(zip(self.buffers, self.values[layer]))

    def per_layer(self) -> list[dict[str, tuple[float, float]]]:
        """Every layer's pairs, indexed by family layer (``encode_page(..., scales=)``)."""
        return [self.of_layer(layer) for layer in range(len(self.values))]

    def flat(self) -> tuple[list[float], list[float]]:
        """G and Q layer-major, ``[layer * k + j]``: the order of ``kvgen_codec_set_layer_scales``."""
        pairs = [pair for layer in self.values for pair in layer]
        return [g for g, _ in pairs], [q for _, q in pairs]


def _field(item: Any, name: str) -> Any:
    return item[name] if isinstance(item, Mapping) else getattr(item, name)


def per_layer_buffers(layout: Any) -> tuple[str, ...]:
    """Names of the quantized buffers whose scales are per layer (their G is null in the layout)."""
    record = getattr(layout, "record", layout)
    return tuple(_field(b, "name") for b in record.buffers if _field(b, "G") is None)


def num_layers(layout: Any) -> int:
    return 1 + max(layer for lc in layout.lifecycles for layer in lc.layers)


def _read(path: Path) -> Mapping[str, Any]:
    if not path.is_file():
        raise ScalesFileError(f"{path}: no such scales file")
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise ScalesFileError(f"{path}: reading .safetensors needs the safetensors package "
                                  "(pip install safetensors), or save the scales with torch.save") from None
        try:
            return load_file(str(path))
        except Exception as exc:  # the package raises its own error types for a corrupt file
            raise ScalesFileError(f"{path}: not a readable safetensors file: {exc}") from None
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle, zip and weights-only refusals all land here
        raise ScalesFileError(f"{path}: not a readable torch file of tensors (loaded with weights_only=True): "
                              f"{exc}") from None
    if not isinstance(data, Mapping):
        raise ScalesFileError(f"{path}: expected a mapping of names to tensors, got {type(data).__name__}")
    return data


def _values(path: Path, key: str, value: Any, layers: int, family: str) -> list[float]:
    """One tensor as binary32 floats, checked: shape [layers], floating, finite, in range."""
    if not isinstance(value, torch.Tensor):
        raise ScalesFileError(f"{path}: {key} is a {type(value).__name__}, expected a tensor")
    if not value.dtype.is_floating_point:
        raise ScalesFileError(f"{path}: {key} has dtype {value.dtype}, expected a floating tensor")
    if tuple(value.shape) != (layers,):
        raise ScalesFileError(f"{path}: {key} has shape {list(value.shape)}, expected [{layers}] "
                              f"(one value per layer of {family})")
    values = value.detach().to(torch.float32).tolist()
    for layer, v in enumerate(values):
        if not (math.isfinite(v) and MIN_SCALE <= v <= MAX_SCALE):
            raise ScalesFileError(f"{path}: {key}[{layer}] = {v!r}: scales must be finite and in 2^-64..2^64 "
                                  "(positive)")
    return values


def load_layer_scales(path: str | Path, layout: Any) -> LayerScales:
    """Read and check a scales file against a family's layout (a ``RegistryLayout`` or ``FamilyLayout``)."""
    path = Path(path)
    family = _field(layout, "family")
    buffers = per_layer_buffers(layout)
    if not buffers:
        raise ScalesFileError(f"{path}: family {family} has no per-layer scales (its G and Q are compiled in: "
                              "cold_page.scales); it takes no scales file")
    data = _read(path)
    accepted = [f"{b}.{m}" for b in buffers for m in MULTIPLIERS]
    unknown = sorted(set(data) - set(accepted))
    if unknown:
        raise ScalesFileError(f"{path}: unknown key {unknown[0]!r} for family {family}; accepted: "
                              f"{', '.join(accepted)} (Q optional, default 1/G)")
    layers = num_layers(layout)
    columns = []
    for buffer in buffers:
        if f"{buffer}.G" not in data:
            raise ScalesFileError(f"{path}: missing {buffer}.G (one encode multiplier per layer for buffer "
                                  f"{buffer!r} of {family})")
        G = _values(path, f"{buffer}.G", data[f"{buffer}.G"], layers, family)
        if f"{buffer}.Q" in data:
            Q = _values(path, f"{buffer}.Q", data[f"{buffer}.Q"], layers, family)
        else:
            # fl32(1/G), correctly rounded, as the C ABI does for a null Q (in range: the range is symmetric)
            Q = (1.0 / torch.tensor(G, dtype=torch.float32)).tolist()
        columns.append(list(zip(G, Q)))
    values = tuple(tuple(column[layer] for column in columns) for layer in range(layers))
    return LayerScales(family=family, buffers=buffers, values=values, source=str(path))

