"""What kvgen's tools share to measure kernels (bench, tuner, demo):

- ``timing``: the one timer (CUDA events or the host clock, rotation over input copies, warm-up,
  median and quantiles), the L2 rotation rule, CUDA-graph capture, the physical ceilings;
- ``environment``: the record of where a measurement ran, and where results are written;
- ``libraries``: a registry's verified artifact of an op, through the runtime lookup;
- ``workloads``: one workload per op (codec, compact, score): inputs for a size, the oracle check,
  the timed call.

Sits above ``runtime``, ``artifacts``, ``reference`` and ``kernels``; never reads a spec (the tools
hand workloads the layout and geometry they lowered). Importing this package imports nothing.
"""
