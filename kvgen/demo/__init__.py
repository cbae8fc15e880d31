"""``kvgen demo``: a serving scenario driven the way an inference engine would drive kvgen.

Two parts, each on real model geometry (``specs/qwen3-8b.yaml``; the codec also on the MLA family
``specs/deepseek-v3.yaml``):

1. **Cold tier.** A paged hot pool on the GPU with a fixed number of pages, a cold tier in pinned
   host memory with a fixed byte budget and, with ``--disk DIR``, a disk tier (a file of cold
   blobs). Requests arrive with prompts; when the hot pool is full the least recently used request
   is offloaded (its pages encoded by the generated codec from the registry straight into pinned
   slots) and onboarded (decoded into free hot pages) when it returns. Every onboarded page is
   compared with the oracle's ``decode(encode(original))``, byte for byte, and attention over the
   restored K/V is compared with attention over the original.
2. **Eviction.** Long-decode requests compacted by TriAttention rounds (``TriAttentionManager``
   with the generated score, pack and compact kernels) at several budgets; attention over the
   kept tokens is compared with attention over all of them.

K/V are synthetic but shaped like a real cache: per-channel outliers (10-50x), K rotated by RoPE
at its real positions with the spec's theta, scaling and pairing. Attention is the real formula,
``softmax(q K^T * scale) V`` with the spec's GQA grouping.

``--device cpu`` runs the same scenario with the oracle as the codec (``kvgen.reference``) and as
the TriAttention backends (``score_keys``, ``pack_moves``, ``compact_paged``); the report says so
(``"backend": "oracle (cpu)"``) and its times are wall-clock times of the oracle, not kernel times.

Results are plain dataclasses (``DemoResult`` holding ``CodecFamilyResult`` per family with its
``PageBytes``, ``CodecChecks``, ``TransferResult``, and an ``EvictionResult`` with one
``BudgetResult`` per budget); ``dataclasses.asdict`` of the ``DemoResult`` is the JSON report.

Modules: ``config`` (sizes, settings, specs), ``synthetic`` (cache geometry, synthetic K/V),
``attention`` (attention and its error), ``codecs`` (generated codec or oracle), ``tiers`` (hot
pool, cold and disk tiers), ``offload`` (part 1), ``eviction`` (part 2), ``report`` (the run, its
JSON and tables). Times come from ``kvgen.measure.timing``.

The CLI wires ``kvgen demo`` to ``add_arguments`` and ``run``; importing this package imports only
``config`` (no torch, no oracle): ``run`` imports the rest when the demo runs.
"""


from __future__ import annotations

import argparse

from kvgen.demo.config import (
    CODEC_FAMILIES,
    CPU_SMALL_LAYERS,
    FULL,
    SMALL,
    DemoConfig,
    DemoError,
    Sizes,
    add_arguments,
    config_from_args,
)


def run(args: argparse.Namespace) -> int:
    """``kvgen demo``: run, print the tables, write the JSON; 1 with a message on a setup error
    (no GPU, no registry or library: those messages name the file and the command that fixes it)."""
    from dataclasses import asdict

    from kvgen.artifacts.manifest import RegistryError
    from kvgen.demo.report import demo, print_report, write_report  # torch and the oracle load here
    from kvgen.runtime.library import LibraryError
    from kvgen.spec.schema import SpecError

    try:
        config = config_from_args(args)
        report = asdict(demo(config))
    except (DemoError, RegistryError, LibraryError, SpecError) as exc:
        print(f"error: {exc}")
        return 1
    write_report(report, config.out)
    print_report(report)
    print(f"wrote {config.out}")
    return 0


__all__ = ["CODEC_FAMILIES", "CPU_SMALL_LAYERS", "FULL", "SMALL", "DemoConfig", "DemoError", "Sizes",
           "add_arguments", "config_from_args", "run"]
