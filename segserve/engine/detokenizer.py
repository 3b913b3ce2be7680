"""Incremental, UTF-8 safe detokenization with stop strings (pure Python, no torch).

Each step decodes only a short window of token ids: ``ids[prefix_offset:read_offset]`` (text already
emitted, kept as context so that merges and leading spaces decode as they do inside the full text)
and ``ids[prefix_offset:]``; the difference is the new text. A window whose text ends in U+FFFD (a
byte-level BPE token that stops inside a multi-byte character) emits nothing until a later token
completes the character. This is the prefix_offset/read_offset technique of Hugging Face TGI and vLLM.

Stop strings follow vLLM: once the output text contains one, the text ends just before it (or just
after it with ``include_stop_str_in_output``). Text that could still turn out to be the start of a
stop string is held back from the returned deltas until it cannot, or until :meth:`flush`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

# Prompt tokens kept as decoding context for the first output tokens (vLLM keeps a handful too).
PROMPT_CONTEXT_TOKENS = 6
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one completion's token ids into text deltas as they arrive.

    Args:
        tokenizer: a Hugging Face tokenizer (``PreTrainedTokenizer`` or ``...Fast``); only ``decode``
            is called.
        prompt_token_ids: the prompt; its last few ids are decoding context, never output.
        skip_special_tokens: leave special tokens out of the text.
        stop: stop strings (non-empty).
        include_stop_str_in_output: keep the matched stop string at the end of the text.
        min_tokens: stop strings are ignored until more than this many tokens were generated (vLLM).
        spaces_between_special_tokens: with ``False`` (and special tokens kept), added tokens are
            written as their exact content, with no space the tokenizer's decoder might put around
            them (Hugging Face slow tokenizers' meaning); ``True`` decodes as the tokenizer does.

    Attributes:
        stop_string_hit: the stop string that ended the text, or ``None``.

    Cost per token is O(window + longest stop string), independent of the output length.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        if any(not s for s in stop):
            raise ValueError(f"stop strings must be non-empty, got {stop!r}")
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = tuple(stop)
        self._include_stop = include_stop_str_in_output
        self._min_tokens = min_tokens
        self._added: dict[int, str] = {}
        if not skip_special_tokens and not spaces_between_special_tokens:
            self._added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
        self._tail_len = max((len(s) for s in self._stop), default=1) - 1
        self._ids = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._num_output_tokens = 0
        self._released: list[str] = []  # text returned by update/flush
        self._held = ""  # text after _released that may begin a stop string
        self._tail = ""  # last _tail_len characters of released + held, for matches across steps
        self.stop_string_hit: str | None = None

    @property
    def text(self) -> str:
        """The full output text so far (held-back text included; O(length) per call)."""
        return "".join(self._released) + self._held

    @property
    def released_text(self) -> str:
        """The text returned by :meth:`update` and :meth:`flush` so far: what a request's outputs carry
        (vLLM's cumulative text leaves out the same held-back tail); O(length) per call."""
        return "".join(self._released)

    def update(self, new_token_ids: list[int]) -> str:
        """Append generated token ids and return the text that became final.

        Returns:
            The new text delta; "" while a character is incomplete, while the text may be the start
            of a stop string, and always after a stop string was hit.
        """
        deltas = []
        for token_id in new_token_ids:
            if self.stop_string_hit is not None:
                break
            self._ids.append(token_id)
            self._num_output_tokens += 1
            deltas.append(self._commit(self._decode_step(), final=False))
        return "".join(deltas)

    def flush(self) -> str:
        """Release everything held back; call once when the request finishes without a stop string.

        An incomplete trailing character is released as U+FFFD, as ``tokenizer.decode`` renders it.
        """
        if self.stop_string_hit is not None:
            return ""
        prefix_text, full_text = self._window_texts()
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._commit(full_text[len(prefix_text):], final=True)

    def _decode(self, ids: list[int]) -> str:
        if not self._added:
            return self._decode_run(ids)
        pieces, run = [], []
        for t in ids:
            if t in self._added:
                pieces += [self._decode_run(run), self._added[t]]
                run = []
            else:
                run.append(t)
        return "".join(pieces) + self._decode_run(run)

    def _decode_run(self, ids: list[int]) -> str:
        if not ids:
            return ""
        # No clean-up of tokenization spaces: it rewrites " ." and similar across window edges.
        return self._tokenizer.decode(
            ids, skip_special_tokens=self._skip_special, clean_up_tokenization_spaces=False
        )

    def _window_texts(self) -> tuple[str, str]:
        window = self._ids[self._prefix_offset:]
        return self._decode(window[: self._read_offset - self._prefix_offset]), self._decode(window)

    def _decode_step(self) -> str:
        """New stable text from the window, advancing the offsets only when some was produced."""
        prefix_text, full_text = self._window_texts()
        if len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return full_text[len(prefix_text):]

    def _commit(self, delta: str, final: bool) -> str:
        """Add ``delta`` to the text, apply stop strings, and return what may be released now."""
        window = self._tail + delta
        hit = self._find_stop(window, len(self._tail)) if self._checking_stops() else None
        pending = self._held + delta
        if hit is not None:
            index, stop = hit
            end = index + len(stop) if self._include_stop else index
            released = pending[: max(0, end - (len(self._tail) - len(self._held)))]
            self._held, self.stop_string_hit = "", stop
        else:
            keep = 0 if final or self._include_stop else self._stop_prefix_len(pending)
            released, self._held = pending[: len(pending) - keep], pending[len(pending) - keep:]
            self._tail = window[-self._tail_len:] if self._tail_len else ""  # all of a shorter window
        self._released.append(released)
        return released

    def _checking_stops(self) -> bool:
        return bool(self._stop) and self._num_output_tokens > self._min_tokens

    def _find_stop(self, window: str, new_from: int) -> tuple[int, str] | None:
        """The stop string in ``window`` that ends first inside its new part (from ``new_from``), ties in
        stop-list order: what appending one character at a time would find (vLLM 0.32's rule)."""
        best: tuple[int, str] | None = None
        best_end = len(window) + 1
        for stop in self._stop:
            index = window.find(stop, max(0, new_from - len(stop) + 1))
            if index >= 0 and index + len(stop) < best_end:
                best, best_end = (index, stop), index + len(stop)
        return best

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
