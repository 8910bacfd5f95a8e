"""The settings of both frameworks' RAG adapters, declared once as pydantic bases.

:class:`SpeculativeRAGSettings` is inherited by ``SpeculativeRAGRunnable`` (LangChain) and
``SpeculativeRAGQueryEngine`` (LlamaIndex), :class:`RaLMSpecSettings` by ``RaLMSpecRunnable`` and
``RaLMSpecQueryEngine``: the fields, their checks, the errors, the engine they build and the
per-call rules live here, so the two adapters of one engine cannot drift. Each framework adds
only its prompt templates (``_prompt_of``, in one mixin per framework) and its conversions.

Validation happens once, at the edge: a setting is checked when the adapter is built; the
prompt setting is turned into the engine's form once per value (not per request); a call's
keyword arguments are refused (:func:`refuses_call_kwargs`), naming the closest setting.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

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
    DEFAULT_SPECRAG_BACKEND,
    DEFAULT_VERIFIER,
    SamplingConfig,
    check_backend,
    check_settings_keys,
    closest_name,
)
from shared_core.config.rag import (
    RALMSPEC_MAX_NEW_TOKENS,
    PromptMessages,
    RaLMSpecConfig,
    SpeculativeRAGConfig,
    check_prompt,
)
from shared_core.frontend.rag import (
    RALMSPEC_KNOBS,
    SPECRAG_KNOBS,
    RaLMSpecEngines,
    SpeculativeRAGEngines,
    check_retriever,
    engine_settings,
    prebuilt_engine_check,
)
from shared_core.frontend.rag_pickle import portable_state
from shared_core.frontend.rag_streams import (
    RaLMSpecAnswer,
    RaLMSpecEvent,
    RaLMSpecStream,
    SpeculativeRAGStream,
)
from shared_core.frontend.serving import iterate_in_thread
from shared_core.retrieval.frameworks import DocumentList, retrieve, retrieved_documents
from shared_core.retrieval.timeout import call_with_timeout
from shared_core.util.redact import redacted_dump, redacted_repr_args

if TYPE_CHECKING:
    from shared_core.engines.ralmspec import RaLMSpec
    from shared_core.engines.speculative_rag import SpeculativeRAG
    from shared_core.retrieval.base import Document

F = TypeVar("F", bound=Callable[..., Any])
logger = logging.getLogger(__name__)

NO_RETRIEVER = ("retriever is None and the input has no 'documents': set a retriever or pass "
                "documents with the question")


def check_call_kwargs(adapter: BaseModel, kwargs: dict[str, object]) -> None:
    """TypeError for any keyword argument of a RAG adapter's call (settings are set on the
    adapter), naming the closest setting: ``invoke("q", num_draft=3)``."""
    if not kwargs:
        return
    name = str(next(iter(kwargs)))
    close = closest_name(name, type(adapter).model_fields)
    hint = (f"did you mean the setting {close!r}? Set it on the adapter, not per call"
            if close else "settings are set on the adapter, not per call")
    msg = f"{type(adapter).__name__} got an unexpected keyword argument {name!r}; {hint}"
    raise TypeError(msg)


def refuses_call_kwargs(method: F) -> F:
    """``method(self, input, ...)`` refusing keyword arguments beyond its own
    (:func:`check_call_kwargs`) before it starts; sync, async and generator methods alike."""
    own = {p.name for p in inspect.signature(method).parameters.values()
           if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}

    def extra(kwargs: dict[str, object]) -> dict[str, object]:
        return {k: v for k, v in kwargs.items() if k not in own}

    if inspect.iscoroutinefunction(method):
        @functools.wraps(method)
        async def checked_async(self: BaseModel, *args: object, **kwargs: object) -> object:
            check_call_kwargs(self, extra(kwargs))
            return await method(self, *args, **kwargs)

        return checked_async  # type: ignore[return-value]

    @functools.wraps(method)
    def checked(self: BaseModel, *args: object, **kwargs: object) -> object:
        check_call_kwargs(self, extra(kwargs))
        return method(self, *args, **kwargs)

    return checked  # type: ignore[return-value]


class RAGSettings(BaseModel):
    """What every RAG adapter's settings have: a retriever of any kind (LangChain, LlamaIndex or
    specrag; anything else is a TypeError naming ``retriever``), a prompt setting, a prebuilt
    ``engine``, strict validation and a redacted, engine-free pickle."""

    # hide_input_in_errors: a ValidationError would echo every setting, a URL's credentials too
    model_config = ConfigDict(arbitrary_types_allowed=True, strict=True, hide_input_in_errors=True)

    retriever: object = None
    prompt: object = None
    engine: Any = Field(default=None, exclude=True)
    _prompt_form: tuple[object, PromptMessages | None] | None = PrivateAttr(default=None)

    _check_retriever = field_validator("retriever")(check_retriever)
    _known_settings = model_validator(mode="before")(check_settings_keys)

    @staticmethod
    def _prompt_of(value: object) -> PromptMessages | None:
        """The engine form of a ``prompt`` setting (each framework's mixin adds its templates)."""
        return check_prompt(value)

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: object) -> object:
        cls._prompt_of(value)  # a wrong template fails here, naming ``prompt``
        return value

    def engine_prompt(self) -> PromptMessages | None:
        """The prompt setting in the engine's form, rendered once per value of the setting."""
        form = self._prompt_form
        if form is None or form[0] is not self.prompt:
            form = self._prompt_form = (self.prompt, self._prompt_of(self.prompt))
        return form[1]

    def _retriever_name(self) -> str:
        return f"retriever {type(self.retriever).__name__}"

    def __repr_args__(self) -> Any:
        return redacted_repr_args(super().__repr_args__())

    @field_serializer("*", mode="wrap")
    def _dump_redacted(self, value: object, handler: SerializerFunctionWrapHandler) -> Any:
        """``model_dump`` / ``model_dump_json`` / ``to_dict`` mask URL credentials, like repr."""
        return redacted_dump(handler(value))

    def __getstate__(self) -> dict[str, Any]:
        """Settings only: a prebuilt ``engine`` pickles as its model names (reloaded on use)."""
        state = super().__getstate__()
        return {**state, "__dict__": portable_state(state["__dict__"])}


_SPECRAG_INTS = ("num_drafts", "docs_per_draft", "retrieve_k")


def _specrag_given(data: object) -> object:
    """``None`` for an integer knob means "not given" (the engine's or the config's value); then
    a prebuilt engine's config fills what is not given."""
    if isinstance(data, dict):
        data = {k: v for k, v in data.items() if not (k in _SPECRAG_INTS and v is None)}
    return engine_settings(SpeculativeRAGConfig, SPECRAG_KNOBS)(data)


class SpeculativeRAGSettings(RAGSettings):
    """The settings of both Speculative RAG adapters (defaults: the engine config's).

    Args:
        retriever: a LangChain, LlamaIndex or specrag retriever (optional where the input can
            carry documents; without either a call fails before any work).
        drafter / verifier: model names for :func:`shared_core.load_lm` (or pass ``engine``).
        num_drafts / docs_per_draft / retrieve_k: m, k and how many retrieved (or given)
            documents are used (``None``: the engine's config value, else the config default).
        dtype: model dtype (``"bfloat16"`` about halves latency on CPUs with AMX; default fp32).
        backend: runtime of the models (``"torch"``, ``"llama.cpp"`` or ``"auto"``).
        prompt: the drafting prompt over ``{question}`` and ``{documents}`` (a format string or
            the framework's prompt template; ``None``: the engine's).
        retrieval_timeout_s: seconds the retriever may take before the call fails with
            ``TimeoutError`` (``None``: no limit).
        max_new_tokens: cap on every generated text (``None``: the config's budgets).
        engine: a prebuilt :class:`~shared_core.engines.speculative_rag.SpeculativeRAG` (shares
            its models); the knobs not passed are its config's.
    """

    drafter: str = DEFAULT_LM
    verifier: str | None = DEFAULT_VERIFIER
    dtype: str | None = None
    backend: str = DEFAULT_SPECRAG_BACKEND
    num_drafts: int = Field(default=SpeculativeRAGConfig.num_drafts, ge=1)
    docs_per_draft: int = Field(default=SpeculativeRAGConfig.docs_per_draft, ge=1)
    retrieve_k: int = Field(default=SpeculativeRAGConfig.retrieve_k, ge=1)
    prompt: object = SpeculativeRAGConfig.prompt
    retrieval_timeout_s: float | None = Field(default=SpeculativeRAGConfig.retrieval_timeout_s,
                                              gt=0.0)
    max_new_tokens: int | None = Field(default=None, ge=1)
    _engines: SpeculativeRAGEngines = PrivateAttr(default_factory=SpeculativeRAGEngines)

    _check_prebuilt_engine = field_validator("engine")(prebuilt_engine_check("SpeculativeRAG"))
    _check_backend = field_validator("backend")(check_backend)  # also with a prebuilt engine
    _engine_settings = model_validator(mode="before")(_specrag_given)

    def model_post_init(self, context: object) -> None:
        super().model_post_init(context)
        self._engine()  # every setting is checked now; no model is loaded before the first call

    def _engine(self) -> SpeculativeRAG:
        return self._engines.get(self, self.engine_prompt())

    def _checked_engine(self, has_documents: bool) -> SpeculativeRAG:
        """The engine for a call, after the checks that need no work (before retrieval)."""
        if not has_documents and self.retriever is None:
            raise ValueError(NO_RETRIEVER)
        return self._engine()

    def _retrieved(self, found: object) -> DocumentList:
        """A framework retriever's answer as its top ``retrieve_k`` documents, whatever shape
        it came in (a generator too), or a TypeError naming the retriever."""
        return retrieved_documents(found, type(self.retriever).__name__, self.retrieve_k)

    def _given(self, docs: DocumentList) -> DocumentList:
        """Documents passed with the question: the first ``retrieve_k``, as a retriever's."""
        if len(docs) <= self.retrieve_k:
            return docs
        logger.info("using the first %d of the %d documents given (retrieve_k=%d; raise it to "
                    "use more)", self.retrieve_k, len(docs), self.retrieve_k)
        return DocumentList(docs[: self.retrieve_k])

    def _retrieve_any(self, question: str) -> list[Document]:
        """The top ``retrieve_k`` documents of a retriever that is not the framework's own (a
        specrag retriever or the other framework's), time-limited like the framework's."""
        return call_with_timeout(lambda: retrieve(self.retriever, question, self.retrieve_k),
                                 self.retrieval_timeout_s, self._retriever_name(), self.retriever)


class RaLMSpecSettings(RAGSettings):
    """The settings of both RaLMSpec adapters, declared once: ``RaLMSpecRunnable`` (LangChain)
    and ``RaLMSpecQueryEngine`` (LlamaIndex) inherit these fields, their checks and the engine
    they build. Defaults are the configs'; a changed setting takes effect at the next call.

    Args:
        retriever: a LangChain / LlamaIndex retriever or a specrag retriever.
        model: a :func:`shared_core.load_lm` alias or path (ignored when ``engine`` is given).
        backend: runtime of the model, as for the chat adapters: ``"auto"`` (llama.cpp for a
            GGUF on a CPU once a probe proved it, else torch), ``"torch"`` or ``"llama.cpp"``.
        max_new_tokens / temperature / seed: generation settings.
        retrieval_stride, speculation_stride, prefetch, scheduler, async_verify: RaLMSpec knobs
            (:class:`~shared_core.config.rag.RaLMSpecConfig`).
        retrieval_timeout_s: seconds one retriever call may take before the call fails with
            ``TimeoutError`` (``None``: the engine's setting, by default no limit).
        prompt: the answering prompt, with ``{question}`` and ``{documents}`` (the retrieved
            passage): a format string, or the framework's prompt template (``None``: the
            engine's default, built from ``RaLMSpecConfig.instruction``).
        baseline: run RaLMSeq instead (for comparisons).
        engine: a prebuilt :class:`~shared_core.engines.ralmspec.RaLMSpec` (shares its model and
            retriever); the knobs above that are not passed are its config's.

    Validation is strict (a bool or a float is not an int): a bad value raises pydantic's
    ``ValidationError`` (a ``ValueError``) naming the field.
    """

    model: str = DEFAULT_LM
    backend: str = DEFAULT_BACKEND
    max_new_tokens: int = Field(default=RALMSPEC_MAX_NEW_TOKENS, ge=1)
    temperature: float = Field(default=SamplingConfig.temperature, ge=0.0)
    seed: int | None = SamplingConfig.seed
    retrieval_stride: int = Field(default=RaLMSpecConfig.retrieval_stride, ge=1)
    speculation_stride: int = Field(default=RaLMSpecConfig.speculation_stride, ge=1)
    prefetch: bool = RaLMSpecConfig.prefetch
    scheduler: bool = RaLMSpecConfig.scheduler
    async_verify: bool = RaLMSpecConfig.async_verify
    retrieval_timeout_s: float | None = Field(default=RaLMSpecConfig.retrieval_timeout_s, gt=0.0)
    prompt: object = RaLMSpecConfig.prompt
    baseline: bool = False
    _engines: RaLMSpecEngines = PrivateAttr(default_factory=RaLMSpecEngines)

    _check_prebuilt_engine = field_validator("engine")(prebuilt_engine_check("RaLMSpec"))
    _check_backend = field_validator("backend")(check_backend)
    _engine_settings = model_validator(mode="before")(engine_settings(RaLMSpecConfig,
                                                                      RALMSPEC_KNOBS))

    def model_post_init(self, context: object) -> None:
        super().model_post_init(context)
        self._engines.check(self, self.engine_prompt())  # every setting now; no model loads

    @field_validator("temperature", "seed")
    @classmethod
    def _check_sampling(cls, value: object, info: ValidationInfo) -> object:
        given: dict[str, Any] = {str(info.field_name): value}  # typed by the field already
        SamplingConfig(**given)  # finite, not degenerate; seed in range
        return value

    def _engine(self) -> RaLMSpec:
        return self._engines.get(self, self.engine_prompt())


def ralmspec(settings: RaLMSpecSettings, question: str) -> RaLMSpecStream:
    """The RaLMSpec adapters' one call: RaLMSpec (RaLMSeq with ``baseline``) for a checked
    ``question`` on the engine of the current settings (built on first use, rebuilt after a
    change), started now; read it to the end or stream it."""
    return RaLMSpecStream(settings._engines.stream(settings, question, settings.engine_prompt()))



async def ralmspec_answer(settings: RaLMSpecSettings, question: str) -> RaLMSpecAnswer:
    """:func:`ralmspec` read to its end on a worker thread, the engine started there too: the
    event loop never waits for the model, and a cancelled call stops within one step."""
    def events() -> Iterator[RaLMSpecEvent]:
        yield from ralmspec(settings, question)

    last: RaLMSpecEvent | None = None
    async for last in iterate_in_thread(events()):  # noqa: B007 - the last is the answer
        pass
    assert isinstance(last, RaLMSpecAnswer)
    return last


def speculative_rag(settings: SpeculativeRAGSettings, question: str,
                    documents: DocumentList | None = None) -> SpeculativeRAGStream:
    """The Speculative RAG adapters' one call: Speculative RAG for a checked ``question`` on the
    engine of the current settings (built on first use, rebuilt after a change), checked now,
    before any retrieval or model work (no documents and no retriever: ValueError). Documents
    that came with the question are used (the first ``retrieve_k``); without them the adapter
    retrieves with its framework's retriever and passes them with
    :meth:`~shared_core.frontend.rag_streams.SpeculativeRAGStream.with_documents`. Iterate it for
    the stage events and the answer."""
    engine = settings._checked_engine(documents is not None)
    return SpeculativeRAGStream(engine, question,
                                None if documents is None else settings._given(documents))
