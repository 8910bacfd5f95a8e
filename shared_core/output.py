"""Turning committed token blocks into returned text: EOS, max tokens, stop strings, deltas."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from shared_core.config import GenerationConfig
from shared_core.models import LM
from shared_core.stats import DecodeStats


@dataclass
class GenerationResult:
    """What every token-level engine returns: new text only, its token ids, and stats."""

    text: str
    token_ids: list[int]
    stats: DecodeStats


class OutputTracker:
    """Accumulates committed tokens and decides when generation is over.

    Stop strings are matched on the decoded text, so a stop that starts inside a multi-token
    accepted block is still honoured: ``text`` ends before the stop string, ``token_ids`` end with
    the token that completed it. EOS tokens end generation and are not returned.
    """

    def __init__(self, lm: LM, config: GenerationConfig):
        self.lm = lm
        self.config = config
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason = ""
        self._emitted = 0
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
        start = max(0, self._emitted - self._longest_stop)
        hits = [i for i in (self.text.find(s, start) for s in self.config.stop) if i >= 0]
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
        return GenerationResult(self.text, list(self.token_ids), stats)


def validate_prompt_ids(lm: LM, ids: Sequence[int], max_new_tokens: int) -> None:
    if len(ids) + max_new_tokens > lm.max_context:
        msg = (f"prompt of {len(ids)} tokens + max_new_tokens={max_new_tokens} exceeds the "
               f"{lm.max_context}-token window of {lm.name}; shorten the prompt or lower "
               "max_new_tokens")
        raise ValueError(msg)
