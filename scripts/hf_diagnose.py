"""Why generate() with a kvgen cache is not bit-identical to DynamicCache on the GPU (issue 18):
per layer, compare the attention call's inputs (q, k, v), its mask / is_causal and its output
between the two caches, for the prefill and the first decode steps; and whether DynamicCache is
bit-identical to itself. Writes ``$OUT/hf_diagnose.json``.

    PYTHONPATH=$PWD python scripts/hf_diagnose.py --registry build/registry --out $OUT
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from transformers import DynamicCache  # noqa: E402
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: E402

from kvgen.integrations.transformers import KvgenOffloadedCache  # noqa: E402
from kvgen.runtime.eviction import registry_config  # noqa: E402
from kvgen.runtime.lookup import RuntimeRegistry  # noqa: E402
from tests.hf_models import tiny_model  # noqa: E402

SIZES = {"hidden": 1024, "intermediate": 2048, "vocab": 8192}


class Recorder:
    """Wraps the sdpa attention function: per call, the inputs' layout and a copy of q, k, v, out."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self.inner = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def __call__(self, module, query, key, value, attention_mask, **kwargs):  # noqa: ANN001, ANN003, ANN204
        out = self.inner(module, query, key, value, attention_mask, **kwargs)
        self.calls.append({"q": query.detach().clone(), "k": key.detach().clone(), "v": value.detach().clone(),
                           "out": out[0].detach().clone(),
                           "meta": {"q_stride": list(query.stride()), "k_stride": list(key.stride()),
                                    "k_shape": list(key.shape), "k_contiguous": key.is_contiguous(),
                                    "k_ptr_mod_256": key.data_ptr() % 256,
                                    "mask": None if attention_mask is None else list(attention_mask.shape),
                                    "kwargs": {k: str(v) for k, v in kwargs.items()
                                               if k in ("is_causal", "scaling", "dropout", "sliding_window")}}})
        return out


def run_recorded(model, ids, cache, new: int, recorder: Recorder):  # noqa: ANN001, ANN201
    recorder.calls = []
    out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, past_key_values=cache,
                         output_logits=True, return_dict_in_generate=True)
    return out, recorder.calls


def compare(a: list[dict], b: list[dict], layers: int) -> list[dict]:
    """The first differing calls: which tensor differs first, and the layout of both."""
    rows = []
    for i, (x, y) in enumerate(zip(a, b)):
        diff = [name for name in ("q", "k", "v", "out") if not torch.equal(x[name], y[name])]
        layout = {k: v for k, v in x["meta"].items() if k != "k_ptr_mod_256"}   # allocation: not a cause
        if diff or layout != {k: v for k, v in y["meta"].items() if k != "k_ptr_mod_256"}:
            rows.append({"call": i, "step": i // layers, "layer": i % layers, "differs": diff,
                         "meta_dynamic": x["meta"], "meta_kvgen": y["meta"]})
        if len(rows) >= 6:
            break
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--registry", type=Path, default=ROOT / "build" / "registry")
    parser.add_argument("--arch", default="sm_90a")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--cases", default="4x1024,1x1024,4x100", help="batch x prompt, comma-separated")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    registry = RuntimeRegistry([args.registry])
    family = "qwen3-8b"
    config = registry_config(registry.resolve(family, args.arch))
    model = tiny_model(config, args.device, **SIZES)
    recorder = Recorder()
    ALL_ATTENTION_FUNCTIONS["sdpa"] = recorder
    layers = config.geometry.num_layers
    report: dict = {"torch": torch.__version__}
    for batch, prompt in (tuple(map(int, c.split("x"))) for c in args.cases.split(",")):
        gen = torch.Generator(args.device).manual_seed(0)
        ids = torch.randint(0, SIZES["vocab"], (batch, prompt), device=args.device, generator=gen)
        new = 4

        def kvgen() -> KvgenOffloadedCache:
            return KvgenOffloadedCache(model.config, family, registry=registry, arch=args.arch,
                                       max_cache_len=prompt + 64)

        d1, c1 = run_recorded(model, ids, DynamicCache(), new, recorder)
        d2, c2 = run_recorded(model, ids, DynamicCache(), new, recorder)
        k1, ck = run_recorded(model, ids, kvgen(), new, recorder)
        k2, _ = run_recorded(model, ids, kvgen(), new, recorder)
        section = {
            "dynamic_vs_dynamic_logits_equal": all(torch.equal(a, b) for a, b in zip(d1.logits, d2.logits)),
            "dynamic_vs_dynamic_calls": compare(c1, c2, layers),
            "kvgen_vs_kvgen_logits_equal": all(torch.equal(a, b) for a, b in zip(k1.logits, k2.logits)),
            "kvgen_vs_dynamic_logits_equal": [bool(torch.equal(a, b)) for a, b in zip(k1.logits, d1.logits)],
            "kvgen_vs_dynamic_calls": compare(c1, ck, layers),
        }
        with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
            dm, _ = run_recorded(model, ids, DynamicCache(), new, recorder)
            km, _ = run_recorded(model, ids, kvgen(), new, recorder)
        section["math_backend_kvgen_vs_dynamic_logits_equal"] = [bool(torch.equal(a, b))
                                                                 for a, b in zip(km.logits, dm.logits)]
        report[f"B{batch}_T{prompt}"] = section
        print(json.dumps(section, indent=1, default=str), flush=True)
        (args.out / "hf_diagnose.json").write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
