"""Request bodies and response parsing for the servers :class:`RemoteLM` speaks to (no I/O here).

- **vLLM** (checked against 0.32.0, ``vllm/entrypoints/openai/completion/{protocol,serving}.py``):
  ``POST /v1/completions`` with ``prompt`` a list of token-id lists. Generation asks for
  ``return_token_ids`` and ``logprobs=0`` (the chosen token's log-prob). Scoring sends
  ``echo=true, max_tokens=0, logprobs=0``: each choice then carries ``prompt_logprobs`` (one
  ``{token_id: {"logprob": ...}}`` per prompt position, ``None`` first). vLLM skips reading the
  prefix cache for such requests (``skip_reading_prefix_cache`` in ``sampling_params.py``).
- **SGLang** (native ``POST /generate``, ``srt/managers/io_struct.py``): batched ``input_ids``,
  ``sampling_params``, ``return_logprob`` and per-item ``logprob_start_len`` (the prefix before it
  stays cached); ``max_new_tokens: 0`` scores without generating. Each item's ``meta_info`` has
  ``input_token_logprobs`` / ``output_token_logprobs`` as ``[logprob, token_id, text]`` triples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shared_core.config import SamplingConfig


class RemoteProtocolError(RuntimeError):
    """The server answered, but not in the shape this client expects for its engine."""


@dataclass(frozen=True)
class Generation:
    """One generated continuation: new token ids (a stop token included), their log-probs."""

    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str | None


def _sampling_fields(sampling: SamplingConfig) -> dict[str, Any]:
    if sampling.greedy:
        fields: dict[str, Any] = {"temperature": 0.0}
    else:
        fields = {"temperature": sampling.temperature, "top_p": sampling.top_p}
        if sampling.top_k:
            fields["top_k"] = sampling.top_k
        if sampling.min_p:  # vLLM's and SGLang's OpenAI servers take it beside OpenAI's fields
            fields["min_p"] = sampling.min_p
    if sampling.seed is not None:
        fields["seed"] = sampling.seed
    return fields


def _field(obj: object, key: str, what: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        msg = f"server response has no {key!r} in {what}: {str(obj)[:200]}"
        raise RemoteProtocolError(msg)
    return obj[key]


# --------------------------------------------------------------------------- vLLM


def vllm_generate_body(model: str, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                       sampling: SamplingConfig, n: int = 1,
                       stop_token_ids: Sequence[int] = ()) -> dict[str, Any]:
    body = {"model": model, "prompt": [list(p) for p in prompts], "max_tokens": max_new_tokens,
            "n": n, "logprobs": 0, "return_token_ids": True, "skip_special_tokens": False,
            **_sampling_fields(sampling)}
    if stop_token_ids:
        body["stop_token_ids"] = list(stop_token_ids)
    return body


def vllm_parse_generate(response: object, num_prompts: int, n: int) -> list[list[Generation]]:
    """Per prompt, its ``n`` generations (choices come prompt-major, ``index`` = i * n + j)."""
    choices = sorted(_field(response, "choices", "the completion response"),
                     key=lambda c: _field(c, "index", "a choice"))
    if len(choices) != num_prompts * n:
        msg = f"expected {num_prompts * n} choices for {num_prompts} prompts x n={n}, got {len(choices)}"
        raise RemoteProtocolError(msg)
    out: list[list[Generation]] = [[] for _ in range(num_prompts)]
    for c in choices:
        ids = c.get("token_ids")
        if ids is None:
            msg = ("the server returned no token_ids: it does not support return_token_ids "
                   "(vLLM >= 0.10.2 does)")
            raise RemoteProtocolError(msg)
        lp = c.get("logprobs") or {}
        logprobs = lp.get("token_logprobs")
        out[c["index"] // n].append(Generation(list(ids), None if logprobs is None else
                                               [float(x) for x in logprobs], c.get("finish_reason")))
    return out


def vllm_score_body(model: str, rows: Sequence[Sequence[int]]) -> dict[str, Any]:
    return {"model": model, "prompt": [list(r) for r in rows], "max_tokens": 0, "echo": True,
            "logprobs": 0, "prompt_logprobs": 0, "return_token_ids": True, "temperature": 0.0}


def vllm_parse_score(response: object, rows: Sequence[Sequence[int]]) -> list[list[float | None]]:
    """Per row, log P(row[t] | row[:t]) for every position t (``None`` at t = 0)."""
    choices = sorted(_field(response, "choices", "the completion response"),
                     key=lambda c: _field(c, "index", "a choice"))
    if len(choices) != len(rows):
        msg = f"expected {len(rows)} scored rows, got {len(choices)} choices"
        raise RemoteProtocolError(msg)
    out = []
    for row, c in zip(rows, choices, strict=True):
        entries = c.get("prompt_logprobs")
        if entries is None:
            msg = "the server returned no prompt_logprobs for an echo request (batched scoring)"
            raise RemoteProtocolError(msg)
        if len(entries) != len(row):
            msg = f"prompt_logprobs has {len(entries)} positions for a {len(row)}-token row"
            raise RemoteProtocolError(msg)
        out.append([None if e is None else float(_field(e, str(tok), "a prompt_logprobs entry")
                                                 ["logprob"])
                     for tok, e in zip(row, entries, strict=True)])
    return out


# --------------------------------------------------------------------------- SGLang


def sglang_generate_body(prompts: Sequence[Sequence[int]], max_new_tokens: int,
                         sampling: SamplingConfig, stop_token_ids: Sequence[int] = ()
                         ) -> dict[str, Any]:
    params: dict[str, Any] = {"max_new_tokens": max_new_tokens, **_sampling_fields(sampling)}
    params.pop("seed", None)
    if stop_token_ids:
        params["stop_token_ids"] = list(stop_token_ids)
    # logprob_start_len stays at its default -1: log-probs of the output tokens only, and the
    # prompt may be served from the radix cache.
    body: dict[str, Any] = {"input_ids": [list(p) for p in prompts], "sampling_params": params,
                            "return_logprob": True}
    if sampling.seed is not None:
        params["sampling_seed"] = sampling.seed
    return body


def _items(response: Any, count: int) -> list[dict[str, Any]]:
    items = response if isinstance(response, list) else [response]
    if len(items) != count:
        msg = f"expected {count} items from /generate, got {len(items)}"
        raise RemoteProtocolError(msg)
    return items


def sglang_parse_generate(response: object, num_prompts: int) -> list[Generation]:
    out = []
    for item in _items(response, num_prompts):
        meta = _field(item, "meta_info", "a /generate item")
        triples = meta.get("output_token_logprobs")
        ids = item.get("output_ids")
        if ids is None and triples is not None:
            ids = [t[1] for t in triples]
        if ids is None:
            raise RemoteProtocolError("a /generate item has neither output_ids nor output_token_logprobs")
        reason = meta.get("finish_reason")
        out.append(Generation(list(ids), None if triples is None else [float(t[0]) for t in triples],
                              reason.get("type") if isinstance(reason, dict) else reason))
    return out


def sglang_score_body(rows: Sequence[Sequence[int]], starts: Sequence[int]) -> dict[str, Any]:
    """Score ``rows`` from position ``starts[i]`` on (the tokens before it stay cached)."""
    return {"input_ids": [list(r) for r in rows],
            "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
            "return_logprob": True, "logprob_start_len": list(starts), "top_logprobs_num": 0}


def sglang_parse_score(response: object, rows: Sequence[Sequence[int]], starts: Sequence[int]
                       ) -> list[list[float | None]]:
    """Per row, log-probs of positions ``starts[i]..len(row)-1`` (earlier positions ``None``)."""
    out: list[list[float | None]] = []
    for row, start, item in zip(rows, starts, _items(response, len(rows)), strict=True):
        triples = _field(_field(item, "meta_info", "a /generate item"), "input_token_logprobs",
                         "meta_info")
        if len(triples) != len(row) - start:
            msg = f"input_token_logprobs has {len(triples)} entries for positions {start}..{len(row) - 1}"
            raise RemoteProtocolError(msg)
        values: list[float | None] = [None] * start
        values += [None if t[0] is None else float(t[0]) for t in triples]
        out.append(values)
    return out


# --------------------------------------------------------------------------- metrics


def parse_metrics(text: str, names: Sequence[str]) -> dict[str, float]:
    """Sum of each named Prometheus counter/gauge over its label sets (text exposition format)."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        name = key.split("{", 1)[0]
        if name in names:
            try:
                totals[name] = totals.get(name, 0.0) + float(value)
            except ValueError:
                continue
    return totals
