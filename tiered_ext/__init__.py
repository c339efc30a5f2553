"""tiered_ext: native kernels (being written)."""
