"""3. Rendering: ``KernelPlan`` -> source text through the Jinja templates in ``templates/``.

Templates carry a plan's constants, never logic; the device code they instantiate is in
``kvgen.kernels``.
"""
