"""Engine wiring: step loop, offline LLM API, async engine and incremental detokenization."""
