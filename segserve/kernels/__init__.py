"""Compiled CPU kernels (C, AVX-512), built on first use; see ``segserve.kernels.cpu``."""
