"""Scheduling and KV cache bookkeeping: token counts, block ids and hashes only (imports no torch)."""
