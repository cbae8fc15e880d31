"""4. Building: rendered sources -> compiled artifacts for each target arch, cached by content,
published into a registry.
"""
