"""What the token-engine chat adapters share: ``ChatSpeculative`` (LangChain) and
``SpeculativeLLM`` (LlamaIndex).

Framework-neutral (no LangChain / LlamaIndex import; the engines, and with them torch, are
imported when a generation starts), so the two adapters accept the same settings and behave the
same; each keeps only its framework's message and response conversion:

- **settings**: :class:`ChatSettings` declares the fields both inherit, with the defaults of
  :mod:`shared_core.config` (model, sampling) and the engine registry; the token limit is the
  one setting each framework names its own way (``max_tokens`` in LangChain,
  ``max_new_tokens`` in LlamaIndex; per call both names are accepted by both);
- **one call**: :func:`check_call` resolves the per-call options against the settings and
  validates them once (TypeError / ValueError naming the option), into a :class:`CallRequest`
  (a :class:`~shared_core.config.GenerationConfig`, the messages as
  :class:`~shared_core.decoding.output.ChatTurns`) that the engines take unchecked, before any model is
  loaded; :func:`start_call` then resolves the model (:func:`prepare_call`: both);
- **locking** (see :mod:`shared_core.frontend.serving`): :meth:`ChatCall.run` holds the model's lock for
  the whole generation, :meth:`ChatCall.steps` takes it for one step at a time and never while
  the caller reads;
- **replies with tools**: :meth:`ChatCall.reply_steps` streams content deltas and tool calls as
  they complete (:class:`~shared_core.decoding.tool_calls.ReplyScanner`), :meth:`ChatCall.parse` splits a
  whole reply the same way, so both adapters stream what they return when invoked;
- **reporting**: :func:`call_report` is the usage and engine stats both attach to a response.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

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
    GenerationConfig,
    PassageCacheConfig,
    SamplingConfig,
    check_backend,
    check_kwargs,
    check_prefix_cache,
    check_settings_keys,
)
from shared_core.decoding.constrained import (
    Constraint,
    check_json_schema,
    grammar_mask,
    xgrammar_available,
)
from shared_core.decoding.output import ChatTurns, chat_turns, check_generation_field, generation_config
from shared_core.decoding.tool_calls import (
    InvalidToolCall,
    ReplyScanner,
    ToolCall,
    auto_calls,
    check_tool_choice,
    check_tools,
    forced_call,
    parse_tool_calls,
    render_prompt,
    tool_names,
)
from shared_core.engines.registry import check_engine_name, check_engine_options, start_engine
from shared_core.frontend.rag_pickle import portable_options
from shared_core.frontend.serving import FairLock, loaded_model, lock_for, step_locked
from shared_core.retrieval.frameworks import to_documents
from shared_core.runtime.passage_cache import config_from
from shared_core.runtime.passage_cache import ensure as ensure_passage_cache
from shared_core.util.redact import redacted_dump, redacted_repr_args, strip_credentials

if TYPE_CHECKING:
    from shared_core.decoding.output import GenerationResult
    from shared_core.engines.loop import Prompt, TokenStream

logger = logging.getLogger(__name__)
DEFAULT_ENGINE = "respec"
MAX_TOKEN_NAMES = ("max_tokens", "max_new_tokens")  # LangChain's word, LlamaIndex's word
CHAT_SETTINGS = ("model", "engine", "engine_options", "temperature", "top_k", "top_p", "seed",
                 "stop", "documents", "device", "dtype", "backend", "prefix_cache", "passage_cache",
                 "recompute_share", "passage_cache_memory_mb", "passage_cache_disk_mb")
# + one of MAX_TOKEN_NAMES
# what one call may set (both frameworks, both token-limit names); anything else is refused
CALL_OPTIONS = ("engine", "engine_options", "documents", *MAX_TOKEN_NAMES, "stop", "temperature",
                "top_k", "top_p", "seed", "tools", "tool_choice", "response_format", "model")


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
        device / dtype: where and how the model loads (a dtype is a torch setting).
        backend: ``"auto"`` (llama.cpp for a GGUF on a CPU when installed, else torch),
            ``"torch"`` or ``"llama.cpp"`` (:func:`shared_core.runtime.models.choose_backend`).
        prefix_cache: the model's prompt-prefix cache, as ``load_lm(prefix_cache=...)``:
            ``None`` (default: on, or what the loaded model has; a preloaded ``lm`` keeps its
            own), ``False`` / ``0`` off, ``n`` idle contexts (llama.cpp) or MiB (torch). Fixed
            when the model loads; a different setting for a loaded model is refused (ValueError
            naming it; release the model first).
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
    seed: int | None = SamplingConfig.seed
    stop: list[str] | None = None
    documents: list[str] | None = None
    device: str | None = None
    dtype: str | None = None
    backend: str = DEFAULT_BACKEND
    prefix_cache: bool | int | None = None
    passage_cache: str | None = DEFAULT_PASSAGE_CACHE
    recompute_share: float = PassageCacheConfig.recompute_share
    passage_cache_memory_mb: int = PassageCacheConfig.memory_mb
    passage_cache_disk_mb: int = PassageCacheConfig.disk_mb

    _reload_as: tuple[str, str | None, str | None, str] | None = PrivateAttr(default=None)

    # settings a framework passes to any chat model that a local model has no use for (LangChain's
    # standard timeout / max_retries / api_key / base_url): accepted and dropped, not refused
    IGNORED_SETTINGS: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _known_settings(cls, data: Any) -> Any:
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
    def _known_prefix_cache(cls, value: Any) -> Any:
        check_prefix_cache(value)  # TypeError / ValueError naming it, before any model loads
        return value

    @model_validator(mode="after")
    def _known_engine_options(self) -> ChatSettings:
        check_engine_options(self.engine, self.engine_options)  # before any model loads
        self.passage_cache_config()  # errors name the setting, before any model loads
        return self

    def passage_cache_config(self) -> PassageCacheConfig | None:
        """The passage-cache settings as a config (None: keep what the model has)."""
        return config_from(self.passage_cache, recompute_share=self.recompute_share,
                           memory_mb=self.passage_cache_memory_mb,
                           disk_mb=self.passage_cache_disk_mb)

    def _preloaded_lm(self) -> Any:
        """The LM passed in by the caller (None: the shared cache's)."""
        return None

    def __repr_args__(self) -> Any:
        return redacted_repr_args(super().__repr_args__())  # type: ignore[misc]

    @field_serializer("*", mode="wrap")
    def _dump_redacted(self, value: Any, handler: SerializerFunctionWrapHandler) -> Any:
        """``model_dump`` / ``model_dump_json`` / ``to_dict`` mask URL credentials, like repr."""
        return redacted_dump(handler(value))

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle the settings, never the weights: an instance built with a preloaded ``lm``
        reloads that model by name through the shared model cache on first use. Credentials
        in a URL are not pickled."""
        fields = {name: strip_credentials(getattr(self, name))
                  for name in self.model_fields_set if name != "lm"}
        if "engine_options" in fields:  # only what the engine takes, plain data, no credentials
            fields["engine_options"] = portable_options(self.engine, self.engine_options)
        lm = self._preloaded_lm()
        reload_as = ((lm.name, self.device, self.dtype, getattr(lm, "backend", "torch"))
                     if lm is not None else self._reload_as)
        return _rebuild, (type(self), fields, reload_as)

    @field_validator(*MAX_TOKEN_NAMES, "temperature", "top_k", "top_p", "seed", mode="before",
                     check_fields=False)
    @classmethod
    def _generation_field(cls, value: Any, info: ValidationInfo) -> Any:
        check_generation_field(info.field_name, value)  # TypeError / ValueError naming it
        return value


def _rebuild(cls: type[ChatSettings], fields: dict[str, Any],
             reload_as: tuple[str, str | None, str | None, str] | None) -> ChatSettings:
    instance = cls(**fields)
    instance._reload_as = reload_as
    return instance


def resolve_model(settings: Any, lm: Any, override: str | None = None) -> tuple[Any, FairLock]:
    """The model of one call and its lock: a per-call ``model`` other than the setting, else the
    preloaded ``lm`` (after unpickling: the model it was, by name), else the shared cache's
    (looked up per call, so ``serving.release`` frees it)."""
    model, lock = _resolve(settings, lm, override)
    with lock:
        ensure_passage_cache(model, settings.passage_cache_config())
    return model, lock


def _resolve(settings: Any, lm: Any, override: str | None) -> tuple[Any, FairLock]:
    prefix_cache = settings.prefix_cache
    if override is not None and override != settings.model:
        return loaded_model(override, settings.device, settings.dtype, settings.backend,
                            prefix_cache)
    if lm is not None:
        return lm, lock_for(lm)
    if settings._reload_as is not None:
        return loaded_model(*settings._reload_as, prefix_cache)
    return loaded_model(settings.model, settings.device, settings.dtype, settings.backend,
                        prefix_cache)


def check_response_format(response_format: Any) -> Constraint | None:
    """``{"type": "json_object"}`` (any JSON object) or ``{"type": "json_schema", "schema":
    {...}}`` (also OpenAI's ``{"json_schema": {"schema": {...}}}``) as a :class:`Constraint`."""
    if response_format is None or isinstance(response_format, Constraint):
        return response_format
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "json_object":
        return Constraint("json")
    if kind == "json_schema":
        schema = response_format.get("schema") or (response_format.get("json_schema") or {}
                                                   ).get("schema")
        return Constraint("json_schema", check_json_schema(schema, "response_format schema"))
    msg = ("response_format must be {'type': 'json_object'} or {'type': 'json_schema', "
           f"'schema': {{...}}}}, got {response_format!r:.80}")
    raise ValueError(msg)


def _with_format_instruction(turns: list[dict[str, Any]], constraint: Constraint
                             ) -> list[dict[str, Any]]:
    """The conversation with the expected JSON named in its system turn."""
    if constraint.kind == "json_schema":
        text = ("Respond only with a JSON object that matches this JSON schema:\n"
                + json.dumps(constraint.schema, ensure_ascii=False))
    else:
        text = "Respond only with a JSON object."
    if turns and turns[0]["role"] == "system":
        return [{**turns[0], "content": f"{turns[0]['content']}\n\n{text}".strip()}, *turns[1:]]
    return [{"role": "system", "content": text}, *turns]


@dataclass
class CallRequest:
    """One call's input, checked once by :func:`check_call` (no model touched yet): the engines
    take it as it is."""

    engine: str
    prompt: Prompt  # ChatTurns, a formatted prompt string, or token ids
    generation: GenerationConfig
    documents: list[str] | None
    options: dict[str, Any]
    tools: list[dict[str, Any]]
    tool_choice: str
    constraint: Constraint | None
    model: str | None  # a per-call model (None: the settings')


@dataclass
class ChatCall:
    """One validated call: the engine stream to start and the model lock it runs under."""

    engine: str
    lm: Any
    lock: FairLock
    prompt: Prompt
    generation: GenerationConfig
    documents: list[str] | None
    engine_state: dict[str, Any]
    options: dict[str, Any] = field(default_factory=dict)
    tools: list[str] = field(default_factory=list)  # names parsed from the reply ([]: none)
    prefill: str = ""  # the forced beginning of the reply (a tool call), already in the prompt
    constraint: Constraint | None = None  # the grammar every engine row is masked with

    def start(self) -> TokenStream:
        options = dict(self.options)
        if self.constraint is not None:  # every registered engine masks drafts and targets
            options["logits_mask"] = grammar_mask(self.lm, self.constraint)  # one per generation
        return start_engine(self.engine, self.lm, self.prompt, self.generation,
                            documents=self.documents, engine_state=self.engine_state, **options)

    def parse(self, text: str) -> tuple[str, list[ToolCall], list[InvalidToolCall]]:
        """``(content, tool calls, invalid tool calls)`` of a reply."""
        if not self.tools:
            return text, [], []
        return parse_tool_calls(text, self.tools, self.prefill)

    def reply_steps(self) -> Iterator[tuple[str, list[ToolCall | InvalidToolCall],
                                            GenerationResult | None]]:
        """:meth:`steps` as ``(content delta, tool calls completed, None)``, then the rest and
        the result. With tools, the text of a call never shows in the content (a possible
        partial ``<tool_call>`` is held back); without, the deltas pass unchanged."""
        scanner = ReplyScanner(self.tools, self.prefill) if self.tools else None
        for delta, result in self.steps():
            if scanner is None:
                yield delta, [], result
            elif result is None:
                yield *scanner.feed(delta), None
            else:
                yield *scanner.close(), result

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


def check_call(settings: Any, prompt: Prompt, kwargs: dict[str, Any], *, limit_name: str
               ) -> CallRequest:
    """Resolve and validate one call's options (``kwargs`` is consumed) before any model work.

    ``limit_name`` is the adapter's token-limit setting (its value ``None``: the config's
    default). A message list is checked into :class:`~shared_core.decoding.output.ChatTurns`.
    ``documents`` may be strings, our documents or either framework's documents / nodes
    (:func:`~shared_core.retrieval.frameworks.to_documents`). A per-call ``None`` for ``stop``,
    ``documents`` or the token limit means the setting. An option not in :data:`CALL_OPTIONS`
    (``max_token=16``) is a TypeError naming the closest one.
    """
    check_kwargs(kwargs, CALL_OPTIONS, type(settings).__name__)
    engine = kwargs.pop("engine", settings.engine)
    options = _engine_options(settings, engine, kwargs.pop("engine_options", None) or {})
    documents = kwargs.pop("documents", None)
    documents = settings.documents if documents is None else documents
    name = next((n for n in MAX_TOKEN_NAMES if n in kwargs), limit_name)
    per_call = [kwargs.pop(n, None) for n in MAX_TOKEN_NAMES]
    limit = next((v for v in (*per_call, getattr(settings, limit_name)) if v is not None),
                 DEFAULT_MAX_NEW_TOKENS)
    stop = kwargs.pop("stop", None)
    sampling = {k: kwargs.pop(k, getattr(settings, k)) for k in ("temperature", "top_k", "top_p",
                                                                 "seed")}
    generation = generation_config(limit, name=name, stop=settings.stop if stop is None else stop,
                                   **sampling)
    tools = check_tools(kwargs.pop("tools", None) or ())
    choice = check_tool_choice(kwargs.pop("tool_choice", None), tools) if tools else "none"
    constraint = check_response_format(kwargs.pop("response_format", None))
    texts = None if documents is None else [d.text for d in to_documents(documents)]
    return CallRequest(engine, _checked_prompt(prompt), generation, texts, options, tools, choice,
                       constraint, kwargs.pop("model", None))


def _engine_options(settings: Any, engine: Any, per_call: Any) -> dict[str, Any]:
    """The call's engine options (and with them its engine name), checked once: the configured
    options belong to the configured engine, a per-call engine gets its own."""
    if not isinstance(per_call, dict):
        msg = f"engine_options must be a dict, got {type(per_call).__name__}"
        raise TypeError(msg)
    base = settings.engine_options if engine == settings.engine else {}
    return check_engine_options(engine, {**base, **per_call})  # before any model loads


def _checked_prompt(prompt: Prompt) -> Prompt:
    """A message list as :class:`ChatTurns` (checked once); a string or ids as given (the
    engine encodes and checks them)."""
    if isinstance(prompt, ChatTurns):  # the adapter checked them already
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
        return chat_turns(prompt)
    return prompt


def start_call(request: CallRequest, settings: Any, *, lm: Any, engine_state: dict[str, Any]
               ) -> ChatCall:
    """The checked call on its model (loaded now if needed), with tools shown in the prompt."""
    model, lock = resolve_model(settings, lm, request.model)
    call = ChatCall(request.engine, model, lock, request.prompt, request.generation,
                    request.documents, engine_state, request.options)
    if not request.tools and request.constraint is None and not _has_tool_turns(request.prompt):
        return call
    return _tool_call(call, request.tools, request.tool_choice, request.constraint)


def prepare_call(settings: Any, prompt: Prompt, kwargs: dict[str, Any], *, lm: Any,
                 engine_state: dict[str, Any], limit_name: str) -> ChatCall:
    """:func:`check_call`, then :func:`start_call`."""
    request = check_call(settings, prompt, kwargs, limit_name=limit_name)
    return start_call(request, settings, lm=lm, engine_state=engine_state)


def _has_tool_turns(prompt: Prompt) -> bool:
    return isinstance(prompt, list) and any(
        isinstance(m, dict) and (m.get("tool_calls") or m.get("role") == "tool") for m in prompt)


def _tool_call(call: ChatCall, tools: list[dict[str, Any]], choice: str,
               constraint: Constraint | None) -> ChatCall:
    """The call with tools shown, a forced call prefilled and the grammar to mask with."""
    if not isinstance(call.prompt, list):
        msg = "tools / response_format need chat messages, not a formatted prompt string"
        raise TypeError(msg)
    prefill, forced = forced_call(choice, tools)
    turns = call.prompt if constraint is None else _with_format_instruction(call.prompt, constraint)
    # under "auto" (and no response_format) the calls the model chooses to write are constrained
    auto = auto_calls(tools) if choice == "auto" and constraint is None else None
    call.constraint = forced or constraint or auto
    if call.constraint is not None and not xgrammar_available():
        if call.constraint is constraint:
            msg = "response_format needs constrained decoding: pip install 'specrag[constrained]'"
            raise ImportError(msg)
        # a forced call loses its grammar (warn); under "auto" calls are parsed as written
        logger.log(logging.WARNING if forced else logging.DEBUG, "xgrammar is not installed: "
                   "tool calls are %s, not constrained ('specrag[constrained]' constrains them)",
                   "prefilled" if forced else "parsed as written")
        call.constraint = None
    shown = tools if choice != "none" else []
    call.prompt = render_prompt(call.lm, turns, shown, prefill)
    call.tools, call.prefill = tool_names(shown), prefill
    return call


def call_report(result: GenerationResult, engine: str, model: str, *, tool_calls: bool = False
                ) -> dict[str, Any]:
    """Usage and engine stats of one call, as both adapters attach them to a response; a reply
    with ``tool_calls`` (at least one valid call) finishes with ``"tool_calls"``."""
    stats = result.stats
    return {"engine": engine, "model": model,
            "finish_reason": "tool_calls" if tool_calls else stats.finish_reason,
            "prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.new_tokens,
            "cached_prompt_tokens": getattr(stats, "cached_prompt_tokens", 0),
            "passage_cache": getattr(stats, "extra", {}).get("passage_cache"),
            "speculative_stats": stats.as_dict()}
