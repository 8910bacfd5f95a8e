"""The round scaffolding every token engine shares: run state, token stream, masks, timing.

A generation is a :class:`Run` (prompt ids, KV session, output tracker, stats, RNG and an optional
:class:`LogitsMask`) plus a generator of committed token blocks, one per round; :class:`TokenStream`
turns the blocks into text deltas and, at the end, a :class:`GenerationResult`. Each engine writes
its round as named steps (draft, verify, accept, commit / roll back, adapt) over these helpers:

- :meth:`Run.masked` / :meth:`Run.masked_tree`: the verification logits with the mask applied
  (no-op without a mask), before acceptance, greedy or sampled;
- :meth:`Run.commit`: the block a round emits, advanced through the mask (and cut where its
  grammar terminates); the engine stops once it returns ``done``;
- :func:`timed`: the one timing helper (adds wall seconds to a stats field or dict key);
- :func:`kept`: an object an engine keeps in its caller's ``engine_state`` between calls.

Cache invariant of the loops: the session holds every committed token except the newest one
(``pending``); each target forward starts with ``pending``, so its first logits row predicts the
first drafted token and no logits are carried between rounds. The first round is
:meth:`Run.opening`: the prompt is read whole and its last row chooses the first token, so the
first token waits for no forward after the prompt's (TTFT is the prefill's time).

Host syncs: a greedy round waits for the device once, in the readback of its verdict
(:mod:`shared_core.runtime.host_sync`): ids are uploaded without waiting, a model draft stays on
the device (:class:`~shared_core.runtime.host_sync.DeviceTokens`) and its tokens come back with
the target's argmaxes in one copy. A sampled draft-model round too: the drafter draws on the
device with its own generator, acceptance runs on the device with the run's (both seeded there),
and the drafted ids, the accepted count and the next token come back in one copy; a logits mask
reads the drafted ids when it masks. ``tests/unit/test_host_syncs.py`` counts them per round.
"""

from __future__ import annotations

import dataclasses
import numbers
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Generator, Hashable, Iterator, Sequence
from typing import Any, Protocol, Self, TypeVar, cast, runtime_checkable

import torch

from shared_core.config import CacheKind, GenerationConfig, check_unicode
from shared_core.decoding.decode_stats import DecodeStats
from shared_core.decoding.logprobs import token_logprobs
from shared_core.decoding.output import (
    ChatTurns,
    GenerationResult,
    OutputTracker,
    fit_to_window,
    template_turns,
    validate_messages,
    validate_prompt_ids,
)
from shared_core.decoding.verify import choose_token, make_generator
from shared_core.engines.timing import timed
from shared_core.runtime.lm import runtime_report
from shared_core.runtime.model_cache import holds_released
from shared_core.runtime.protocol import SessionLM, check_session_lm, open_session
from shared_core.util.device import synchronize

Prompt = str | Sequence[dict[str, str]] | Sequence[int]
Blocks = Generator[list[int], None, None]  # an engine's committed token blocks, one per round


@runtime_checkable
class LogitsMask(Protocol):
    """A constraint on the target's next-token distribution (e.g. a grammar), applied by every
    engine to the target logits before acceptance; without one nothing is masked.

    ``mask(logits, drafted)``: ``logits`` is ``[len(drafted) + 1, vocab]`` from one verification
    forward; row ``i`` scores the token after ``committed + drafted[:i]``. Returns the logits with
    the tokens the constraint forbids at ``-inf`` per row (rows after the first drafted token it
    rejects may come back unmasked: they are never used). Must not change the committed state.

    ``commit(tokens)``: advance by the tokens a round emitted. ``is_terminated()``: the
    constraint is complete; the generation stops there.
    """

    def mask(self, logits: torch.Tensor, drafted: Sequence[int]) -> torch.Tensor: ...

    def commit(self, tokens: Sequence[int]) -> None: ...

    def is_terminated(self) -> bool: ...


def check_logits_mask(mask: object) -> LogitsMask | None:
    """``mask`` if it is None or has ``mask``/``commit``/``is_terminated``, else a TypeError."""
    if mask is not None and not isinstance(mask, LogitsMask):
        msg = ("logits_mask must be None or a LogitsMask (mask(logits, drafted), commit(tokens), "
               f"is_terminated()), got {type(mask).__name__}")
        raise TypeError(msg)
    return mask


def encode_prompt(lm: SessionLM, prompt: Prompt) -> list[int]:
    """Token ids of a prompt string, a list of chat messages, or ids passed through.

    :class:`~shared_core.decoding.output.ChatTurns` were checked at the adapter's edge and are not checked
    again. Ids are checked against the vocabulary (and the window) by :func:`validate_prompt_ids`.
    """
    if isinstance(prompt, ChatTurns):
        return lm.prompt_ids(template_turns(prompt))
    if isinstance(prompt, str):
        return lm.prompt_ids(check_unicode(prompt, "prompt"))
    if isinstance(prompt, Sequence) and not isinstance(prompt, bytes):
        items = list(prompt)
        if items and all(isinstance(t, numbers.Integral) and not isinstance(t, bool)
                         for t in items):
            return [int(cast(numbers.Integral, t)) for t in items]
        if items and all(isinstance(m, dict) for m in items):
            return lm.prompt_ids(validate_messages(items))
        if not items:
            msg = "prompt must not be empty"
            raise ValueError(msg)
    msg = ("prompt must be a string, a list of {'role', 'content'} messages or a list of token "
           f"ids, got {type(prompt).__name__}")
    raise TypeError(msg)


FALLBACK_TURN_STOP = "\nUser:"


def with_turn_stop(lm: SessionLM, prompt: Prompt, config: GenerationConfig) -> GenerationConfig:
    """A base model's plain chat format (``FALLBACK_CHAT_TEMPLATE``, for a model without a chat
    template) has no end-of-turn token: the model would go on to write the user's next turn, so
    that turn's marker stops a reply to chat messages, as llama-cpp-python's chat formats stop
    at theirs."""
    is_chat = isinstance(prompt, ChatTurns) or (
        isinstance(prompt, Sequence) and not isinstance(prompt, str) and bool(prompt)
        and all(isinstance(m, dict) for m in prompt))
    if not is_chat or lm.has_chat_template or FALLBACK_TURN_STOP in config.stop:
        return config
    return dataclasses.replace(config, stop=(*config.stop, FALLBACK_TURN_STOP))


class TokenStream(Iterator[str]):
    """Iterates text deltas (one per committed block); ``result`` is set once it ends.

    A stream that failed (an exception or ``KeyboardInterrupt`` inside a step) or was closed
    never resumes: iterating it again raises ``RuntimeError`` / ``StopIteration`` instead of
    returning a truncated result. Each step runs to completion before the next ``next()``; the
    stream holds no lock between steps (callers sharing a model lock per step, see
    ``shared_core.frontend.serving``).
    """

    def __init__(self, blocks: Blocks, tracker: OutputTracker, stats: DecodeStats,
                 on_close: Callable[[DecodeStats], None] | None = None):
        self._blocks = blocks
        self._tracker = tracker
        self._stats = stats
        self._on_close = on_close
        self._elapsed = 0.0
        self._closed = False
        self._error: str | None = None  # repr only: holding the exception would keep its frames
        # alive in a reference cycle, and torch's inference-mode guards in them could then be
        # restored by the garbage collector in the middle of a later forward
        self.result: GenerationResult | None = None

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> str:
        if self._error is not None:
            msg = f"this generation failed earlier ({self._error}); start a new call"
            raise RuntimeError(msg)
        while self.result is None and not self._closed:
            start = time.perf_counter()
            try:
                block = next(self._blocks, None)
            except BaseException as e:
                self._error = repr(e)
                self._blocks.close()
                raise
            self._elapsed += time.perf_counter() - start
            if block is None:
                return self._close("")
            delta = self._tracker.push(block)
            if self._tracker.done:
                return self._close(delta)
            if delta:
                return delta
        raise StopIteration

    def close(self) -> None:
        """Stop early (frees the engine's generator); ``result`` stays None."""
        self._closed = True
        self._blocks.close()

    def _close(self, delta: str) -> str:
        self._blocks.close()
        self._stats.decode_s = max(0.0, self._elapsed - self._stats.prefill_s)
        delta += self._tracker.finish()
        result = self._tracker.result(self._stats)  # sets new_tokens / finish_reason first
        if self._on_close is not None:
            self._on_close(result.stats)
        self.result = result
        if delta:
            return delta
        raise StopIteration

    def run(self) -> GenerationResult:
        """Consume the stream and return the result."""
        for _ in self:
            pass
        assert self.result is not None
        return self.result


class Run:
    """Per-call state of a token engine: prompt ids, session, tracker, stats, RNG, mask."""

    def __init__(self, lm: SessionLM, prompt: Prompt, config: GenerationConfig, cache: CacheKind,
                 logits_mask: LogitsMask | None = None, *,
                 stats_type: type[DecodeStats] = DecodeStats):
        check_session_lm(lm)
        self.lm = lm
        self.logits_mask = check_logits_mask(logits_mask)
        self.prompt_ids = encode_prompt(lm, prompt)
        validate_prompt_ids(lm, self.prompt_ids)
        config = fit_to_window(lm, len(self.prompt_ids), config, cache)
        self.config = config = with_turn_stop(lm, prompt, config)
        self.session = open_session(lm, cache=cache)
        self.tracker = OutputTracker(lm, config)
        self.stats = stats_type(prompt_tokens=len(self.prompt_ids),
                                **runtime_report({"target": lm}))
        # seeded on the model's device: sampled rounds draw there and read back once
        self.generator = make_generator(config.sampling, lm.device)

    def prefill(self) -> torch.Tensor:
        """Read the whole prompt; the ``[V]`` logits after its last id (the first token's)."""
        self.stats.prefill_s = 0.0
        with timed(self.stats, "prefill_s"):
            logits = self.read_prompt()
            synchronize(self.lm.device)
        assert logits is not None  # the prompt is not empty and a prefill reads its last id
        self.stats.target_forwards += 1  # the prefill's last row gives the first token
        return logits

    def read_prompt(self) -> torch.Tensor | None:
        """Prefill the prompt into the session and record what it reused; its last row."""
        logits = self.session.prefill(self.prompt_ids)
        self.stats.cached_prompt_tokens = self.session.reused_tokens
        report = self.session.passage_report
        if report is not None:  # reused / recomputed / read prompt ids (shared_core.runtime.passage_cache)
            self.stats.extra["passage_cache"] = report.as_dict()
        return logits

    def opening(self) -> Generator[list[int], None, int | None]:
        """The first round: the prompt read and the first token chosen from the read's last row,
        so no forward runs between the prompt and the first token. Yields its block; returns it
        as the next ``pending`` (None when that block ended the generation)."""
        logits = self.prefill()
        token = self.choose(logits)
        block, done = self.commit([token], logits[None])
        yield block
        return None if done else token

    def stream(self, blocks: Callable[[Self], Blocks],
               on_close: Callable[[DecodeStats], None] | None = None) -> TokenStream:
        return TokenStream(blocks(self), self.tracker, self.stats, on_close)

    # -- the mask (every method is a no-op without one)

    def masked(self, logits: torch.Tensor, drafted: Sequence[int] = ()) -> torch.Tensor:
        """``[len(drafted) + 1, V]`` verification logits (or one ``[V]`` row) with the mask."""
        if self.logits_mask is None:
            return logits
        if logits.dim() == 1:
            return self.logits_mask.mask(logits[None], ())[0]
        return self.logits_mask.mask(logits, list(drafted))

    def masked_tree(self, logits: torch.Tensor, tokens: Sequence[int], parents: Sequence[int]
                    ) -> torch.Tensor:
        """Tree-verification logits (row 0: the root, row ``i + 1``: after node ``i``) masked
        branch by branch: a row's mask depends only on its node's ancestors, so rows shared by
        branches get the same mask from each."""
        if self.logits_mask is None:
            return logits
        out = logits.float().clone()
        has_child = set(parents)
        for leaf in [i for i in range(len(tokens)) if i not in has_child] or [-1]:
            path: list[int] = []
            node = leaf
            while node >= 0:
                path.append(node)
                node = parents[node]
            path.reverse()
            rows = [0, *(i + 1 for i in path)]
            masked = self.logits_mask.mask(logits[rows], [tokens[i] for i in path])
            out[rows] = masked.to(out.dtype)  # bf16 / fp16 logits into the float32 copy
        return out

    def choose(self, logits: torch.Tensor) -> int:
        """The next token from one ``[V]`` row (masked; greedy or sampled)."""
        return choose_token(self.masked(logits), self.config.sampling, self.generator)

    def commit(self, block: list[int], logits: torch.Tensor, rows: Sequence[int] | None = None
               ) -> tuple[list[int], bool]:
        """``(block, done)``: the round's tokens advanced through the mask, cut after the token
        that completes it (then ``done``; the tracker reports finish_reason "stop").
        ``logits``: the round's raw target logits; ``block[i]`` was chosen from row ``rows[i]``
        (default: row ``i``), read for its log-probability when the call asks for them."""
        block, done = self._through_mask(block)
        logprobs = self.tracker.logprobs
        if logprobs is not None:
            chosen_from = logits if rows is None else logits[list(rows)]
            logprobs.extend(token_logprobs(chosen_from, block, self.config.top_logprobs or 0,
                                           len(self.lm.tokenizer)))
        return block, done

    def _through_mask(self, block: list[int]) -> tuple[list[int], bool]:
        mask = self.logits_mask
        if mask is None:
            return block, False
        for i, token in enumerate(block):
            mask.commit([token])
            if mask.is_terminated():
                if not self.tracker.done:
                    self.tracker.finish_reason = "stop"
                return block[: i + 1], True
        return block, False


def autoregressive_blocks(run: Run) -> Blocks:
    """Plain decoding: one target forward per token."""
    pending = yield from run.opening()
    while pending is not None:
        logits = run.session.extend([pending])[-1]
        run.stats.target_forwards += 1
        pending = run.choose(logits)
        block, done = run.commit([pending], logits[None])
        yield block
        if done:
            return


_STATE_LOCK = threading.Lock()
T = TypeVar("T")


def kept(engine_state: dict[str, Any], name: str, key: Hashable, build: Callable[[], T],
         keep: int = 2, *, in_use: tuple[object, ...] = ()) -> T:
    """The object kept under ``key`` in ``engine_state[name]`` (the ``keep`` most recently
    used), built by ``build`` when missing. The caller's object holds it, never a module, so it
    lives exactly as long as the caller (see ``engines/registry.py``); objects holding a model
    ``serving.release()`` dropped are let go unless this call runs on it (``in_use``)."""
    with _STATE_LOCK:
        cache: OrderedDict[Hashable, T] = engine_state.setdefault(name, OrderedDict())
        for stale in [k for k, v in cache.items() if holds_released(v, in_use)]:
            del cache[stale]
        value = cache.get(key)
        if value is None:
            value = build()
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > keep:
            cache.popitem(last=False)
        return value
