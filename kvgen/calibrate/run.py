"""One calibration: model and spec checked, text tokenized into chunks, one forward pass per chunk
with a hook on every layer's query site, the means written in both on-disk forms.

transformers is imported only to load a model from a folder (``load_model``); an in-memory model
goes straight to ``calibrate`` or ``calibrate_text``.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from kvgen.calibrate.model import CalibrateError, check_rope, check_shape, model_label, query_sites
from kvgen.calibrate.stats import QueryStats
from kvgen.lower.triattention import calibration_defaults, rope_scaling, tri_geometry
from kvgen.reference.triattention import Calibration, save_calibration, save_upstream_calibration
from kvgen.spec.schema import FamilySpec

DEFAULT_CHUNK_TOKENS = 4096


@dataclass(frozen=True)
class CalibrationRun:
    """The statistics and what they were measured on."""

    calibration: Calibration
    family: str
    model: str
    tokens: int          # tokens seen by every layer
    chunks: int          # forward passes
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def concentration(self) -> float:
        """Mean of ``|E q| / E|q|`` over layers, heads and frequencies: 1 when every query of a
        frequency points the same way (the paper's observation), near 0 for isotropic queries."""
        calib = self.calibration
        ratio = calib.E_q.abs() / calib.E_q_norm.clamp(min=torch.finfo(torch.float32).tiny)
        return float(ratio.mean())


def _capture(stats: QueryStats, layer: int, module: torch.nn.Module, inputs: Any, output: torch.Tensor) -> None:
    stats.add(layer, output)


def _device_of(model: torch.nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


def _forward_kwargs(model: torch.nn.Module) -> dict[str, Any]:
    """No KV cache, and only the last position's logits where the model allows it (HF's
    ``logits_to_keep``): the queries are all that is read, ``[tokens, vocab]`` logits are waste."""
    kwargs: dict[str, Any] = {"use_cache": False}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        kwargs["logits_to_keep"] = 1
    return kwargs


def calibrate(model: torch.nn.Module, chunks: Iterable[torch.Tensor], spec: FamilySpec) -> CalibrationRun:
    """Statistics of ``model``'s pre-RoPE queries over ``chunks`` (1-D token-id tensors, one forward
    pass each) for family ``spec``. The model is checked against the spec first (layers, heads,
    head_dim, RoPE); ``CalibrateError`` says what disagrees."""
    geometry = tri_geometry(spec)   # GeometryError for a family TriAttention cannot serve (MLA, no RoPE)
    omega, freq_scale_sq = calibration_defaults(spec)
    check_shape(model, geometry, spec.name)
    sites = query_sites(model, geometry)
    check_rope(model, geometry, omega, freq_scale_sq, spec.name)
    device = _device_of(model)
    stats = QueryStats(geometry, device)
    handles = [site.module.register_forward_hook(partial(_capture, stats, site.layer)) for site in sites]
    passes, kwargs, training = 0, _forward_kwargs(model), model.training
    model.eval()   # dropout off: statistics of the queries the model serves with
    try:
        with torch.no_grad():
            for chunk in chunks:
                if chunk.numel() == 0:
                    raise CalibrateError(f"token chunk {passes} is empty")
                model(input_ids=chunk.reshape(1, -1).to(device), **kwargs)
                passes += 1
    finally:
        for handle in handles:
            handle.remove()
        model.train(training)
    if passes == 0:
        raise CalibrateError("no token chunks to calibrate from")
    calib = stats.calibration(omega, freq_scale_sq)
    rope_type = (rope_scaling(spec) or {}).get("type", "default")
    return CalibrationRun(calib, spec.name, model_label(model), stats.tokens[0], passes,
                          {"rope_style": geometry.pairing, "rope_type": rope_type, "head_dim": geometry.head_dim,
                           "query_site": sites[0].kind})


def token_chunks(ids: Sequence[int], chunk_tokens: int, bos: int | None = None) -> list[torch.Tensor]:
    """``ids`` cut into forward passes of at most ``chunk_tokens`` tokens; with a ``bos`` token each
    pass starts with it, like a sequence of its own."""
    if chunk_tokens < 2:
        raise CalibrateError(f"chunk_tokens (--chunk-tokens) {chunk_tokens}: expected at least 2")
    step = chunk_tokens - (bos is not None)
    chunks = []
    for start in range(0, len(ids), step):
        piece = list(ids[start:start + step])
        chunks.append(torch.tensor(([bos] if bos is not None else []) + piece, dtype=torch.int64))
    return chunks


def read_text(path: Path) -> str:
    """The calibration text; a missing or non-UTF-8 file is refused, naming it (``calibrate_text``
    refuses an empty one)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CalibrateError(f"{path}: calibration text not found") from None
    except UnicodeDecodeError as exc:
        raise CalibrateError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    return text


def calibrate_text(model: torch.nn.Module, tokenizer: Any, text: str, spec: FamilySpec, *,
                   chunk_tokens: int = DEFAULT_CHUNK_TOKENS, max_tokens: int | None = None,
                   source: str = "text") -> CalibrationRun:
    """``calibrate`` over ``text`` tokenized by ``tokenizer`` (an HF tokenizer); ``max_tokens``
    keeps only the first tokens of the text, ``source`` names the text in errors."""
    if not text.strip():
        raise CalibrateError(f"{source}: the calibration text is empty")
    if max_tokens is not None and max_tokens < 1:
        raise CalibrateError(f"max_tokens (--max-tokens) {max_tokens}: expected a positive count")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if not ids:
        raise CalibrateError(f"{source}: the calibration text tokenizes to no tokens")
    return calibrate(model, token_chunks(ids, chunk_tokens, getattr(tokenizer, "bos_token_id", None)), spec)


def load_model(path: Path, device: str, dtype: torch.dtype, tokenizer_path: Path | None = None) -> tuple[Any, Any]:
    """``(model, tokenizer)`` from a local Hugging Face checkpoint folder; never the hub."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for folder, what in ((path, "model"), (tokenizer_path or path, "tokenizer")):
        if not folder.is_dir():
            raise CalibrateError(f"{folder}: no such {what} folder (kvgen calibrate loads a local checkpoint)")
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise CalibrateError(f"{path}: cannot load the model: {exc}") from None
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise CalibrateError(f"{tokenizer_path or path}: cannot load a tokenizer ({exc}); pass --tokenizer") from None
    return model.to(device).eval(), tokenizer


def upstream_path(flat_path: Path) -> Path:
    """Default place of the upstream form: ``calib.pt`` -> ``calib.upstream.pt``."""
    return flat_path.with_name(f"{flat_path.stem}.upstream{flat_path.suffix or '.pt'}")


def write_outputs(run: CalibrationRun, flat_path: str | Path, upstream: str | Path) -> None:
    """Both forms ``kvgen.reference.triattention.load_calibration`` reads: the flat one (with omega
    and freq_scale_sq) and the upstream project's (per-head dicts, metadata)."""
    flat_path, upstream = Path(flat_path), Path(upstream)
    for path in (flat_path, upstream):
        path.parent.mkdir(parents=True, exist_ok=True)
    save_calibration(run.calibration, flat_path)
    metadata = {**run.metadata, "family": run.family, "model": run.model, "num_tokens": run.tokens,
                "num_traces": run.chunks, "producer": "kvgen calibrate"}
    save_upstream_calibration(run.calibration, upstream, metadata)
