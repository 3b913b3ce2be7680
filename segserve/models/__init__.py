"""Model families (one file each) and the weight/tokenizer loader."""

from segserve.models.llama import LlamaConfig, LlamaForCausalLM, kv_cache_bytes_per_token
from segserve.models.loader import LoadedModel, load_model

__all__ = ["LlamaConfig", "LlamaForCausalLM", "LoadedModel", "kv_cache_bytes_per_token", "load_model"]
