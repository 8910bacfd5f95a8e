"""What the token-engine chat adapters share: ``ChatSpeculative`` (LangChain) and
``SpeculativeLLM`` (LlamaIndex).

Framework-neutral (no LangChain / LlamaIndex import; the engines, and with them torch, are
imported when a generation starts), so the two adapters accept the same settings and behave the
same; each keeps only its framework's message and response conversion:

- **settings**: :class:`ChatSettings` declares the fields both inherit, with the defaults of
  :mod:`shared_core.config` (model, sampling) and the engine registry; the token limit is the
  one setting each framework names its own way (``max_tokens`` in LangChain,
  ``max_new_tokens`` in LlamaIndex; per call both names are accepted by both);
- **one call**: :func:`prepare_call` resolves the per-call options against the settings and
  validates them (TypeError / ValueError naming the option) before any model is loaded;
- **locking** (see :mod:`shared_core.serving`): :meth:`ChatCall.run` holds the model's lock for
  the whole generation, :meth:`ChatCall.steps` takes it for one step at a time and never while
  the caller reads;
- **reporting**: :func:`call_report` is the usage and engine stats both attach to a response.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field, ValidationInfo, field_validator

from shared_core.config import DEFAULT_LM, DEFAULT_MAX_NEW_TOKENS, SamplingConfig
from shared_core.engines.registry import check_engine, stream_engine
from shared_core.output import check_generation_field, generation_config
from shared_core.serving import FairLock, loaded_model, lock_for, step_locked

if TYPE_CHECKING:
    from shared_core.engines.baseline import Prompt, TokenStream
    from shared_core.output import GenerationResult

DEFAULT_ENGINE = "respec"
MAX_TOKEN_NAMES = ("max_tokens", "max_new_tokens")  # LangChain's word, LlamaIndex's word
CHAT_SETTINGS = ("model", "engine", "engine_options", "temperature", "top_k", "top_p", "seed",
                 "stop", "documents", "device", "dtype")  # plus one of MAX_TOKEN_NAMES


class ChatSettings(BaseModel):
    """The settings of both chat adapters, declared once (a changed setting takes effect at the
    next call).

    Args:
        model: a :func:`shared_core.load_lm` alias, hub id or path (ignored when a preloaded
            ``lm`` is given; a per-call ``model=`` loads that model instead).
        engine: a registered token engine (``"respec"``, ``"autoregressive"``, ``"rapid"``).
        engine_options: passed to the engine unchanged (a per-call ``engine`` other than the
            configured one does not get them).
        temperature / top_k / top_p / seed: sampling (:class:`~shared_core.config.SamplingConfig`).
        stop: stop strings, cut from the returned text.
        documents: texts the engine may draft from (ReSpec) or read as the long context (RAPID).
        device / dtype: where and how the model loads.
    """

    model: str = Field(default=DEFAULT_LM, description="alias, hub id or path")
    engine: str = Field(default=DEFAULT_ENGINE, description="a shared_core token engine name")
    engine_options: dict[str, Any] = Field(default_factory=dict)
    temperature: float = SamplingConfig.temperature
    top_k: int = SamplingConfig.top_k
    top_p: float = SamplingConfig.top_p
    seed: int | None = SamplingConfig.seed
    stop: list[str] | None = None
    documents: list[str] | None = None
    device: str | None = None
    dtype: str | None = None

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, value: str) -> str:
        return check_engine(value)

    @field_validator(*MAX_TOKEN_NAMES, "temperature", "top_k", "top_p", "seed", mode="before",
                     check_fields=False)
    @classmethod
    def _generation_field(cls, value: Any, info: ValidationInfo) -> Any:
        check_generation_field(info.field_name, value)  # TypeError / ValueError naming it
        return value


def resolve_model(settings: Any, lm: Any, override: str | None = None) -> tuple[Any, FairLock]:
    """The model of one call and its lock: a per-call ``model`` other than the setting, else the
    preloaded ``lm``, else the shared cache's (looked up per call, so ``serving.release`` frees
    it)."""
    if override is not None and override != settings.model:
        return loaded_model(override, settings.device, settings.dtype)
    if lm is not None:
        return lm, lock_for(lm)
    return loaded_model(settings.model, settings.device, settings.dtype)


@dataclass
class ChatCall:
    """One validated call: the engine stream to start and the model lock it runs under."""

    engine: str
    lm: Any
    lock: FairLock
    prompt: Prompt
    max_new_tokens: int
    documents: list[str] | None
    engine_state: dict[str, Any]
    sampling: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)

    def start(self) -> TokenStream:
        return stream_engine(self.engine, self.lm, self.prompt,
                             max_new_tokens=self.max_new_tokens, documents=self.documents,
                             engine_state=self.engine_state, **self.sampling, **self.options)

    def run(self) -> GenerationResult:
        """The whole generation under the lock (nothing is yielded to the caller in between)."""
        with self.lock:
            return self.start().run()

    def steps(self) -> Iterator[tuple[str, GenerationResult | None]]:
        """``(delta, None)`` per step, then ``("", result)``; the lock is taken per step, never
        while the caller reads."""
        with self.lock:
            stream = self.start()
        for delta in step_locked(self.lock, stream):
            yield delta, None
        assert stream.result is not None
        yield "", stream.result


def prepare_call(settings: Any, prompt: Prompt, kwargs: dict[str, Any], *, lm: Any,
                 engine_state: dict[str, Any], limit_name: str, text_of: str) -> ChatCall:
    """Resolve and validate one call's options (``kwargs`` is consumed) before any model work.

    ``limit_name`` is the adapter's token-limit setting (its value ``None``: the config's
    default); ``text_of`` the attribute holding a framework document's text (a string passes as
    is). A per-call ``None`` for ``stop``, ``documents`` or the token limit means the setting.
    """
    engine = check_engine(kwargs.pop("engine", settings.engine))
    # the configured options belong to the configured engine; a per-call engine gets its own
    base = settings.engine_options if engine == settings.engine else {}
    options = {**base, **kwargs.pop("engine_options", {})}
    documents = kwargs.pop("documents", None)
    documents = settings.documents if documents is None else documents
    name = next((n for n in MAX_TOKEN_NAMES if n in kwargs), limit_name)
    per_call = [kwargs.pop(n, None) for n in MAX_TOKEN_NAMES]
    limit = next((v for v in (*per_call, getattr(settings, limit_name)) if v is not None),
                 DEFAULT_MAX_NEW_TOKENS)
    stop = kwargs.pop("stop", None)
    sampling = {"stop": settings.stop if stop is None else stop,
                **{k: kwargs.pop(k, getattr(settings, k))
                   for k in ("temperature", "top_k", "top_p", "seed")}}
    generation_config(limit, name=name, **sampling)
    model, lock = resolve_model(settings, lm, kwargs.pop("model", None))
    texts = None if documents is None else [getattr(d, text_of, d) for d in documents]
    return ChatCall(engine, model, lock, prompt, limit, texts, engine_state, sampling, options)


def call_report(result: GenerationResult, engine: str, model: str) -> dict[str, Any]:
    """Usage and engine stats of one call, as both adapters attach them to a response."""
    stats = result.stats
    return {"engine": engine, "model": model, "finish_reason": stats.finish_reason,
            "prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.new_tokens,
            "speculative_stats": stats.as_dict()}
