"""Tiny random-initialised transformers models shaped like a kvgen family, and the oracle's view of
a TriAttention round inside ``generate()``; shared by the CPU tests, the GPU tests and
``scripts/hf_proof.py``. Needs transformers (extra ``[hf]``) and no spec (the family's
``EvictionConfig`` from a registry manifest describes it), except ``calibrate_random_tokens``:
``kvgen calibrate`` checks the model against the family spec."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvgen.reference.triattention import EvictionConfig, eviction_round


def config_for(family: EvictionConfig, *, hidden: int = 256, intermediate: int = 512, vocab: int = 1024):
    """A transformers config with the family's attention geometry and RoPE: ``Qwen3Config`` for
    full-width RoPE, a dense all-full-attention ``Qwen3_5TextConfig`` for partial rotary (Qwen3's
    attention rotates the whole head). ``hidden`` is free: Qwen3 takes ``head_dim`` explicitly."""
    from transformers import Qwen3Config
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    g = family.geometry
    rope = {"rope_type": "default", "rope_theta": family.rope_theta}
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=g.num_layers,
                  num_attention_heads=g.query_heads, num_key_value_heads=g.kv_heads, head_dim=g.head_dim,
                  max_position_embeddings=1 << 15, tie_word_embeddings=False)
    if g.rotary_dim == g.head_dim:
        return Qwen3Config(**common, rope_parameters=rope)
    rope["partial_rotary_factor"] = g.rotary_dim / g.head_dim
    return Qwen3_5TextConfig(**common, rope_parameters=rope, layer_types=["full_attention"] * g.num_layers)


def tiny_model(family: EvictionConfig, device: str | torch.device, seed: int = 0, **sizes):
    """The random-initialised causal LM of ``config_for`` in the family's hot dtype, eval mode.
    Built with ``from_config(..., dtype=)``, never cast with ``.to(dtype)``: its RoPE ``inv_freq``
    buffer stays float32, the spec's frequencies, which ``kvgen calibrate`` checks."""
    from transformers import AutoModelForCausalLM

    from kvgen.runtime.score import TORCH_DTYPES

    torch.manual_seed(seed)
    with torch.device(device):   # initialise in place: a GPU inits the proof's 0.6 B parameters in moments
        model = AutoModelForCausalLM.from_config(config_for(family, **sizes), dtype=TORCH_DTYPES[family.dtype])
    return model.to(device).eval()


def deterministic_attention():  # noqa: ANN201 - a context manager
    """SDPA's math backend, for comparisons bit for bit: the flash / efficient CUDA kernels chosen
    by default are not reproducible run to run at batch 4 with a 1024-token prompt on the H200
    (``scripts/hf_diagnose.py``, ``results/2026-12-02-h200-s3/call1/hf_diagnose.json``)."""
    return torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH])


def synchronize() -> None:
    """Wait for the GPU where there is one (the CPU tests run the same helpers with stand-ins)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@dataclass(frozen=True)
class Calibrated:
    """``kvgen calibrate``'s statistics of a model, written in both on-disk forms."""

    run: object        # a kvgen.calibrate.CalibrationRun
    flat: Path         # {E_q, E_q_norm, omega, freq_scale_sq}
    upstream: Path     # the upstream project's stats file
    seconds: float     # calibrate() alone (forward passes and sums), synchronized

    def describe(self) -> dict:
        run = self.run
        return {"producer": "kvgen.calibrate.calibrate", "tokens": run.tokens, "forward_passes": run.chunks,
                "seconds": self.seconds, "tokens_per_s": run.tokens / self.seconds,
                "query_site": run.metadata["query_site"], "concentration": run.concentration,
                "flat": str(self.flat), "upstream": str(self.upstream)}


def calibrate_random_tokens(model, spec, folder: Path, tokens: int, chunk_tokens: int,  # noqa: ANN001
                            seed: int = 0) -> Calibrated:
    """``kvgen calibrate`` (``kvgen.calibrate.calibrate``) of ``model`` against family ``spec`` over
    ``tokens`` random token ids in forward passes of ``chunk_tokens``; both forms written to
    ``folder/<family>.pt`` and ``folder/<family>.upstream.pt``. A random-initialised model has no
    tokenizer and was trained on no text, so uniformly random ids are as good a calibration text as
    any: the statistics are of the queries this model makes, which is what its cache scores with."""
    from kvgen.calibrate import calibrate, token_chunks, upstream_path, write_outputs

    ids = torch.randint(0, model.config.vocab_size, (tokens,), generator=torch.Generator().manual_seed(seed))
    chunks = token_chunks(ids.tolist(), chunk_tokens)
    synchronize()
    start = time.perf_counter()
    run = calibrate(model, chunks, spec)
    synchronize()
    seconds = time.perf_counter() - start
    flat = folder / f"{spec.name}.pt"
    write_outputs(run, flat, upstream_path(flat))
    return Calibrated(run, flat, upstream_path(flat), seconds)


@dataclass
class OracleCodec:
    """Stands in for ``ColdPageCodec`` on the CPU: ``offload`` / ``onboard`` by the oracle's
    ``encode_records`` / ``decode_records``, same pairs (dst, src), same cold page (layer records
    in order)."""

    layout: object   # a RegistryLayout
    pools: list
    offload_strategy: str = "oracle"

    def __post_init__(self) -> None:
        from kvgen.integrations.transformers import reference_record

        self.record = reference_record(self.layout)

    def cold_page_bytes(self) -> int:
        return self.layout.cold_page_bytes()

    def describe_offload(self) -> dict:
        return {"strategy": self.offload_strategy}

    def offload(self, cold: torch.Tensor, pairs: torch.Tensor) -> None:
        from kvgen.reference.codec import encode_records

        slots, pages = pairs[:, 0].long(), pairs[:, 1].long()
        cold[slots] = torch.cat([encode_records(self.record, {"k": k[pages], "v": v[pages]}).cpu()
                                 for k, v in self.pools], dim=1)

    def onboard(self, cold: torch.Tensor, pairs: torch.Tensor) -> None:
        from kvgen.reference.codec import decode_records

        pages, slots = pairs[:, 0].long(), pairs[:, 1].long()
        records = cold[slots].view(len(slots), len(self.pools), self.record.bytes)
        for layer, (k, v) in enumerate(self.pools):
            decoded, _ = decode_records(self.record, records[:, layer].contiguous().to(k.device), "bf16")
            k[pages] = decoded["k"].view(len(pages), *k.shape[1:])
            v[pages] = decoded["v"].view(len(pages), *v.shape[1:])


@dataclass
class RoundOracle:
    """``on_round`` for ``KvgenTriAttentionCache``: right before each round, the oracle's
    ``eviction_round`` on copies of the pools; ``agreement`` compares its kept sets with the
    cache's (``cache.rounds[i].kept``)."""

    kept: list[torch.Tensor] = field(default_factory=list)

    def __call__(self, cache) -> None:  # noqa: ANN001 - a KvgenTriAttentionCache
        manager, store = cache.manager, cache.store
        rows = store.batch
        state = manager.requests[0]
        k, v = [p.clone() for p in store.k], [p.clone() for p in store.v]
        result = eviction_round(k, v, store.page_table, [state.prompt_len] * rows, [cache.length] * rows,
                                [state.evicted] * rows, [0] * rows, manager.calibration.to(store.k[0].device),
                                manager.geometry, manager.budget, manager.beta, manager.mode)
        self.kept.append(result.kept.cpu())

    def agreement(self, cache) -> list[float]:  # noqa: ANN001
        """Per round: the fraction of kept positions (over rows and decision rows) the oracle kept too."""
        out = []
        for record, oracle in zip(cache.rounds, self.kept, strict=True):
            mine = record.kept.cpu()
            same = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(mine.flatten(0, 1), oracle.flatten(0, 1)))
            out.append(same / mine.numel())
        return out


def offload_round_trip(cache) -> dict:  # noqa: ANN001 - a KvgenOffloadedCache after a generate()
    """``offload()`` then ``onboard()`` of every page the rows hold, checked against the oracle: the
    cold slots byte for byte against ``encode_records`` of the hot pages, the pages they come back
    into byte for byte against ``decode_records`` of those slots, and the lossless span (if any)
    against the original. The pages left are overwritten with NaN in between (they are free), so
    what comes back comes from the host. Times both transfers (synchronized)."""
    from kvgen.integrations.transformers import reference_record
    from kvgen.reference.codec import decode_records, encode_records

    store, pool, record = cache.store, cache.pool, reference_record(cache.layout)
    old_pages = store.used_pages().long()
    before = [(k[old_pages].clone(), v[old_pages].clone()) for k, v in zip(pool.k, pool.v)]
    synchronize()
    start = time.perf_counter()
    cold_bytes = cache.offload()
    synchronize()
    offload_s = time.perf_counter() - start
    slots = cache.offloaded[0].long()
    for k, v in zip(pool.k, pool.v):
        k[old_pages] = torch.nan
        v[old_pages] = torch.nan
    start = time.perf_counter()
    cache.onboard()
    synchronize()
    onboard_s = time.perf_counter() - start
    pages = store.used_pages().long()
    cold = cache.cold[slots].to(pages.device).view(len(pages), len(before), record.bytes)
    cold_exact = restored_exact = lossless_exact = True
    b = record.buffers[0]
    for layer, (k, v) in enumerate(before):
        expected = encode_records(record, {"k": k, "v": v})
        cold_exact &= torch.equal(cold[:, layer], expected)
        decoded, _ = decode_records(record, cold[:, layer].contiguous(), cache.family.dtype)
        for name, hot in (("k", pool.k[layer]), ("v", pool.v[layer])):
            restored_exact &= torch.equal(hot[pages].view(torch.int16).reshape(decoded[name].shape),
                                          decoded[name].view(torch.int16))
        if b.prefix:
            rows = pool.k[layer][pages].reshape(decoded["k"].shape)
            lossless_exact &= torch.equal(rows[..., : b.prefix].view(torch.int16),
                                          k.reshape(rows.shape)[..., : b.prefix].view(torch.int16))
    return {"pages": len(pages), "cold_bytes": cold_bytes, "hot_bytes": 2 * sum(t[0].numel() * 2 for t in before),
            "offload_s": offload_s, "onboard_s": onboard_s, "cold_byte_exact_vs_oracle": bool(cold_exact),
            "restored_byte_exact_vs_oracle": bool(restored_exact),
            "lossless_span_elements": b.prefix, "lossless_span_bit_exact": bool(lossless_exact) if b.prefix else None,
            "strategy": cache.codec.offload_strategy}


def oracle_history(cache):  # noqa: ANN001, ANN201 - an offloaded KvgenOffloadedCache -> DynamicCache
    """A ``DynamicCache`` holding the oracle's decode (``decode_records``) of the cache's cold slots
    as ``[B, H, T, D]``: what the cache must hold once it onboards them (NVFP4 is not idempotent,
    so this is read from the cold pages themselves, not from an earlier restore)."""
    from transformers import DynamicCache

    from kvgen.integrations.transformers import gather_rows, reference_record, token_rows
    from kvgen.reference.codec import decode_records

    synchronize()
    record, g = reference_record(cache.layout), cache.geometry
    slots, row_pages = cache.offloaded
    device = cache.pool.device
    cold = cache.cold[slots.long()].to(device).view(len(slots), g.num_layers, record.bytes)
    table = torch.arange(len(slots), dtype=torch.int32, device=device).view(-1, row_pages)   # slots are row-major
    rows = token_rows(table, 0, cache.length, g.kv_heads, g.tokens_per_block, g.layout)
    history = DynamicCache()
    for layer in range(g.num_layers):
        decoded, _ = decode_records(record, cold[:, layer].contiguous(), cache.family.dtype)
        k, v = (decoded[name].view(len(slots), *g.page_shape) for name in ("k", "v"))
        history.update(gather_rows(k, rows), gather_rows(v, rows), layer)
    return history
