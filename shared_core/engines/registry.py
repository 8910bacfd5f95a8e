"""Token-level engines by name, with one calling convention (what the chat/LLM adapters use).

Every registered function has the signature::

    fn(lm, prompt, generation, *, documents=None, engine_state=None, **engine_options)
        -> TokenStream

``generation`` is a :class:`~shared_core.config.GenerationConfig` and the option names were
checked by the caller (an adapter's edge, or :func:`stream_engine` for loose arguments): the
entry trusts them. ``documents`` are texts the engine may draft from (ReSpec) or treat as the
long context (RAPID); engines that do not use them ignore them. ``engine_state`` is a dict the
caller keeps between calls (each adapter instance keeps one); an engine may cache reusable state
in it (RAPID: its decoders with the long context's KV; ReSpec: its decoders with their corpus
index), so that state lives exactly as long as the caller, never in a module-level cache that
would keep models alive (RAPID finds the decoders other callers hold through weak references
only). :func:`check_engine_options` checks an engine's options before any model loads. Modules
are imported on first use.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from shared_core.config import SAMPLING_SETTINGS, GenerationConfig, SamplingConfig, check_kwargs
from shared_core.config.tokens import RAPID_OPTIONS, RESPEC_OPTIONS, RapidConfig, ReSpecConfig

if TYPE_CHECKING:
    from shared_core.engines.loop import Prompt, TokenStream
    from shared_core.runtime.protocol import SessionLM

PLAIN_ENGINE = "autoregressive"  # verifies no drafts: runs on any model (Capabilities.rollback)
TOKEN_ENGINES: dict[str, str] = {
    PLAIN_ENGINE: "shared_core.engines.baseline:start_autoregressive",
    "respec": "shared_core.engines.respec:start_respec",
    "rapid": "shared_core.engines.rapid:start_rapid",
}

# per engine: its config (None: none) and its other options; every engine takes a logits_mask
ENGINE_OPTIONS: dict[str, tuple[type | None, tuple[str, ...]]] = {
    "autoregressive": (None, ("cache",)),
    "respec": (ReSpecConfig, RESPEC_OPTIONS),
    "rapid": (RapidConfig, RAPID_OPTIONS),
}


def check_engine_name(name: str) -> str:
    """``name`` if it is a registered token engine, else a ValueError naming the choices (a
    TypeError for a non-string)."""
    if not isinstance(name, str):
        msg = f"engine must be a str, one of {sorted(TOKEN_ENGINES)}; got {type(name).__name__} {name!r:.60}"
        raise TypeError(msg)
    if name not in TOKEN_ENGINES:
        msg = f"engine={name!r} is not one of {sorted(TOKEN_ENGINES)}"
        raise ValueError(msg)
    return name


def check_engine_options(name: str, options: object) -> dict[str, Any]:
    """``options`` if engine ``name`` takes them, checked without importing torch or touching a
    model: an unknown key is a TypeError naming it and the closest valid one, a bad config value
    the config's own TypeError / ValueError naming the field."""
    config, fields = _option_fields(check_engine_name(name))
    if not isinstance(options, dict):
        msg = f"engine_options must be a dict, got {type(options).__name__}"
        raise TypeError(msg)
    check_kwargs(options, fields, f"engine={name!r} (engine_options)")
    if config is not None:
        config(**{key: value for key, value in options.items() if key in _config_fields(config)})
    return options


def _config_fields(config: type) -> set[str]:
    return {f.name for f in dataclasses.fields(config)}


def _option_fields(name: str) -> tuple[type | None, set[str]]:
    """Engine ``name``'s config (None: none) and every option name it takes."""
    config, others = ENGINE_OPTIONS[name]
    fields = _config_fields(config) if config is not None else set()
    return config, fields | {*others, "logits_mask"}


def engine_function(name: str) -> Callable[..., TokenStream]:
    module, attr = TOKEN_ENGINES[check_engine_name(name)].split(":")
    engine: Callable[..., TokenStream] = getattr(importlib.import_module(module), attr)
    return engine


def start_engine(name: str, lm: SessionLM, prompt: Prompt, generation: GenerationConfig, *,
                 documents: Sequence[str] | None = None,
                 engine_state: dict[str, Any] | None = None, **options: Any) -> TokenStream:
    """Start a generation with the named engine, its arguments checked by the caller (an
    adapter's edge: ``name``, ``generation``, ``options``, a message list as
    :class:`~shared_core.decoding.output.ChatTurns`)."""
    module, attr = TOKEN_ENGINES[name].split(":")
    start: Callable[..., TokenStream] = getattr(importlib.import_module(module), attr)
    return start(lm, prompt, generation, documents=documents, engine_state=engine_state, **options)


_GENERATION_ARGUMENTS = ("max_new_tokens", "stop", *SAMPLING_SETTINGS, "documents", "engine_state")


def stream_engine(name: str, lm: SessionLM, prompt: Prompt, *, max_new_tokens: int,
                  documents: Sequence[str] | None = None,
                  engine_state: dict[str, Any] | None = None,
                  stop: Sequence[str] | str | None = None,
                  temperature: float = SamplingConfig.temperature, top_k: int = SamplingConfig.top_k,
                  top_p: float = SamplingConfig.top_p,
                  min_p: float = SamplingConfig.min_p, seed: int | None = None, **options: Any
                  ) -> TokenStream:
    """Start a generation with the named engine from loose arguments, checked here (an option's
    value by the engine's config, before any model work); iterate the stream for text deltas."""
    from shared_core.decoding.output import generation_config  # imports torch: not before a generation

    _, fields = _option_fields(check_engine_name(name))
    # the generation arguments are valid names too: the closest to a misspelt one
    check_kwargs(options, fields | set(_GENERATION_ARGUMENTS), f"engine={name!r}")
    generation = generation_config(max_new_tokens, stop=stop, temperature=temperature,
                                   top_k=top_k, top_p=top_p, min_p=min_p, seed=seed)
    return start_engine(name, lm, prompt, generation, documents=documents,
                        engine_state=engine_state, **options)
