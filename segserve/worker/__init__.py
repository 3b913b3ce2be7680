"""Per-step tensor work: the model runner, how each step of the model runs (``cpu_step``), the sampler."""
