"""The Triton kernels: the move packer (TRIATTENTION.md §6) and normalize/aggregate/select (§4-§5);
a family's generated ``pack.py`` and ``select.py`` bind them to its constants."""
