"""TriAttention eviction from an installed kernel wheel alone (run by test_wheel_gpu.py as a script).

The child process that runs this file sees only: a copy of kvgen's run-time side (base modules,
``artifacts``, ``kernels``, ``reference``, ``runtime``), ``tri_sim.py`` beside it, and the wheel's
install target; ``pydantic``, ``yaml``, ``jinja2``, Triton and every build-side kvgen package are
blocked, and its working directory is empty (no build tree, no ``generated/``, no ``specs/``).

From the manifest it takes the family's ``EvictionConfig`` and every kernel: the CuTe DSL scorer,
the AOT selection and packer libraries and the CUDA compactor. A synthetic decode runs rounds
every ``beta`` tokens, and after each step the pools must be byte-identical to the oracle's
``eviction_round`` on a copy, the kept positions equal (K rows come from a small codebook, so
scores tie exactly or lie far apart: the float32 kernel and the float32 oracle then keep the same
tokens). Prints one JSON line.
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import json
import sys
import tempfile
from pathlib import Path

BLOCKED = ("pydantic", "yaml", "jinja2", "optuna", "cutlass", "kvgen.spec", "kvgen.lower", "kvgen.render",
           "kvgen.build", "kvgen.tuning", "kvgen.bench", "kvgen.demo", "kvgen.measure", "kvgen.cli")
FAMILY = "qwen3-8b"
PACKAGE = "kvgen-kernels-sm90"


class _Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):  # noqa: ANN001 - the finder protocol
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ImportError(f"blocked for the wheel proof: {name}")
        return None


def main() -> int:
    sys.meta_path.insert(0, _Block())
    sys.modules["triton"] = None   # as if not installed: find_spec says None, an import fails
    import torch
    from tri_sim import DecodeSim, run_against_oracle, save_synthetic_calibration

    from kvgen.reference.triattention import load_calibration, rope_defaults
    from kvgen.runtime.eviction import TriAttentionManager, registry_config
    from kvgen.runtime.lookup import RuntimeRegistry

    resolved = RuntimeRegistry.default(environ={}).resolve(FAMILY)   # installed wheels only
    if resolved.source.package != PACKAGE:
        raise SystemExit(f"{FAMILY} came from {resolved.source.describe()}, not the installed {PACKAGE}")
    budget, beta = 64, 16
    config = dataclasses.replace(registry_config(resolved), budget=budget, beta=beta)
    prompts, tails, generated = [13, 150, 61, 7], [0, 1, 3, 2], [0, 9, 20, 31]
    steps = budget + 3 * beta + 24
    sim = DecodeSim(config, prompts, tails, max(prompts) + max(tails) + max(generated) + steps + 8,
                    torch.device("cuda"), seed=23, generated=generated, codebook=24)
    with tempfile.TemporaryDirectory() as tmp:
        calibration_path = save_synthetic_calibration(config, Path(tmp) / "calibration.pt", seed=9)
        manager = TriAttentionManager.from_registry(resolved, calibration_path, sim.k_pools, sim.v_pools,
                                                    budget=budget, beta=beta)
        omega, scale = rope_defaults(config.geometry.rotary_dim, config.rope_theta, config.rope_scaling)
        calibration = load_calibration(calibration_path, config.geometry, omega, scale)
        rounds = run_against_oracle(manager, sim, steps, calibration)
    described = manager.describe()
    kvgen_modules = sorted({name.split(".")[1] for name in sys.modules if name.startswith("kvgen.")})
    print(json.dumps({"family": FAMILY, "source": resolved.source.describe(), "rounds": len(rounds),
                      "requests_per_round": [len(r["due"]) for r in rounds], "budget": budget, "beta": beta,
                      "score_library": described["score_library"], "selection": described["selection"],
                      "kvgen_packages_loaded": kvgen_modules, "blocked": [*BLOCKED, "triton"],
                      "byte_identical": True}))
    return 0 if len(rounds) >= 3 else 1


if __name__ == "__main__":
    raise SystemExit(main())
