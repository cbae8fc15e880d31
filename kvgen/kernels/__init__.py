"""Hand-written device code, by language; the generated sources instantiate it.

- ``include/``: the public C ABI headers (``kvgen_codec.h``, ``kvgen_compact.h``, ``kvgen_score.h``,
  ``kvgen_select.h``, ``kvgen_pack.h``) that an engine includes;
- ``cuda/``: the codec and compaction kernels and their host wrappers (``__host__ __device__``
  arithmetic, so the CPU tests run it);
- ``cute/``: the TriAttention score kernel (CuTe DSL) and its C shim;
- ``triton/``: the move packer and selection kernels, with the C shims of their ahead-of-time
  build (``pack_abi.cpp``, ``select_abi.cpp``, ``aot_launch.h``);
- ``packing.py``, ``selection.py``: their host sides, shared by the JIT and AOT launchers.
"""

from pathlib import Path

KERNELS_DIR = Path(__file__).resolve().parent
INCLUDE_DIR = KERNELS_DIR / "include"
CUDA_DIR = KERNELS_DIR / "cuda"
CUTE_DIR = KERNELS_DIR / "cute"
# Every nvcc compile of a generated source sees both: the ABI headers and the kernels.
INCLUDE_DIRS = (INCLUDE_DIR, CUDA_DIR)
