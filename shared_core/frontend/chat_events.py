"""What a chat call yields (:class:`~shared_core.frontend.chat.ChatStream`): a
:class:`ReplyDelta` per engine step, then one :class:`Finished` with the whole :class:`Reply`, its
:class:`CallReport` and the rest of the reply (the deltas and the rest add up to the reply).
Plain frozen data, no framework types: each adapter turns them into its framework's chunks,
messages and responses."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from shared_core.decoding.tool_calls import InvalidToolCall, ToolCall

if TYPE_CHECKING:
    from collections.abc import Sequence

    from shared_core.decoding.logprobs import TokenLogprob
    from shared_core.decoding.output import GenerationResult
    from shared_core.runtime.protocol import ModelLM

FoundCall = ToolCall | InvalidToolCall


@dataclass(frozen=True)
class ReplyDelta:
    """What one step added to the reply: content text (with tools parsed, never a call's text)
    and the tool calls it completed, in the order written."""

    text: str
    calls: tuple[FoundCall, ...] = ()


@dataclass(frozen=True)
class Reply:
    """A whole reply: the generated ``text`` as decoded, its ``content`` (``text`` without the
    tool calls' text; ``text`` itself when no tools are parsed), the valid and invalid calls,
    and the engine's result (token ids, stats)."""

    text: str
    content: str
    tool_calls: tuple[ToolCall, ...]
    invalid_tool_calls: tuple[InvalidToolCall, ...]
    result: GenerationResult


@dataclass(frozen=True)
class CallReport:
    """Usage and engine stats of one call, as both adapters attach them to a response; a reply
    with at least one valid tool call finishes with ``"tool_calls"``."""

    engine: str
    model: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    passage_cache: dict[str, Any] | None
    speculative_stats: dict[str, Any]
    logprobs: list[dict[str, Any]] | None = None  # OpenAI's logprobs.content, when asked for

    @classmethod
    def of(cls, result: GenerationResult, engine: str, model: str, *, tool_calls: bool,
           lm: ModelLM) -> CallReport:
        stats = result.stats
        logprobs = None if result.logprobs is None else openai_logprobs(lm, result.logprobs)
        return cls(engine, model, "tool_calls" if tool_calls else stats.finish_reason,
                   stats.prompt_tokens, stats.new_tokens,
                   getattr(stats, "cached_prompt_tokens", 0),
                   getattr(stats, "extra", {}).get("passage_cache"), stats.as_dict(), logprobs)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def openai_logprobs(lm: ModelLM, entries: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    """``entries`` as OpenAI's ``choices[0].logprobs.content``: each token's text as the
    tokenizer decodes it alone, with its UTF-8 ``bytes`` (None for a token holding part of a
    character, whose text alone is not valid UTF-8)."""
    pieces: dict[int, str] = {}

    def entry(token: int, logprob: float) -> dict[str, Any]:
        if token not in pieces:
            pieces[token] = lm.decode([token])
        text = pieces[token]
        raw = None if "\ufffd" in text else list(text.encode("utf-8"))
        return {"token": text, "bytes": raw, "logprob": logprob}

    return [{**entry(e.token_id, e.logprob), "top_logprobs": [entry(t, v) for t, v in e.top]}
            for e in entries]


@dataclass(frozen=True)
class Finished:
    """The end of a call: the whole reply, its report, and ``rest``: what the reply holds beyond
    the :class:`ReplyDelta` events before it (content and calls decided only when the reply
    ended; with :meth:`~shared_core.frontend.chat.ChatStream.finish`, the whole reply)."""

    reply: Reply
    report: CallReport
    rest: ReplyDelta


ChatEvent = ReplyDelta | Finished
