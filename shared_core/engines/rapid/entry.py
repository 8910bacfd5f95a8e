"""The registry entry of RAPID (``engine="rapid"``): prompt splitting and decoders kept in the
caller's engine state."""

from __future__ import annotations

import dataclasses
import inspect
import weakref
from collections.abc import Sequence
from typing import Any

from shared_core.config import (
    DEFAULT_EMBEDDER,
    GenerationConfig,
    SamplingConfig,
    check_kwargs,
)
from shared_core.config.tokens import RapidConfig
from shared_core.decoding.output import ChatTurns, generation_config, validate_messages
from shared_core.engines.loop import LogitsMask, Prompt, TokenStream, kept
from shared_core.engines.rapid.engine import DEFAULT_METHOD, RapidDecoder
from shared_core.retrieval.base import Encoder
from shared_core.runtime.protocol import SessionLM


def split_prompt(prompt: Prompt, documents: Sequence[str] | None) -> tuple[str, str]:
    """(long context, query) from a registry call.

    The query is the last user message. The long context is ``documents`` joined by blank lines
    or, without documents, the prompt's context section: the text before the last
    ``"Question:"`` / ``"Query:"`` in the last user message (LlamaIndex's QA prompt), else the
    other messages' contents.
    """
    messages = _as_messages(prompt)
    users = [i for i, m in enumerate(messages) if m["role"] == "user"]
    if not users:
        msg = "prompt has no user message to take the query from"
        raise ValueError(msg)
    if documents is not None:
        return _documents_context(documents), messages[users[-1]]["content"]
    return _context_in_message(messages, users[-1])


def _as_messages(prompt: Prompt) -> list[dict[str, str]]:
    """The prompt as chat messages: a text is one user message; token ids are a TypeError."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, ChatTurns):  # checked at the adapter's edge
        return prompt
    if isinstance(prompt, Sequence) and prompt and all(isinstance(m, dict) for m in prompt):
        return validate_messages(prompt)
    msg = ("RAPID needs a text prompt or chat messages as the prompt (not token ids), got "
           f"{type(prompt).__name__}")
    raise TypeError(msg)


def _documents_context(documents: Sequence[str]) -> str:
    """The long context from ``documents``: the non-blank texts joined by blank lines."""
    if isinstance(documents, str) or not all(isinstance(d, str) for d in documents):
        msg = "documents must be a list of strings (the long context)"
        raise TypeError(msg)
    docs = [d for d in documents if d.strip()]
    if not docs:
        msg = "documents must contain at least one non-empty text (the long context)"
        raise ValueError(msg)
    return "\n\n".join(docs)


def _context_in_message(messages: list[dict[str, str]], last_user: int) -> tuple[str, str]:
    """(long context, query) without documents: the text before the last ``"Question:"`` /
    ``"Query:"`` in the last user message (a leading ``"Context:"`` dropped), else the other
    messages' contents with the whole last user message as the query."""
    last = messages[last_user]["content"]
    lowered = last.lower()
    cut = max(lowered.rfind("question:"), lowered.rfind("query:"))
    if cut > 0 and last[:cut].strip():
        context = last[:cut].strip()
        if context.lower().startswith("context:"):
            context = context[len("context:"):].strip()
        return context, last[cut:].strip()
    others = "\n\n".join(m["content"] for i, m in enumerate(messages)
                         if i != last_user and m["content"].strip())
    if not others:
        msg = ("RAPID needs a long context: pass documents=[...] or put the context before "
               "'Question:' in the user message (or in a system message)")
        raise ValueError(msg)
    return others, last


# Decoders some caller's engine_state holds, found by key by every other caller (two adapters on
# one model share the document's KV); weak, so it never keeps a decoder or its model alive.
_LIVE_DECODERS: weakref.WeakValueDictionary[tuple[Any, ...], RapidDecoder] = (
    weakref.WeakValueDictionary())


def _shared_decoder(lm: SessionLM, draft_lm: SessionLM | None, embedder: Encoder | str, config: RapidConfig,
                    engine_state: dict[str, Any] | None) -> RapidDecoder:
    """A decoder kept in the caller's ``engine_state`` (two per state, most recent first), so
    follow-up questions on one document reuse its KV; without a state, a new decoder.

    A decoder another caller's state holds for the same models and options is shared (LangChain
    and LlamaIndex adapters on one model read a document once). Only callers' objects (adapter
    instances) hold decoders, never this module, so none keeps a model alive after its callers
    are gone.
    """
    if engine_state is None:
        return RapidDecoder(lm, draft_lm=draft_lm, embedder=embedder, config=config)
    embedder_key = embedder if isinstance(embedder, str) else id(embedder)
    key = (id(lm), id(draft_lm), embedder_key, config)  # the decoder keeps these objects alive

    def live_or_new() -> RapidDecoder:
        decoder = _LIVE_DECODERS.get(key)
        if decoder is None or decoder.lm is not lm or decoder.draft_lm is not (draft_lm or lm):
            decoder = RapidDecoder(lm, draft_lm=draft_lm, embedder=embedder, config=config)
            _LIVE_DECODERS[key] = decoder
        return decoder

    return kept(engine_state, "rapid_decoders", key, live_or_new, in_use=(lm, draft_lm or lm))


def stream_rapid(lm: SessionLM, prompt: Prompt, *, max_new_tokens: int,
                 documents: Sequence[str] | None = None, stop: Sequence[str] | str | None = None,
                 temperature: float = SamplingConfig.temperature, top_k: int = SamplingConfig.top_k,
                 top_p: float = SamplingConfig.top_p, min_p: float = SamplingConfig.min_p,
                 seed: int | None = None, method: str = DEFAULT_METHOD, decoder: RapidDecoder | None = None,
                 draft_lm: SessionLM | None = None, embedder: Encoder | str = DEFAULT_EMBEDDER,
                 engine_state: dict[str, Any] | None = None,
                 logits_mask: LogitsMask | None = None, **config_options: Any) -> TokenStream:
    """RAPID with loose arguments, checked here (see :func:`start_rapid`)."""
    entry_arguments = set(inspect.signature(stream_rapid).parameters) - {"config_options"}
    check_kwargs(config_options, {f.name for f in dataclasses.fields(RapidConfig)}
                 | entry_arguments, "the RAPID engine")
    generation = generation_config(max_new_tokens, stop=stop, temperature=temperature,
                                   top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    return start_rapid(lm, prompt, generation, documents=documents, method=method,
                       decoder=decoder, draft_lm=draft_lm, embedder=embedder,
                       engine_state=engine_state, logits_mask=logits_mask, **config_options)


def start_rapid(lm: SessionLM, prompt: Prompt, generation: GenerationConfig, *,
                documents: Sequence[str] | None = None, method: str = DEFAULT_METHOD,
                decoder: RapidDecoder | None = None, draft_lm: SessionLM | None = None,
                embedder: Encoder | str = DEFAULT_EMBEDDER, engine_state: dict[str, Any] | None = None,
                logits_mask: LogitsMask | None = None, **config_options: Any) -> TokenStream:
    """Registry entry (``engine="rapid"``): see ``engines/registry.py`` for the convention;
    ``generation`` and the option names were checked by the caller.

    Engine options: ``method`` (``"rapid"``, ``"sd"``, ``"long_context"``, ``"rag"``), a ready
    ``decoder``, ``draft_lm``, ``embedder`` and any :class:`RapidConfig` field (``eta``,
    ``gamma``, ``alpha``, ...). Without ``decoder``, a decoder kept in ``engine_state`` (the
    adapters pass one dict per instance) is reused across calls with the same models and
    options, so follow-up questions on one document skip its prefill.
    """
    context, query = split_prompt(prompt, documents)
    if decoder is None:
        decoder = _shared_decoder(lm, draft_lm, embedder, RapidConfig(**config_options),
                                  engine_state)
    elif decoder.lm is not lm:
        msg = "decoder was built for another target model than lm"
        raise ValueError(msg)
    return decoder.start(context, query, generation, method=method,
                         eta=config_options.get("eta"), logits_mask=logits_mask)
