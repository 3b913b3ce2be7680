"""Load a Llama-family checkpoint (GGUF file or local Hugging Face directory) with its tokenizer.

Both formats go through one path: read tensors under Hugging Face names (GGUF names are mapped and
llama.cpp's Q/K row permutation is undone), check the set of names against the config (any missing
or unused tensor is a ``ValueError`` naming it), fuse q/k/v and gate/up, and assign the result into a
``LlamaForCausalLM`` built on the meta device (no random init, no second copy). Nothing is
downloaded: Hugging Face calls run with ``local_files_only=True``.

GGUF Q8_0, Q4_0 and Q4_1 tensors are kept in their block form by default (``QuantWeight``; their
modules become ``segserve.models.quant_linear.QuantLinear`` / ``QuantEmbedding``): the Q/K
permutation moves whole rows of blocks, and a fused projection concatenates its parts' block rows.
Quantizing is per row, so both commute with it. ``quantization="none"`` dequantizes instead.
"""

from __future__ import annotations

import json
import logging
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from segserve.attention.backends import AttentionBackend, get_attention_backend
from segserve.config import QUANTIZATION_CHOICES
from segserve.kernels.gguf_blocks import FORMATS, QuantWeight, dequantize_torch
from segserve.model_files import DEFAULT_GGUF_FILE, default_model_path, model_format  # noqa: F401 - re-exported
from segserve.models.llama import LlamaConfig, LlamaForCausalLM
from segserve.models.quant_linear import QuantEmbedding, QuantLinear

logger = logging.getLogger("segserve")

# GGUF tensor types holding plain floats: dequantized (converted) without a note.
_FLOAT_GGUF_TYPES = ("F32", "F16", "BF16", "F64")
# Types gguf.quants.dequantize cannot turn into float weights.
_INTEGER_GGUF_TYPES = ("I8", "I16", "I32", "I64")

# GGUF tensor names (llama.cpp's ``gguf-py/gguf/tensor_mapping.py``) -> Hugging Face names.
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# transformers builds these GGUF vocabularies with GPT-2's default byte-level split; other ``pre``
# values get their own regex there, so they go through transformers itself (see tokenizer_from_gguf).
_GPT2_DEFAULT_PRE = (None, "default", "gpt2", "smollm")


@dataclass
class LoadedModel:
    """A model ready to run, with what the engine needs around it.

    Attributes:
        model: the module, in eval mode, gradients off.
        config: its shape.
        tokenizer: a ``transformers`` fast tokenizer (``PreTrainedTokenizerFast``).
        chat_template: Jinja chat template from the checkpoint, if any.
        eos_token_ids: every id that ends generation (config, generation config, GGUF metadata).
        name: file stem or directory name.
    """

    model: LlamaForCausalLM
    config: LlamaConfig
    tokenizer: Any
    chat_template: str | None
    eos_token_ids: list[int]
    name: str


def load_model(
    model: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
    attn_backend: AttentionBackend | str = "segmented",
    quantization: str | None = None,
) -> LoadedModel:
    """Load weights, config, tokenizer and chat template.

    Args:
        model: a ``.gguf`` file, a local Hugging Face directory (``config.json``, ``*.safetensors``,
            tokenizer files), or ``None`` for the default SmolLM2 GGUF.
        dtype: activation dtype (float32 or bfloat16), and that of every weight kept in float.
        attn_backend: a backend object, or a name for ``segserve.attention.backends.get_attention_backend``.
        quantization: None (default) keeps a GGUF file's Q8_0, Q4_0 and Q4_1 weights in their block
            form (``segserve.models.quant_linear``; norms and float tensors in ``dtype``) and
            dequantizes other quantized types with one log line per type; ``"gguf"`` the same, but
            refuses a checkpoint that is not GGUF; ``"none"`` dequantizes every tensor to ``dtype``.

    Raises:
        FileNotFoundError: when the path does not exist or the default model is not installed.
        ValueError: on an unsupported architecture, a checkpoint whose tensors do not match its config,
            a file that is not a readable GGUF or a truncated or mis-typed tensor in one (the message
            names the file or the tensor), or a ``quantization`` not in ``QUANTIZATION_CHOICES``.
    """
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {list(QUANTIZATION_CHOICES)}, got {quantization!r}")
    path = default_model_path() if model is None else Path(model)
    if isinstance(attn_backend, str):
        attn_backend = get_attention_backend(attn_backend)
    if model_format(path) == "gguf":
        return _load_gguf(path, dtype, attn_backend, native=quantization != "none")
    if quantization == "gguf":
        raise ValueError(f"quantization='gguf' needs a .gguf file; {path} is a Hugging Face directory")
    return _load_hf_dir(path, dtype, attn_backend)


# ---------------------------------------------------------------------------------------------- GGUF


def _load_gguf(
    path: Path, dtype: torch.dtype, backend: AttentionBackend, native: bool = False
) -> LoadedModel:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except Exception as e:  # gguf raises ValueError, struct.error, IndexError... on a bad file
        bad_tensor = _diagnose_tensors(path)
        if bad_tensor is not None:
            raise ValueError(f"{path}: {bad_tensor}") from e
        raise ValueError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e
    config = config_from_gguf(reader)
    model = build_model(config, gguf_state_dict(reader, config, dtype, native=native), backend)
    tokenizer = tokenizer_from_gguf(reader, path)
    eos = [] if config.eos_token_id is None else [config.eos_token_id]
    return LoadedModel(model, config, tokenizer, tokenizer.chat_template, eos, path.stem)


def gguf_value(reader: Any, key: str, default: Any = None) -> Any:
    """A metadata value of a ``gguf.GGUFReader``: str, number, bool, or a list of them."""
    from gguf import GGUFValueType

    field = reader.fields.get(key)
    if field is None:
        return default
    if field.types[0] == GGUFValueType.ARRAY:
        if field.types[-1] == GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if field.types[0] == GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    return field.parts[field.data[0]].tolist()[0]


def config_from_gguf(reader: Any) -> LlamaConfig:
    """``LlamaConfig`` from a GGUF's ``llama.*`` metadata, the tokenizer ids and the tensor list.

    Raises:
        ValueError: on an architecture other than ``llama``, partial rotary, or RoPE scaling.
    """
    arch = gguf_value(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (only 'llama')")
    names = {t.name for t in reader.tensors}

    def key(suffix: str, default: Any = None) -> Any:
        value = gguf_value(reader, f"llama.{suffix}", default)
        if value is None:
            raise ValueError(f"GGUF metadata key 'llama.{suffix}' is missing")
        return value

    hidden, heads = key("embedding_length"), key("attention.head_count")
    head_dim = key("attention.key_length", hidden // heads)
    if key("rope.dimension_count", head_dim) != head_dim:
        raise ValueError("partial rotary embedding (rope.dimension_count != head_dim) is not supported")
    if key("rope.scaling.type", "none") != "none" or "rope_freqs.weight" in names:
        raise ValueError("GGUF RoPE scaling (rope.scaling.type or rope_freqs.weight) is not supported")
    token_field = reader.fields.get("tokenizer.ggml.tokens")
    num_tokens = None if token_field is None else len(token_field.data)
    return LlamaConfig(
        vocab_size=key("vocab_size", num_tokens),
        hidden_size=hidden,
        intermediate_size=key("feed_forward_length"),
        num_hidden_layers=key("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=key("attention.head_count_kv", heads),
        head_dim=head_dim,
        rms_norm_eps=key("attention.layer_norm_rms_epsilon"),
        rope_theta=key("rope.freq_base", 10000.0),
        max_position_embeddings=key("context_length"),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        bos_token_id=gguf_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=gguf_value(reader, "tokenizer.ggml.eos_token_id"),
    )


def gguf_tensor_name(name: str) -> str:
    """Hugging Face name of a GGUF tensor; an unknown name is returned as is (and later reported unused)."""
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    m = _GGUF_LAYER_RE.fullmatch(name)
    if m is None or m.group(2) not in _GGUF_LAYER_NAMES:
        return name
    return f"model.layers.{m.group(1)}.{_GGUF_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def unpermute_rotary_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order (rows ``(H, D)`` -> ``(H, 2, D/2)`` swapped to ``(H, D/2, 2)``).

    ``convert_hf_to_gguf.py`` interleaves each head's two rotary halves so llama.cpp can rotate
    adjacent pairs; HF's rotate-half wants them back in halves. Works on weights ``(rows, cols)`` and
    biases ``(rows,)``.
    """
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _diagnose_tensors(path: Path) -> str | None:
    """Why gguf's reader could not build a tensor of ``path``, naming it: a type id ggml does not know,
    or data running past the end of the file (truncated); None when no tensor is at fault (a bad
    header: the caller's generic message stands). Reads the tensor table only."""
    from gguf import GGUFReader
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    class _TableOnly(GGUFReader):
        # gguf.GGUFReader builds every tensor in __init__ (failing there on the first bad one, without
        # its name); this keeps the parsed table instead (gguf 0.19's _build_tensors hook).
        def _build_tensors(self, start_offs: int, fields: list) -> None:
            self.table = (start_offs, fields)

    try:
        table = _TableOnly(path)
    except Exception:
        return None
    start, fields = table.table
    size = len(table.data)
    for field in fields:
        _, name_data, _, dims, raw_type, offset = field.parts
        name = bytes(name_data).decode("utf-8", "replace")
        shape = tuple(reversed(dims.tolist()))
        try:
            ggml_type = GGMLQuantizationType(int(raw_type[0]))
        except ValueError:
            return f"tensor {name!r} {shape} has GGML type id {int(raw_type[0])}, not a known type"
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        elements = int(np.prod(dims))
        if elements % block:
            return f"tensor {name!r} {shape} of type {ggml_type.name} is not whole {block}-value blocks"
        end = int(start + offset[0]) + elements // block * type_size
        if end > size:
            return (f"tensor {name!r} {shape} of type {ggml_type.name} needs bytes up to offset {end}, "
                    f"but the file has {size} (truncated)")
    return None


def _check_tensor(tensor: Any, shape: tuple[int, ...]) -> None:
    """ValueError naming a tensor gguf read but segserve cannot use: an integer type, or data of another
    size than its type and shape need."""
    from gguf.constants import GGML_QUANT_SIZES

    kind = tensor.tensor_type.name
    if kind in _INTEGER_GGUF_TYPES:
        raise ValueError(
            f"tensor {tensor.name!r} {shape} has integer type {kind}; weights must be float (F32, F16, BF16) "
            "or a GGUF quantized type"
        )
    block, type_size = GGML_QUANT_SIZES[tensor.tensor_type]
    want = int(np.prod(shape)) // block * type_size
    if tensor.data.nbytes != want:
        raise ValueError(
            f"tensor {tensor.name!r} {shape} of type {kind} holds {tensor.data.nbytes} bytes, its type and "
            f"shape need {want}"
        )


def gguf_state_dict(
    reader: Any, config: LlamaConfig, dtype: torch.dtype, native: bool = False
) -> dict[str, torch.Tensor | QuantWeight]:
    """Every tensor of the file under Hugging Face names, Q/K unpermuted: dequantized to ``dtype``, or
    with ``native`` the 2-D Q8_0/Q4_0/Q4_1 ones as ``QuantWeight`` (a copy of their blocks, so the
    file's memory map can go). Other quantized types are dequantized then, with one log line per type.

    Raises:
        ValueError: naming a tensor of an integer type or whose data size does not fit its type and shape.
    """
    from gguf.quants import dequantize

    out: dict[str, torch.Tensor | QuantWeight] = {}
    not_native: dict[str, list[str]] = defaultdict(list)
    for tensor in reader.tensors:
        shape = tuple(reversed(tensor.shape.tolist()))  # ggml lists dims innermost first
        _check_tensor(tensor, shape)
        name, kind = gguf_tensor_name(tensor.name), tensor.tensor_type.name
        heads = (config.num_attention_heads if ".self_attn.q_proj." in name
                 else config.num_key_value_heads if ".self_attn.k_proj." in name else None)
        if native and kind in FORMATS and len(shape) == 2:
            blocks = tensor.data.reshape(shape[0], -1)  # (rows, row bytes): Q/K rows move whole
            if heads is not None:
                blocks = unpermute_rotary_rows(blocks, heads)
            blocks = np.array(blocks, dtype=np.uint8)  # a copy: the memory map is not kept
            out[name] = QuantWeight(torch.from_numpy(blocks), kind, shape[1])
            continue
        if native and kind not in _FLOAT_GGUF_TYPES:
            not_native[kind].append(tensor.name)
        w = dequantize(tensor.data, tensor.tensor_type).reshape(shape)  # (rows, cols) float32
        if heads is not None:
            w = unpermute_rotary_rows(w, heads)
        # Unquantized tensors come back as views of the read-only memory map: copy those.
        w = w if w.flags.writeable and w.flags.c_contiguous else np.array(w, dtype=np.float32)
        out[name] = torch.from_numpy(w).to(dtype)
    for kind, names in not_native.items():
        more = f" and {len(names) - 1} more" if len(names) > 1 else ""
        logger.info("GGUF type %s has no native kernel: dequantized to %s (%s%s)", kind,
                    str(dtype).removeprefix("torch."), names[0], more)
    return out


def _byte_level_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte: printable Latin-1 bytes map to themselves, the other
    68 to code points 256, 257, ... in byte order (Radford et al. 2019, ``encoder.py``)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelling = {b: chr(b) for b in keep}
    extra = (b for b in range(256) if b not in spelling)
    spelling.update({b: chr(256 + n) for n, b in enumerate(extra)})
    return spelling


def tokenizer_from_gguf(reader: Any, path: Path) -> Any:
    """The file's tokenizer as a ``transformers`` fast tokenizer, chat template included.

    For byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``) whose ``pre`` transformers
    maps to GPT-2's default split, the tokenizer is assembled here from the vocabulary and merges
    (~0.3 s instead of ~3.5 s for SmolLM2) following ``transformers.integrations.gguf``'s recipe;
    its serialized form equals transformers' (tested). Note transformers, and so this, ignores
    llama.cpp's ``smollm`` digit split; SmolLM2's vocabulary has no multi-digit tokens, so the two
    differ only where whitespace runs into a digit. Other vocabularies are built by transformers.
    """
    if gguf_value(reader, "tokenizer.ggml.model") != "gpt2" or (
        gguf_value(reader, "tokenizer.ggml.pre") not in _GPT2_DEFAULT_PRE
    ):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    tokens = gguf_value(reader, "tokenizer.ggml.tokens")
    token_types = gguf_value(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    backend = _byte_level_bpe(tokens, gguf_value(reader, "tokenizer.ggml.merges") or [], token_types)
    return _wrap_tokenizer(backend, tokens, reader)


def _byte_level_bpe(tokens: list[str], merges: list[str], token_types: list[int]) -> Any:
    """A ``tokenizers.Tokenizer``: byte-level BPE plus the file's control (special) and user tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    spelling = _byte_level_alphabet()
    alphabet = set(spelling.values())

    def spell(token: str) -> str:
        return token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8"))

    vocab = {spell(t): i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ")) for m in merges]
    bpe = Tokenizer(BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                        end_of_word_suffix="", fuse_unk=False))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    typed = list(zip(tokens, token_types, strict=True))
    control, user = 3, 4  # llama.cpp's token types
    # A "control" token outside the byte alphabet is a llama.cpp mislabel; transformers skips it too.
    special = [t for t, ty in typed if ty == control and set(t) <= alphabet]
    bpe.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in special])
    added = [t for t, ty in typed if ty == user and t in vocab]
    bpe.add_tokens([AddedToken(t, normalized=False, special=False) for t in added])
    return bpe


def _wrap_tokenizer(backend: Any, tokens: list[str], reader: Any) -> Any:
    from transformers import PreTrainedTokenizerFast

    def token(key: str) -> str | None:
        tid = gguf_value(reader, f"tokenizer.ggml.{key}")
        return None if tid is None else tokens[tid]

    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=token("bos_token_id"),
        eos_token=token("eos_token_id"),
        unk_token=token("unknown_token_id"),
        pad_token=token("padding_token_id"),
        chat_template=gguf_value(reader, "tokenizer.chat_template"),
        add_bos_token=bool(gguf_value(reader, "tokenizer.ggml.add_bos_token", False)),
        add_eos_token=bool(gguf_value(reader, "tokenizer.ggml.add_eos_token", False)),
    )


# ------------------------------------------------------------------------------ Hugging Face directory


def _load_hf_dir(path: Path, dtype: torch.dtype, backend: AttentionBackend) -> LoadedModel:
    from transformers import AutoTokenizer

    hf_config = _read_json(path / "config.json")
    if hf_config is None:
        raise FileNotFoundError(f"{path}: no config.json")
    config = LlamaConfig.from_hf_config(hf_config)
    model = build_model(config, read_safetensors_dir(path, dtype), backend)
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    eos = _eos_ids(hf_config, _read_json(path / "generation_config.json") or {}, tokenizer)
    return LoadedModel(model, config, tokenizer, tokenizer.chat_template, eos, path.name)


def _read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _eos_ids(hf_config: dict[str, Any], gen_config: dict[str, Any], tokenizer: Any) -> list[int]:
    """Union, in order, of the config's and generation config's EOS ids (an int or a list each)."""
    ids: list[int] = []
    for source in (hf_config.get("eos_token_id"), gen_config.get("eos_token_id")):
        for tid in source if isinstance(source, list) else [source]:
            if isinstance(tid, int) and tid not in ids:
                ids.append(tid)
    if not ids and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return ids


def read_safetensors_dir(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """All tensors of ``path/*.safetensors``, cast to ``dtype``.

    Raises:
        ValueError: when there is no safetensors file or a name appears in two shards.
    """
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files (other weight formats are not supported)")
    out: dict[str, torch.Tensor] = {}
    for file in files:
        for name, tensor in load_file(file).items():
            if name in out:
                raise ValueError(f"tensor {name!r} appears in more than one shard ({file.name})")
            out[name] = tensor.to(dtype)
    return out


# -------------------------------------------------------------------------------- checking and fusing


def expected_hf_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of ``config`` must hold, by Hugging Face name, with its shape."""
    h, i = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for n in range(config.num_hidden_layers):
        p = f"model.layers.{n}."
        proj = {"q_proj": config.q_size, "k_proj": config.kv_size, "v_proj": config.kv_size}
        for name, rows in proj.items():
            shapes[f"{p}self_attn.{name}.weight"] = (rows, h)
            if config.attention_bias:
                shapes[f"{p}self_attn.{name}.bias"] = (rows,)
        shapes[f"{p}self_attn.o_proj.weight"] = (h, config.q_size)
        shapes[f"{p}mlp.gate_proj.weight"] = (i, h)
        shapes[f"{p}mlp.up_proj.weight"] = (i, h)
        shapes[f"{p}mlp.down_proj.weight"] = (h, i)
        shapes[f"{p}input_layernorm.weight"] = (h,)
        shapes[f"{p}post_attention_layernorm.weight"] = (h,)
    return shapes


def _is_tolerated_extra(name: str, tensors: dict[str, torch.Tensor], config: LlamaConfig) -> bool:
    """Tensors that carry no information: RoPE's derived ``inv_freq`` buffer (older HF checkpoints
    saved it), and an ``lm_head.weight`` that duplicates the tied embedding exactly."""
    if name.endswith(".rotary_emb.inv_freq"):
        return True
    return (name == "lm_head.weight" and config.tie_word_embeddings
            and torch.equal(tensors[name], tensors.get("model.embed_tokens.weight", torch.empty(0))))


def check_tensors(config: LlamaConfig, tensors: dict[str, torch.Tensor | QuantWeight]) -> None:
    """Raise ``ValueError`` listing every missing, unused or wrongly shaped tensor (HF names)."""
    expected = expected_hf_shapes(config)
    missing = sorted(set(expected) - set(tensors))
    unused = sorted(n for n in set(tensors) - set(expected) if not _is_tolerated_extra(n, tensors, config))
    bad_shape = sorted(
        f"{n} {tuple(tensors[n].shape)} != {expected[n]}"
        for n in set(expected) & set(tensors) if tuple(tensors[n].shape) != expected[n]
    )
    found = (("missing tensors", missing), ("unused tensors", unused), ("wrong shapes", bad_shape))
    problems = [f"{label}: {items}" for label, items in found if items]
    if problems:
        raise ValueError("checkpoint does not match its config; " + "; ".join(problems))


def fuse_state_dict(
    config: LlamaConfig, tensors: dict[str, torch.Tensor | QuantWeight]
) -> dict[str, torch.Tensor | QuantWeight]:
    """HF-named tensors -> ``LlamaForCausalLM`` state dict: ``model.`` prefix dropped,
    ``qkv_proj = cat(q, k, v)``, ``gate_up_proj = cat(gate, up)`` along the output rows."""
    cat = _cat_rows
    out = {
        "embed_tokens.weight": tensors["model.embed_tokens.weight"],
        "norm.weight": tensors["model.norm.weight"],
    }
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = tensors["lm_head.weight"]
    for n in range(config.num_hidden_layers):
        src, dst = f"model.layers.{n}.", f"layers.{n}."
        a = f"{src}self_attn."
        out[f"{dst}self_attn.qkv_proj.weight"] = cat([tensors[f"{a}{p}_proj.weight"] for p in "qkv"])
        if config.attention_bias:
            out[f"{dst}self_attn.qkv_proj.bias"] = torch.cat([tensors[f"{a}{p}_proj.bias"] for p in "qkv"])
        out[f"{dst}self_attn.o_proj.weight"] = tensors[f"{a}o_proj.weight"]
        m = f"{src}mlp."
        gate_up = [tensors[f"{m}{p}_proj.weight"] for p in ("gate", "up")]
        out[f"{dst}mlp.gate_up_proj.weight"] = cat(gate_up)
        out[f"{dst}mlp.down_proj.weight"] = tensors[f"{m}down_proj.weight"]
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{dst}{norm}.weight"] = tensors[f"{src}{norm}.weight"]
    return out


def _cat_rows(parts: list[torch.Tensor | QuantWeight]) -> torch.Tensor | QuantWeight:
    """Row-wise concatenation of a fused projection's parts: their blocks when all are one quantized
    type; else (a mixed file) floats, the quantized parts dequantized in the float parts' dtype (or
    float32), with a log line."""
    if all(isinstance(p, QuantWeight) for p in parts) and len({p.qtype for p in parts}) == 1:
        return QuantWeight(torch.cat([p.data for p in parts]), parts[0].qtype, parts[0].in_features)
    if not any(isinstance(p, QuantWeight) for p in parts):
        return torch.cat(parts)
    dtype = next((p.dtype for p in parts if isinstance(p, torch.Tensor)), torch.float32)
    kinds = sorted({p.qtype if isinstance(p, QuantWeight) else str(p.dtype) for p in parts})
    logger.info("a fused projection mixes %s: dequantized to %s", ", ".join(kinds), dtype)
    return torch.cat([dequantize_torch(p, dtype) if isinstance(p, QuantWeight) else p for p in parts])


def _swap_in_quantized(model: LlamaForCausalLM, state: dict[str, Any], dtype: torch.dtype) -> None:
    """Replace each module whose weight in ``state`` is a ``QuantWeight`` by a ``QuantLinear`` /
    ``QuantEmbedding`` (on the meta device) and put its blocks in ``state`` as ``<module>.qweight``."""
    for key in [k for k, v in state.items() if isinstance(v, QuantWeight)]:
        w = state.pop(key)
        path = key.removesuffix(".weight")
        parent_name, _, attr = path.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        n, k = w.shape
        if path == "embed_tokens":
            module = QuantEmbedding(n, k, w.qtype, dtype, device="meta")
        else:
            module = QuantLinear(k, n, w.qtype, bias=f"{path}.bias" in state, device="meta", dtype=dtype)
        setattr(parent, attr, module)
        state[f"{path}.qweight"] = w.data


def build_model(
    config: LlamaConfig, tensors: dict[str, torch.Tensor | QuantWeight], attn_backend: AttentionBackend
) -> LlamaForCausalLM:
    """Check HF-named ``tensors`` against ``config``, fuse them and assign them into a new model.

    The module is built on the meta device, so its parameters are exactly ``tensors`` (their dtype
    and device); a ``QuantWeight`` makes its module a ``QuantLinear`` (or ``QuantEmbedding``) holding
    its blocks. Returned in eval mode with gradients off.

    Raises:
        ValueError: listing missing, unused or wrongly shaped tensors.
    """
    check_tensors(config, tensors)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, attn_backend)
    state = fuse_state_dict(config, tensors)
    _swap_in_quantized(model, state, state["norm.weight"].dtype)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)
