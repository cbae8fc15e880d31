"""kvgen: a compiler-style kernel generator and autotuner for KV-cache compression.

The package is the pipeline, one subpackage a stage: ``spec`` (YAML -> FamilySpec), ``lower``
(layouts, plans, tunables), ``render`` (Jinja -> sources), ``kernels`` (hand-written device code),
``build`` (compile, cache, publish), ``artifacts`` (manifest, wheels) and ``runtime`` (load and
run, torch + ctypes only); ``reference`` is the oracle beside it. ``measure``, ``tuning``,
``bench`` and ``demo`` are tools on top; ``cli`` parses arguments and prints.
"""

__version__ = "0.1.0"
