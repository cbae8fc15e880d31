"""Hand-written CuTe DSL kernels that generated modules instantiate (``generated/<family>/score.py``).

Importing this package imports nothing from CUTLASS; only its submodules do, and only the build
(``kvgen.build.cute_aot``, in a subprocess per arch) imports them. The runtime never does.
"""
