"""Tiny random-initialised transformers models shaped like a kvgen family, and the oracle's view of
a TriAttention round inside ``generate()``; shared by the CPU tests, the GPU tests and
``scripts/hf_proof.py``. Needs transformers (extra ``[hf]``) and no spec (the family's
``EvictionConfig`` from a registry manifest describes it)."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    """The random-initialised causal LM of ``config_for`` in the family's hot dtype, eval mode."""
    from transformers import AutoModelForCausalLM

    from kvgen.runtime.score import TORCH_DTYPES

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config_for(family, **sizes), dtype=TORCH_DTYPES[family.dtype])
    return model.to(device).eval()


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
