"""2. Lowering: a ``FamilySpec`` -> the plain data the later stages need.

- ``layout``: row schemas, layer-record regions and offsets, lifecycles (and their JSON, which the
  manifest carries to the runtime);
- ``triattention``: the spec in the oracle's terms (``TriGeometry``, RoPE defaults) and what
  TriAttention refuses;
- ``plan``: one ``KernelPlan`` per op, with the declared ``TUNABLES``;
- ``tuned``: tuned-configuration files, read as a build input.
"""
