"""The oracle: plain PyTorch statements of COLD_PAGE_FORMAT.md and TRIATTENTION.md, beside the
pipeline (every stage may read it; it reads none of them).

- ``nvfp4``: the block arithmetic (E2M1 codes, E4M3 scales, 2FP4);
- ``layout``: the cold page's vocabulary (row spans, record regions, lifecycles), torch-free;
- ``codec``: layer records and cold pages, byte for byte;
- ``triattention_family``: what TriAttention needs of a family and what it refuses, torch-free;
- ``triattention``, ``triattention_calib``: scoring, selection, packing, compaction, calibration.

Every kernel kvgen generates is tested against these (bytes for the codec, packer, compaction and
selection; a stated tolerance for scores). Import the submodule you need: this package imports
nothing, so the torch-free parts stay torch-free.
"""
