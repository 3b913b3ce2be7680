"""Attention over a paged KV cache: the KV store, a reference backend and the segmented kernel."""
