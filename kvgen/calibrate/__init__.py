"""``kvgen calibrate``: TriAttention query statistics measured on a Hugging Face model (TRIATTENTION.md §1).

The offline step before eviction: forward hooks capture every layer's pre-RoPE queries on a
calibration text, and their means per (layer, query head, RoPE frequency) are written in both
on-disk forms ``kvgen.reference.triattention.load_calibration`` reads. The model is checked
against the family spec first (layers, heads, head_dim, RoPE frequencies, attention factor,
pairing, rotated span).

- ``model``: what is read of the model and how it is checked (``CalibrateError``);
- ``stats``: the running sums (``QueryStats``);
- ``run``: ``calibrate`` (token chunks), ``calibrate_text`` (a tokenizer and text),
  ``load_model`` (a local checkpoint folder) and ``write_outputs``.

A tool beside the pipeline: it reads the spec, its lowering and the oracle; the runtime never
imports it. transformers is needed only to load a checkpoint from a folder.
"""

from kvgen.calibrate.model import CalibrateError
from kvgen.calibrate.run import (
    DEFAULT_CHUNK_TOKENS,
    CalibrationRun,
    calibrate,
    calibrate_text,
    load_model,
    read_text,
    token_chunks,
    upstream_path,
    write_outputs,
)

__all__ = ["DEFAULT_CHUNK_TOKENS", "CalibrateError", "CalibrationRun", "calibrate", "calibrate_text", "load_model",
           "read_text", "token_chunks", "upstream_path", "write_outputs"]
