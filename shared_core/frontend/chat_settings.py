"""The settings both chat adapters inherit (``ChatSpeculative``, ``SpeculativeLLM``), and what an
adapter hands the core beside them (:class:`AdapterState`).

Framework-neutral: no LangChain / LlamaIndex import, and no model is touched here. Every
setting is checked when it is set, with the defaults of :mod:`shared_core.config` and the engine
registry; the token limit is the one setting each framework names its own way
(:attr:`ChatSettings.TOKEN_LIMIT`: ``max_tokens`` in LangChain, ``max_new_tokens`` in LlamaIndex).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_serializer,
    field_validator,
    model_validator,
)

from shared_core.config import (
    DEFAULT_BACKEND,
    DEFAULT_LM,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_PASSAGE_CACHE,
    PENALTY_SETTINGS,
    SAMPLING_SETTINGS,
    PassageCacheConfig,
    PenaltyConfig,
    SamplingConfig,
    check_backend,
    check_bool,
    check_int,
    check_prefix_cache,
    check_settings_keys,
)
from shared_core.decoding.output import check_generation_field, logprobs_count
from shared_core.engines.registry import check_engine_name, check_engine_options
from shared_core.frontend.rag_pickle import portable_options
from shared_core.runtime.passage_cache import config_from
from shared_core.util.redact import redacted_dump, redacted_repr_args, strip_credentials

if TYPE_CHECKING:
    from shared_core.runtime.protocol import SessionLM

logger = logging.getLogger(__name__)
DEFAULT_ENGINE = "respec"
MAX_TOKEN_NAMES = ("max_tokens", "max_new_tokens")  # LangChain's word, LlamaIndex's word
LOGPROB_SETTINGS = ("logprobs", "top_logprobs")  # OpenAI's names (ChatOpenAI's, LlamaIndex's OpenAI)
CHAT_SETTINGS = ("model", "engine", "engine_options", *SAMPLING_SETTINGS, *PENALTY_SETTINGS,
                 "stop", "documents", "device", "dtype", "backend", "prefix_cache", "n_ctx",
                 "n_threads", "exact", "passage_cache", "recompute_share",
                 "passage_cache_memory_mb", "passage_cache_disk_mb", *LOGPROB_SETTINGS)
# + one of MAX_TOKEN_NAMES
# what one call may set (both frameworks, both token-limit names); anything else is refused
CALL_OPTIONS = ("engine", "engine_options", "documents", *MAX_TOKEN_NAMES, "stop",
                *SAMPLING_SETTINGS, *PENALTY_SETTINGS, *LOGPROB_SETTINGS, "tools",
                "tool_choice", "parallel_tool_calls",
                "response_format", "model")


class ModelKey(NamedTuple):
    """A model as the shared cache knows it (a tuple, so that it pickles as plain data)."""

    name: str
    device: str | None
    dtype: str | None
    backend: str


@dataclass(frozen=True)
class AdapterState:
    """What a chat call needs from its adapter beside the settings: the model the caller
    preloaded (``lm``), else the one it was before pickling (``reload_as``, loaded by name),
    else neither (the settings' model from the shared cache); and the engines' state kept
    between calls (RAPID's and ReSpec's decoders), filled in by the engines."""

    lm: SessionLM | None = None
    reload_as: ModelKey | None = None
    engine_state: dict[str, Any] = field(default_factory=dict)


class ChatSettings(BaseModel):
    """The settings of both chat adapters, declared once (a changed setting takes effect at the
    next call).

    Args:
        model: a :func:`shared_core.load_lm` alias, hub id or path (ignored when a preloaded
            ``lm`` is given; a per-call ``model=`` loads that model instead).
        engine: a registered token engine (``"respec"``, ``"autoregressive"``, ``"rapid"``).
        engine_options: passed to the engine unchanged (a per-call ``engine`` other than the
            configured one does not get them).
        temperature / top_k / top_p / min_p / seed: sampling
            (:class:`~shared_core.config.SamplingConfig`).
        repeat_penalty / repeat_last_n / frequency_penalty / presence_penalty: llama.cpp's
            penalties (:class:`~shared_core.config.PenaltyConfig`; default: off), applied by
            every engine to every verified row, so speculative output equals penalised greedy
            decoding.
        logprobs / top_logprobs: report each reply token's log-probability (``logprobs=True``)
            and the ``top_logprobs`` (0-20) most likely tokens at its position, as OpenAI's API:
            the model's own distribution, before temperature, filters, penalties and grammar
            (:mod:`shared_core.decoding.logprobs`); ``top_logprobs`` alone turns them on.
        stop: stop strings, cut from the returned text.
        documents: texts the engine may draft from (ReSpec) or read as the long context (RAPID).
        device / dtype: where and how the model loads (a dtype is a torch setting).
        backend: ``"auto"`` (llama.cpp for a GGUF on a CPU when installed, else torch),
            ``"torch"`` or ``"llama.cpp"`` (:func:`shared_core.runtime.models.choose_backend`).
        prefix_cache: the model's prompt-prefix cache, as ``load_lm(prefix_cache=...)``:
            ``None`` (default: on, or what the loaded model has; a preloaded ``lm`` keeps its
            own), ``False`` / ``0`` off, ``n`` idle contexts (llama.cpp) or MiB (torch). Fixed
            when the model loads; a different setting for a loaded model is refused (ValueError
            naming it; release the model first).
        n_ctx / n_threads: a llama.cpp model's positions per session and threads, as
            ``load_lm(n_ctx=..., n_threads=...)`` (None: its defaults); fixed when the model
            loads like ``prefix_cache`` (a preloaded ``lm`` keeps its own; refused for torch).
        exact: load the model in its runtime's exact (batch-invariant) mode, as
            ``load_lm(exact=True)``: a speculative reply is then token-identical to plain
            decoding on llama.cpp too (docs/backends.md); None: off, or what the loaded model
            has. Fixed when the model loads like ``prefix_cache``.
        passage_cache / recompute_share / passage_cache_memory_mb / passage_cache_disk_mb: the
            model's passage (chunk) KV cache, as ``load_lm(passage_cache=...)`` (llama.cpp):
            ``None`` (default: what the model has, else off), ``"exact"`` (prefix blocks,
            token-identical) or ``"blend"`` (passages reused anywhere, ``recompute_share`` of
            their tokens recomputed); the byte budgets of its memory and disk tiers.
    """

    # a ValidationError would echo every setting, a URL's credentials too
    model_config = ConfigDict(hide_input_in_errors=True)

    model: str = Field(default=DEFAULT_LM, description="alias, hub id or path")
    engine: str = Field(default=DEFAULT_ENGINE, description="a shared_core token engine name")
    engine_options: dict[str, Any] = Field(default_factory=dict)
    temperature: float = SamplingConfig.temperature
    top_k: int = SamplingConfig.top_k
    top_p: float = SamplingConfig.top_p
    min_p: float = SamplingConfig.min_p
    seed: int | None = SamplingConfig.seed
    repeat_penalty: float = PenaltyConfig.repeat_penalty
    repeat_last_n: int = PenaltyConfig.repeat_last_n
    frequency_penalty: float = PenaltyConfig.frequency_penalty
    presence_penalty: float = PenaltyConfig.presence_penalty
    logprobs: bool | None = None
    top_logprobs: int | None = None
    stop: list[str] | None = None
    documents: list[str] | None = None
    device: str | None = None
    dtype: str | None = None
    backend: str = DEFAULT_BACKEND
    prefix_cache: bool | int | None = None
    n_ctx: int | None = None
    n_threads: int | None = None
    exact: bool | None = None
    passage_cache: str | None = DEFAULT_PASSAGE_CACHE
    recompute_share: float = PassageCacheConfig.recompute_share
    passage_cache_memory_mb: int = PassageCacheConfig.memory_mb
    passage_cache_disk_mb: int = PassageCacheConfig.disk_mb

    _reload_as: ModelKey | None = PrivateAttr(default=None)
    _engine_state: dict[str, Any] = PrivateAttr(default_factory=dict)  # e.g. RAPID's decoders

    # the adapter's token-limit setting, one of MAX_TOKEN_NAMES (its value None: the default)
    TOKEN_LIMIT: ClassVar[str] = "max_new_tokens"
    # settings a framework passes to any chat model that a local model has no use for (LangChain's
    # standard timeout / max_retries / api_key / base_url): accepted and dropped, not refused
    IGNORED_SETTINGS: ClassVar[tuple[str, ...]] = ()
    # fields not pickled: the preloaded model, and what an adapter derives from its settings
    DERIVED: ClassVar[frozenset[str]] = frozenset({"lm"})

    @model_validator(mode="before")
    @classmethod
    def _known_settings(cls, data: object) -> object:
        if isinstance(data, dict) and any(name in data for name in cls.IGNORED_SETTINGS):
            logger.debug("%s ignores %s: a local model makes no requests", cls.__name__,
                         sorted(set(data) & set(cls.IGNORED_SETTINGS)))
            data = {k: v for k, v in data.items() if k not in cls.IGNORED_SETTINGS}
        return check_settings_keys(cls, data)  # a typo: TypeError with the closest setting

    @field_validator("engine", mode="before")
    @classmethod
    def _known_engine(cls, value: str) -> str:
        return check_engine_name(value)

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, value: str) -> str:
        return check_backend(value)

    @field_validator("prefix_cache", mode="before")
    @classmethod
    def _known_prefix_cache(cls, value: object) -> object:
        check_prefix_cache(value)  # TypeError / ValueError naming it, before any model loads
        return value

    @model_validator(mode="after")
    def _known_engine_options(self) -> ChatSettings:
        check_engine_options(self.engine, self.engine_options)  # before any model loads
        self.passage_cache_config()  # errors name the setting, before any model loads
        return self

    @field_validator(*MAX_TOKEN_NAMES, *SAMPLING_SETTINGS, mode="before", check_fields=False)
    @classmethod
    def _generation_field(cls, value: object, info: ValidationInfo) -> object:
        check_generation_field(str(info.field_name), value)  # TypeError / ValueError naming it
        return value

    @field_validator(*LOGPROB_SETTINGS, mode="before")
    @classmethod
    def _logprob_field(cls, value: object, info: ValidationInfo) -> object:
        alone = (value, None) if info.field_name == "logprobs" else (None, value)
        logprobs_count(*alone)  # TypeError / ValueError naming it (before pydantic's coercion)
        return value

    @model_validator(mode="after")
    def _known_logprobs(self) -> ChatSettings:
        logprobs_count(self.logprobs, self.top_logprobs)  # top_logprobs with logprobs=False
        return self

    @field_validator("n_ctx", "n_threads", mode="before")
    @classmethod
    def _llamacpp_field(cls, value: object, info: ValidationInfo) -> object:
        return check_int(value, str(info.field_name), optional=True)  # None or an int >= 1

    @field_validator("exact", mode="before")
    @classmethod
    def _exact_field(cls, value: object) -> object:
        return value if value is None else check_bool(value, "exact")  # bool("false") is True

    @field_validator(*PENALTY_SETTINGS, mode="before")
    @classmethod
    def _penalty_field(cls, value: object, info: ValidationInfo) -> object:
        setting: dict[str, Any] = {str(info.field_name): value}  # the keyword is chosen at run time
        PenaltyConfig(**setting)  # TypeError / ValueError naming it
        return value

    def passage_cache_config(self) -> PassageCacheConfig | None:
        """The passage-cache settings as a config (None: keep what the model has)."""
        return config_from(self.passage_cache, recompute_share=self.recompute_share,
                           memory_mb=self.passage_cache_memory_mb,
                           disk_mb=self.passage_cache_disk_mb)

    def load_settings(self) -> dict[str, Any]:
        """What the model loads with beside its key (:func:`~shared_core.runtime.model_cache.cached_lm`)."""
        return {"prefix_cache": self.prefix_cache, "n_ctx": self.n_ctx,
                "n_threads": self.n_threads, "exact": self.exact}

    def token_limit(self) -> int:
        """The token-limit setting (``DEFAULT_MAX_NEW_TOKENS`` when it is None)."""
        value: int | None = getattr(self, self.TOKEN_LIMIT, None)
        return DEFAULT_MAX_NEW_TOKENS if value is None else value

    def answering_model(self, lm: SessionLM | None) -> str:
        """The model a reply names: a preloaded ``lm``'s own name, else the ``model`` setting."""
        return lm.name if lm is not None else self.model

    def adapter_state(self, lm: SessionLM | None) -> AdapterState:
        """The state a call of this adapter runs with, ``lm`` being its preloaded model."""
        return AdapterState(lm, self._reload_as, self._engine_state)

    def reduce_with(self, lm: SessionLM | None) -> tuple[Any, ...]:
        """``__reduce__`` of an adapter whose preloaded model is ``lm``: the settings, never the
        weights; a preloaded model is reloaded by name through the shared model cache on first
        use. Credentials in a URL are not pickled."""
        fields = {name: strip_credentials(getattr(self, name))
                  for name in self.model_fields_set - self.DERIVED}
        if "engine_options" in fields:  # only what the engine takes, plain data, no credentials
            fields["engine_options"] = portable_options(self.engine, self.engine_options)
        reload_as = (ModelKey(lm.name, self.device, self.dtype, getattr(lm, "backend", "torch"))
                     if lm is not None else self._reload_as)
        return _rebuild, (type(self), fields, reload_as)

    def __reduce__(self) -> tuple[Any, ...]:
        return self.reduce_with(None)  # an adapter with a preloaded model passes it instead

    def __repr_args__(self) -> Any:
        return redacted_repr_args(super().__repr_args__())

    @field_serializer("*", mode="wrap")
    def _dump_redacted(self, value: object, handler: SerializerFunctionWrapHandler) -> Any:
        """``model_dump`` / ``model_dump_json`` / ``to_dict`` mask URL credentials, like repr."""
        return redacted_dump(handler(value))


def _rebuild(cls: type[ChatSettings], fields: dict[str, Any],
             reload_as: tuple[str, str | None, str | None, str] | None) -> ChatSettings:
    instance = cls(**fields)
    instance._reload_as = None if reload_as is None else ModelKey(*reload_as)
    return instance
