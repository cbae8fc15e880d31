"""The Triton move-packer kernels (TRIATTENTION.md §6); a family's generated ``pack.py`` binds them
to its constants."""
