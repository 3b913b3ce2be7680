"""The server's request rules without a server: short quoting, the character bound on prompts, the
strict base model's null rule, and seeds bounded to 64 bits (issue 17)."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from segserve.entrypoints.openai import protocol as p
from segserve.entrypoints.openai.limits import max_prompt_chars, quote
from segserve.sampling_params import SamplingParams
from segserve.worker.sampler import mix_seed


def test_quote_is_short_ascii_and_says_what_was_cut():
    assert quote("gpt-4") == "'gpt-4'"
    assert quote("x" * 100) == f"'{'x' * 40}... (100 characters)'"
    assert quote("\ud800") == "'\\ud800'" and quote("é\n") == "'\\xe9\\n'"
    assert quote(10**5000) == "an integer of 16610 bits"
    assert quote(2**64) == "18446744073709551616"
    assert quote(list(range(100))) == "a list of 100 items" and quote([1, 2]) == "[1, 2]"
    assert quote({"a": 1, "b": 2}) == "an object with 2 keys"
    assert quote(True) == "true" and quote(None) == "null" and quote(1.5) == "1.5"


def test_character_bound_never_refuses_a_text_that_fits(tiny_tokenizer):
    """Random texts over the training alphabet, spaces and multi-byte characters: the token count
    is never below characters / (bound / (2 max_model_len)), so a text over the bound cannot fit."""
    per_token = max_prompt_chars(tiny_tokenizer, 1) // 2
    rng = random.Random(0)
    alphabet = "the quick brown fox jumps over lazy dog TQ.;,    éß€😀\n"
    for _ in range(200):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 400)))
        tokens = len(tiny_tokenizer.encode(text, add_special_tokens=False))
        assert tokens * per_token >= len(text), (text, tokens)


@pytest.fixture(scope="module")
def tiny_tokenizer():
    from tests.model_fixtures import train_tiny_tokenizer

    return train_tiny_tokenizer()


def test_null_means_default_and_types_are_strict():
    req = p.CompletionRequest.model_validate({"prompt": "hi", "n": None, "stream": None, "echo": None,
                                              "max_tokens": None, "temperature": None})
    assert (req.n, req.stream, req.echo, req.max_tokens, req.temperature) == (1, False, False, None, None)
    assert p.CompletionRequest.model_validate({"prompt": "hi"}).max_tokens == 16
    for bad in ({"prompt": "hi", "max_tokens": True}, {"prompt": "hi", "stream": 1},
                {"prompt": [[False]]}, {"prompt": "hi", "n": 2.0}, {"prompt": None},
                {"prompt": "hi", "stream_options": {"include_usage": True}},
                {"prompt": "hi", "temperature": 2.01}, {"prompt": "hi", "seed": 2**63},
                {"prompt": "hi", "cache_salt": ""}):
        with pytest.raises(ValidationError):
            p.CompletionRequest.model_validate(bad)
    chat = p.ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": [{"type": None, "text": "a"}]}], "logprobs": None})
    assert chat.messages[0].text() == "a" and chat.logprobs is False


def test_seeds_are_bounded_to_64_bits_and_children_stay_in_range():
    assert SamplingParams(seed=2**63 - 1).seed == 2**63 - 1 and SamplingParams(seed=-(2**63)).seed == -(2**63)
    for seed in (2**63, -(2**63) - 1, 2**64 + 5):
        with pytest.raises(ValueError, match=r"seed must be in \[-2\^63, 2\^63 - 1\]"):
            SamplingParams(seed=seed)
    from segserve.engine.llm_engine import LLMEngine

    parent = SamplingParams(seed=2**63 - 1, n=4)
    for index in range(1, 4):
        child = LLMEngine._child_params(parent, index).seed
        assert -(2**63) <= child < 2**63
        # The same 64 bits as before the bound: the child's sampled tokens are unchanged.
        assert child % 2**64 == mix_seed(2**63 - 1, -1 - index)


@pytest.mark.parametrize("flags, message", [
    (["--max-request-body-bytes", "0"], "--max-request-body-bytes must be >= 1, got 0"),
    (["--shutdown-grace-period", "-1"], "--shutdown-grace-period must be >= 0 seconds, got -1.0"),
    (["--shutdown-grace-period", "nan"], "--shutdown-grace-period must be >= 0 seconds, got nan"),
    (["--log-interval", "0"], "--log-interval must be > 0 seconds, got 0.0"),  # a fresh user's trial
    (["--log-interval", "-1"], "--log-interval must be > 0 seconds, got -1.0"),
])
def test_serve_flags_fail_before_any_model_loads(flags, message, capsys):
    from segserve.entrypoints.cli import build_parser, main

    args = build_parser().parse_args(["serve"])
    assert (args.max_request_body_bytes, args.shutdown_grace_period, args.cache_salt_by_api_key) == (
        8 * 2**20, 10.0, False)
    assert main(["serve", *flags]) == 2
    assert message in capsys.readouterr().err
