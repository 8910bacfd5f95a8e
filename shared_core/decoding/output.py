"""Turning committed token blocks into returned text: EOS, max tokens, stop strings, deltas.

Also the input checks every token-level entry point runs before any model work
(:func:`generation_config`, :func:`validate_messages`, :func:`validate_prompt_ids`): a wrong type
is a ``TypeError`` and a wrong value a ``ValueError``, each naming the parameter. An adapter's
edge checks a call once into typed values, a :class:`GenerationConfig` and :class:`ChatTurns`,
which the engines take as they are.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from shared_core.config import (
    DEFAULT_CACHE,
    DEFAULT_MAX_NEW_TOKENS,
    CacheKind,
    GenerationConfig,
    SamplingConfig,
    check_int,
    check_real,
    check_unicode,
)
from shared_core.decoding.decode_stats import DecodeStats
from shared_core.decoding.logprobs import TokenLogprob
from shared_core.runtime.lm import window_text
from shared_core.runtime.protocol import ModelLM, SessionLM

logger = logging.getLogger(__name__)


@dataclass
class GenerationResult:
    """What every token-level engine returns: new text only, its token ids, and stats."""

    text: str
    token_ids: list[int]
    stats: DecodeStats
    # one per token id when GenerationConfig.top_logprobs is set (decoding/logprobs.py), else None
    logprobs: list[TokenLogprob] | None = None


class OutputTracker:
    """Accumulates committed tokens and decides when generation is over.

    Stop strings are matched on the decoded text, so a stop that starts inside a multi-token
    accepted block is still honoured: ``text`` ends before the stop string, ``token_ids`` end with
    the token that completed it. EOS tokens end generation and are not returned.
    """

    def __init__(self, lm: ModelLM, config: GenerationConfig):
        self.lm = lm
        self.config = config
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason = ""
        self._emitted = 0
        # filled by the engine as it commits tokens (EOS included): result() keeps the reply's
        self.logprobs: list[TokenLogprob] | None = [] if config.top_logprobs is not None else None
        self._longest_stop = max((len(s) for s in config.stop), default=0)

    @property
    def done(self) -> bool:
        return bool(self.finish_reason)

    @property
    def remaining(self) -> int:
        return self.config.max_new_tokens - len(self.token_ids)

    def push(self, tokens: Iterable[int]) -> str:
        """Commit a block of tokens; return the new text that is safe to show."""
        for token in tokens:
            if token in self.lm.eos_token_ids:
                self.finish_reason = "stop"
                break
            self.token_ids.append(int(token))
            if len(self.token_ids) >= self.config.max_new_tokens:
                self.finish_reason = "length"
                break
        self.text = self.lm.decode(self.token_ids)
        if self.config.stop:
            self._apply_stop()
        return self._delta(final=self.done)

    def _apply_stop(self) -> None:
        # an incomplete character's placeholder is not text yet: matching it would make the
        # stop depend on where committed blocks end (one token at a time sees every one)
        end = len(self.text) if self.done else len(self.text.rstrip("\ufffd"))
        start = max(0, self._emitted - self._longest_stop)
        hits = [i for i in (self.text.find(s, start, end) for s in self.config.stop) if i >= 0]
        if not hits:
            return
        cut = min(hits)
        end = cut + next(len(s) for s in self.config.stop if self.text.startswith(s, cut))
        self.token_ids = self.token_ids[: self._tokens_covering(end)]
        self.text = self.text[:cut]
        self.finish_reason = "stop"

    def _tokens_covering(self, n_chars: int) -> int:
        """Fewest leading tokens whose decoded text has at least ``n_chars`` characters."""
        for m in range(1, len(self.token_ids) + 1):
            if len(self.lm.decode(self.token_ids[:m])) >= n_chars:
                return m
        return len(self.token_ids)

    def _delta(self, final: bool) -> str:
        safe = len(self.text)
        if not final:
            # Hold back an incomplete UTF-8 character and any tail that may begin a stop string.
            while safe > self._emitted and self.text[safe - 1] == "\ufffd":
                safe -= 1
            for stop in self.config.stop:
                for n in range(min(len(stop) - 1, safe - self._emitted), 0, -1):
                    if self.text[safe - n : safe] == stop[:n]:
                        safe -= n
                        break
        safe = max(safe, self._emitted)
        delta = self.text[self._emitted : safe]
        self._emitted = safe
        return delta

    def finish(self) -> str:
        """Flush text still held back (call once the loop ends)."""
        return self._delta(final=True)

    def result(self, stats: DecodeStats) -> GenerationResult:
        stats.new_tokens = len(self.token_ids)
        stats.finish_reason = self.finish_reason or "length"
        logprobs = None if self.logprobs is None else self.logprobs[: len(self.token_ids)]
        return GenerationResult(self.text, list(self.token_ids), stats, logprobs)


CHAT_ROLES = ("system", "user", "assistant", "tool")


def generation_config(max_new_tokens: object = DEFAULT_MAX_NEW_TOKENS, *,
                      name: str = "max_new_tokens", stop: object = None,
                      temperature: object = SamplingConfig.temperature,
                      top_k: object = SamplingConfig.top_k, top_p: object = SamplingConfig.top_p,
                      seed: object = None, min_p: object = SamplingConfig.min_p,
                      top_logprobs: object = None) -> GenerationConfig:
    """:meth:`GenerationConfig.build` after type checks; ``name`` is the caller's word for
    ``max_new_tokens`` (``"max_tokens"`` in LangChain), so the error names what was passed."""
    tokens = check_int(max_new_tokens, name, minimum=1)
    heat = check_real(temperature, "temperature")
    k = check_int(top_k, "top_k", minimum=0)
    p = check_real(top_p, "top_p")
    floor = check_real(min_p, "min_p")
    seed_value = check_int(seed, "seed", None) if seed is not None else None
    top = check_int(top_logprobs, "top_logprobs", minimum=0, optional=True)
    stops: list[str] | str | None = None
    if isinstance(stop, str):
        stops = stop
    elif stop is not None:
        if not isinstance(stop, Iterable) or isinstance(stop, bytes | dict):
            msg = f"stop must be a string or a list of strings, got {type(stop).__name__}"
            raise TypeError(msg)
        items = list(stop)
        bad = [s for s in items if not isinstance(s, str)]
        if bad:
            msg = f"stop must be a list of strings, got an item {bad[0]!r}"
            raise TypeError(msg)
        stops = [s for s in items if isinstance(s, str)]
    return GenerationConfig.build(tokens, stop=stops, temperature=heat, top_k=k, top_p=p,
                                  seed=seed_value, min_p=floor, top_logprobs=top)


def logprobs_count(logprobs: object, top_logprobs: object) -> int | None:
    """:attr:`GenerationConfig.top_logprobs` from OpenAI's two settings: None when neither asks
    for log-probabilities, else ``top_logprobs`` (0 when not given). ``top_logprobs`` with
    ``logprobs=False`` is refused, as OpenAI's API refuses it."""
    if logprobs is not None and not isinstance(logprobs, bool):
        msg = f"logprobs must be a bool or None, got {type(logprobs).__name__}"
        raise TypeError(msg)
    top = check_int(top_logprobs, "top_logprobs", minimum=0, optional=True)
    if logprobs is False and top is not None:
        msg = f"top_logprobs={top} needs logprobs=True (or logprobs left unset)"
        raise ValueError(msg)
    if top is None:
        return 0 if logprobs else None
    return GenerationConfig(top_logprobs=top).top_logprobs


def check_generation_field(name: str, value: object) -> None:
    """Check one generation setting given alone (an adapter field): ``max_tokens`` /
    ``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``, ``min_p`` or ``seed``; None
    passes."""
    if value is None:
        return
    if name in ("max_tokens", "max_new_tokens"):
        generation_config(value, name=name)
    else:
        setting: dict[str, Any] = {name: value}  # the keyword is chosen at run time
        generation_config(1, **setting)


def validate_messages(messages: Sequence[Any]) -> list[dict[str, str]]:
    """Chat messages as ``{"role", "content"}`` dicts with a known role and string content."""
    if not messages:
        msg = "messages must not be empty"
        raise ValueError(msg)
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            msg = f"message {i} must be a dict with 'role' and 'content', got {m!r:.80}"
            raise TypeError(msg)
        role, content = m["role"], m["content"]
        if role not in CHAT_ROLES:
            msg = f"message {i} has role={role!r}; the role must be one of {list(CHAT_ROLES)}"
            raise ValueError(msg)
        if content is None:
            msg = f"message {i} (role {role!r}) has content=None; pass a string"
            raise ValueError(msg)
        if not isinstance(content, str):
            msg = (f"message {i} (role {role!r}) content must be a string, got "
                   f"{type(content).__name__}")
            raise TypeError(msg)
        out.append({"role": role, "content": check_unicode(content, f"message {i} content")})
    return out


class ChatTurns(list[dict[str, Any]]):
    """Chat messages already checked by :func:`chat_turns` (an adapter's edge): the engines
    encode them without checking them again. Not to be changed once checked."""


def chat_turns(messages: Sequence[Any]) -> ChatTurns:
    """:func:`validate_messages` once, as :class:`ChatTurns`, keeping a turn's ``tool_calls`` /
    ``tool_call_id`` (the tool prompt renders them)."""
    if isinstance(messages, ChatTurns):
        return messages
    checked = validate_messages(messages)
    return ChatTurns({**c, **{k: m[k] for k in ("tool_calls", "tool_call_id") if m.get(k)}}
                     for c, m in zip(checked, messages, strict=True))


def template_turns(turns: ChatTurns) -> list[dict[str, str]]:
    """The ``{"role", "content"}`` of each checked turn, as the chat template gets them."""
    return [{"role": t["role"], "content": t["content"]} for t in turns]


def validate_prompt_ids(lm: SessionLM, ids: Sequence[int]) -> None:
    """Non-empty ids inside the vocabulary, leaving room for at least one new token."""
    if not ids:
        msg = "prompt must contain at least one token"
        raise ValueError(msg)
    vocab = lm.vocab_size
    for i, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, numbers.Integral):
            msg = f"prompt token ids must be ints, got {token!r} at position {i}"
            raise TypeError(msg)
        if not 0 <= token < vocab:
            msg = (f"prompt token id {token} at position {i} is outside the vocabulary "
                   f"[0, {vocab}) of {lm.name}")
            raise ValueError(msg)
    if len(ids) >= lm.max_context:
        msg = (f"prompt of {len(ids)} tokens leaves no room for a reply in {window_text(lm)}; "
               "shorten the prompt")
        raise ValueError(msg)


def fit_to_window(lm: SessionLM, prompt_tokens: int, config: GenerationConfig,
                  cache: CacheKind = DEFAULT_CACHE) -> GenerationConfig:
    """``config`` with a token limit the window has room for after the prompt (a reply that
    reaches it ends with ``finish_reason="length"``), as llama.cpp / llama-cpp-python lower
    ``max_tokens`` to what fits instead of refusing the call. The window is what a session
    with ``cache`` can fill (``positions_for``: a torch static cache holds fewer positions than
    the model's window)."""
    positions = lm.positions_for(cache)
    room = positions - prompt_tokens
    if config.max_new_tokens <= room or room < 1:  # no room at all: the prefill says why
        return config
    logger.info("max_new_tokens=%d lowered to %d: the prompt's %d tokens leave that much of %s",
                config.max_new_tokens, room, prompt_tokens, window_text(lm, cache))
    return replace(config, max_new_tokens=room)
