"""kvgen inside other libraries' loops. ``kvgen.integrations.transformers`` (extra ``[hf]``): cache
classes for Hugging Face ``model.generate(past_key_values=...)``. Importing this package imports
none of them."""
