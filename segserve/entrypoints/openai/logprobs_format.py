"""Engine logprobs (``{token_id: logprob}`` per position, the chosen token first) in OpenAI's shapes.

Completions (legacy): parallel lists ``tokens`` / ``token_logprobs`` / ``top_logprobs`` /
``text_offset``; a position without logprobs (the first prompt token under ``echo``) has ``null``.
As in vLLM 0.32, a position's ``top_logprobs`` holds the chosen token and the top ``logprobs``
tokens, and ``-inf`` is written as -9999.0 (JSON has no infinity). Chat: ``logprobs.content``, one
entry per token with its UTF-8 ``bytes`` and its ``top_logprobs`` most likely tokens by rank.
"""

from __future__ import annotations

from collections.abc import Callable

from segserve.entrypoints.openai import protocol as p

FLOOR = -9999.0

Decode = Callable[[int], str]


def _lp(value: float) -> float:
    return max(value, FLOOR)


class CompletionLogprobsBuilder:
    """Builds one choice's completions logprobs piece by piece (streaming) with running text offsets.

    Args:
        decode: token id -> its text alone.
    """

    def __init__(self, decode: Decode) -> None:
        self.decode = decode
        self.offset = 0

    def add(self, token_ids: list[int], positions: list[dict[int, float] | None]) -> p.CompletionLogProbs:
        """Entries for ``token_ids`` (one position dict or None each), continuing earlier offsets.

        Raises:
            ValueError: when the two lists differ in length.
        """
        if len(token_ids) != len(positions):
            raise ValueError(f"{len(token_ids)} tokens but {len(positions)} logprob positions")
        out = p.CompletionLogProbs()
        for tok, pos in zip(token_ids, positions, strict=True):
            text = self.decode(tok)
            out.tokens.append(text)
            out.text_offset.append(self.offset)
            self.offset += len(text)
            if pos is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
            else:
                out.token_logprobs.append(_lp(pos[tok]))
                out.top_logprobs.append(self._top(pos))
        return out


    def _top(self, pos: dict[int, float]) -> dict[str, float]:
        # Tokens that decode to the same text (lone bytes of a UTF-8 character) share a key: keep the
        # highest logprob, so a greedy token still reads as the best one.
        top: dict[str, float] = {}
        for t, v in pos.items():
            key = self.decode(t)
            top[key] = max(top.get(key, FLOOR - 1.0), _lp(v))
        return top


def chat_logprobs(
    token_ids: list[int], positions: list[dict[int, float]], top_logprobs: int, decode: Decode
) -> p.ChoiceLogprobs:
    """``logprobs.content`` of chat tokens; ``top_logprobs`` most likely tokens per position."""
    content = []
    for tok, pos in zip(token_ids, positions, strict=True):
        ranked = sorted(pos.items(), key=lambda kv: -kv[1])[:top_logprobs]
        top = [_top(t, v, decode) for t, v in ranked]
        text = decode(tok)
        content.append(p.TokenLogprob(token=text, logprob=_lp(pos[tok]), bytes=list(text.encode("utf-8")),
                                      top_logprobs=top))
    return p.ChoiceLogprobs(content=content)


def _top(token: int, value: float, decode: Decode) -> p.TopLogprob:
    text = decode(token)
    return p.TopLogprob(token=text, logprob=_lp(value), bytes=list(text.encode("utf-8")))
