"""Per-step tensor work: model runner, input batch and sampler."""
