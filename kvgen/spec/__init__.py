"""1. The front end: a family's YAML -> a validated, frozen ``FamilySpec``.

``yamlsrc`` reads YAML safely with the line of every key; ``schema`` is the pydantic model and the
format's rules, each error naming ``file:line: key`` and what would be accepted.
"""

from kvgen.spec.schema import FamilySpec, SpecError, SpecIssue, load_spec, parse_spec

__all__ = ["FamilySpec", "SpecError", "SpecIssue", "load_spec", "parse_spec"]
