"""What the LangChain and LlamaIndex adapters of Speculative RAG and RaLMSpec share.

Framework-neutral (no LangChain / LlamaIndex import; the engines, and with them torch, are
imported only when an engine is built), so the two adapters of one engine behave the same:

- **settings**: :data:`SPECRAG_SETTINGS`, :data:`RALMSPEC_SETTINGS` and
  :data:`RETRIEVER_SETTINGS` are what every adapter of that engine accepts, with the defaults of
  :mod:`shared_core.config.rag` (a test holds both frameworks to these lists); the RAG engines'
  adapters inherit them as pydantic bases from :mod:`shared_core.frontend.rag_settings`;
- **a prebuilt** ``engine=``: its models and config are used; a setting passed to the adapter
  replaces the matching config field, a setting not passed takes the engine's value
  (:func:`resolve_settings`), so the adapter's attributes show what its engine runs;
- **engines**: built on first use from the adapter's current settings and rebuilt when one of
  them changes (the next call sees the change);
- **locking**: the engines' own only. Each stage of a ``SpeculativeRAG`` answer holds its
  model's lock (engines derived with ``with_config`` share the models and so the locks), never
  while the caller reads a stage event; a ``RaLMSpec`` call keeps all its state to itself, so
  concurrent calls need no lock;
- **speculative retrievers**: the :class:`~shared_core.engines.ralmspec.SpeculativeRetrieval`
  session opens on first use with the current settings (reopened after a change or ``reset``);
  a hit's score is the retriever's, ``None`` for a speculated (not yet verified) hit.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, cast

from shared_core.config import check_text
from shared_core.config.rag import (
    PromptMessages,
    RaLMSpecConfig,
    SpeculativeRAGConfig,
    check_prompt,
    specrag_budgets,
)
from shared_core.retrieval.base import check_retriever_like
from shared_core.retrieval.frameworks import DocumentList, to_documents
from shared_core.runtime.model_cache import check_model_name, holds_released, models_of

if TYPE_CHECKING:
    from shared_core.decoding.output import GenerationResult
    from shared_core.engines.baseline import TokenStream
    from shared_core.engines.ralmspec import RaLMSpec, RaLMSpecStats, SpeculativeRetrieval
    from shared_core.engines.speculative_rag import SpeculativeRAG, SpeculativeRAGResult
    from shared_core.retrieval.base import Document

T = TypeVar("T")

SPECRAG_KNOBS = ("num_drafts", "docs_per_draft", "retrieve_k", "prompt", "retrieval_timeout_s")
# max_new_tokens (None: the engine's budgets) sets both generation budgets (specrag_budgets)
SPECRAG_SETTINGS = ("retriever", "drafter", "verifier", "dtype", "backend", *SPECRAG_KNOBS,
                    "max_new_tokens", "engine")
RALMSPEC_KNOBS = ("retrieval_stride", "speculation_stride", "prefetch", "scheduler",
                  "async_verify", "retrieval_timeout_s", "prompt")
RALMSPEC_SETTINGS = ("retriever", "model", "backend", "max_new_tokens", "temperature", "seed",
                     *RALMSPEC_KNOBS, "baseline", "engine")
# plus the number of documents returned: ``k`` (LangChain) / ``similarity_top_k`` (LlamaIndex)
RETRIEVER_SETTINGS = ("retriever", "prefetch_k", "retrieval_timeout_s")


# ----------------------------------------------------------------------------- input checks


def question_input(value: object) -> tuple[str, DocumentList | None]:
    """(question, documents or None) of a question string or a ``{"question", "documents"}``
    dict, checked before any retrieval or model work; the documents are converted here, once
    (the engine takes a :class:`DocumentList` as it is)."""
    if isinstance(value, str):
        question, docs = value, None
    elif isinstance(value, dict) and "question" in value:
        question, docs = value["question"], value.get("documents")
        if "context" in value and docs is None:  # LangChain's classic RAG chain's key
            msg = ("input has a 'context' key, which is not read: pass the retrieved documents "
                   "as 'documents' ({'question': ..., 'documents': retriever}), or leave them "
                   "out and give the adapter the retriever")
            raise ValueError(msg)
    else:
        msg = "input must be a question string or a dict with a 'question' key"
        raise TypeError(msg)
    question = check_text(question, "question")
    return question, None if docs is None else to_documents(docs)


# A framework's prompt template is rendered with these in place of its two variables, then turned
# back into a format string (rendered_prompt): any template syntax (f-string, jinja2, mustache,
# chat messages) reaches the engines as (role, format string) pairs.
QUESTION_SENTINEL = "\x00specrag-question\x00"
DOCUMENTS_SENTINEL = "\x00specrag-documents\x00"
PROMPT_SENTINELS = {"question": QUESTION_SENTINEL, "documents": DOCUMENTS_SENTINEL}


def check_prompt_variables(variables: Iterable[str], name: str = "prompt") -> None:
    """ValueError naming ``name`` unless a template's input variables are question + documents."""
    variables = set(variables)
    if variables != {"question", "documents"}:
        msg = (f"{name} must take exactly the input variables 'question' and 'documents'; "
               f"missing: {sorted({'question', 'documents'} - variables)}, "
               f"unknown: {sorted(variables - {'question', 'documents'})}")
        raise ValueError(msg)


def rendered_prompt(messages: Sequence[tuple[str, str]], name: str = "prompt") -> PromptMessages:
    """(role, text) pairs rendered with :data:`PROMPT_SENTINELS` as a checked engine prompt."""
    out = []
    for role, text in messages:
        text = text.replace("{", "{{").replace("}", "}}")
        text = text.replace(QUESTION_SENTINEL, "{question}")
        out.append((role, text.replace(DOCUMENTS_SENTINEL, "{documents}")))
    return cast("PromptMessages", check_prompt(tuple(out), name))


def check_retriever(value: object) -> object:
    """None or something the engines can search (TypeError naming the retriever otherwise)."""
    return value if value is None else check_retriever_like(value)


def check_prebuilt_engine(value: T, kind: str) -> T:
    """None or a prebuilt engine of ``kind`` (``"SpeculativeRAG"`` or ``"RaLMSpec"``)."""
    needs = {"SpeculativeRAG": ("answer", "with_config", "config"),
             "RaLMSpec": ("lm", "backend", "config")}[kind]
    if value is not None and not all(hasattr(value, a) for a in needs):
        msg = f"engine must be a shared_core {kind} engine or None, got {type(value).__name__}"
        raise TypeError(msg)
    return value


def resolve_settings(engine: object, config_type: type, names: Iterable[str],
                     given: Mapping[str, object]) -> dict[str, object]:
    """Every setting in ``names``: as ``given`` (what the caller passed), else the prebuilt
    ``engine``'s config value, else ``config_type``'s default."""
    source = getattr(engine, "config", None)
    if not isinstance(source, config_type):
        source = config_type  # no (valid) engine: a dataclass's class attributes are its defaults
    return {name: given[name] if name in given else getattr(source, name) for name in names}


def engine_settings(config_type: type, names: Iterable[str]) -> Callable[[object], object]:
    """A pydantic ``model_validator(mode="before")`` that applies :func:`resolve_settings` to
    an adapter's input when a prebuilt ``engine`` is given."""
    names = tuple(names)

    def validate(data: object) -> object:
        if isinstance(data, dict) and data.get("engine") is not None:
            data = {**data, **resolve_settings(data["engine"], config_type, names, data)}
        return data

    return validate


def prebuilt_engine_check(kind: str) -> Callable[[object], object]:
    """:func:`check_prebuilt_engine` for ``kind`` as a one-argument pydantic field validator."""
    return lambda value: check_prebuilt_engine(value, kind)


# ----------------------------------------------------------------------------- built from settings


def _plain(x: object) -> bool:
    return isinstance(x, (str, int, float)) or (isinstance(x, tuple) and all(map(_plain, x)))


def _same(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    """Equal settings: plain values (and tuples of them) by value and type, objects (retrievers,
    engines) by identity."""
    return len(a) == len(b) and all(
        x is y or (type(x) is type(y) and _plain(x) and x == y)
        for x, y in zip(a, b, strict=True))


class SettingsCache(Generic[T]):
    """One object built from settings: built on first use, rebuilt when the settings change.

    Holds its key (so an object's identity cannot be reused while it is cached) and builds under
    a lock, so concurrent first calls build once.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entry: tuple[tuple[object, ...], T] | None = None
        self._names_released = False  # the entry's settings name a released model themselves

    def get(self, key: tuple[object, ...], build: Callable[[], T]) -> T:
        with self._lock:
            entry = self._entry
            if entry is None or not _same(entry[0], key):
                entry = self._set(key, build())
            elif not self._names_released and holds_released(entry[1]):
                # rebuilt on the model loaded again, unless the settings name the released
                # object itself (a prebuilt engine): then kept, and not rebuilt on later calls
                fresh = build()
                if holds_released(entry[1], in_use=models_of(fresh)):
                    entry = self._set(key, fresh)
                else:
                    self._names_released = True
            return entry[1]

    def _set(self, key: tuple[object, ...], value: T) -> tuple[tuple[object, ...], T]:
        self._entry, self._names_released = (key, value), False
        return self._entry

    def clear(self) -> None:
        with self._lock:
            self._entry, self._names_released = None, False

    def __reduce__(self) -> tuple[type, tuple[()]]:
        return type(self), ()  # a copy (pickle, deepcopy) starts empty: what is cached is no state


class SpeculativeRAGEngineSettings(Protocol):
    """What :class:`SpeculativeRAGEngines` reads of an adapter's settings
    (:class:`~shared_core.frontend.rag_settings.SpeculativeRAGSettings`), besides the
    :data:`SPECRAG_KNOBS`."""

    drafter: str
    verifier: str | None
    dtype: str | None
    backend: str
    max_new_tokens: int | None
    engine: object  # None or a prebuilt engine (check_prebuilt_engine)


class RaLMSpecEngineSettings(Protocol):
    """What :class:`RaLMSpecEngines` reads of an adapter's settings
    (:class:`~shared_core.frontend.rag_settings.RaLMSpecSettings`), besides the
    :data:`RALMSPEC_KNOBS`."""

    model: str
    backend: str
    retriever: object
    engine: object  # None or a prebuilt engine (check_prebuilt_engine)
    baseline: bool
    max_new_tokens: int
    temperature: float
    seed: int | None


class SpeculativeRAGEngines:
    """The :class:`~shared_core.engines.speculative_rag.SpeculativeRAG` for an adapter's settings.

    Changing only ``num_drafts`` / ``docs_per_draft`` / ``retrieve_k`` derives a new engine with
    ``with_config`` (same loaded models, same model lock); changing a model builds a new one.
    """

    def __init__(self) -> None:
        self._models: SettingsCache[SpeculativeRAG] = SettingsCache()
        self._engines: SettingsCache[SpeculativeRAG] = SettingsCache()

    def get(self, settings: SpeculativeRAGEngineSettings, prompt: PromptMessages | None
            ) -> SpeculativeRAG:
        """The engine for ``settings`` (read, never called back) and the prompt setting already
        in the engine's form."""
        check_prebuilt_engine(settings.engine, "SpeculativeRAG")
        knobs = {name: getattr(settings, name) for name in SPECRAG_KNOBS}
        knobs["prompt"] = prompt
        knobs.update(specrag_budgets(settings.max_new_tokens))
        models = (settings.drafter, settings.verifier, settings.dtype, settings.backend,
                  settings.engine)
        base = self._models.get(models, lambda: self._base(settings, knobs))
        return self._engines.get((base, *knobs.values()),
                                 lambda: base.with_config(replace(base.config, **knobs)))

    @staticmethod
    def _base(settings: SpeculativeRAGEngineSettings, knobs: dict[str, Any]) -> SpeculativeRAG:
        from shared_core.engines.speculative_rag import SpeculativeRAG

        if settings.engine is not None:  # checked: a SpeculativeRAG, or the ReloadingEngine of
            return cast("SpeculativeRAG", settings.engine)  # one that an unpickled adapter holds
        SpeculativeRAGConfig(**knobs)  # bad settings fail before the model names are looked at
        return SpeculativeRAG(settings.drafter, settings.verifier, dtype=settings.dtype,
                              backend=settings.backend)


def _ralmspec_knobs(settings: RaLMSpecEngineSettings, prompt: PromptMessages | None
                    ) -> dict[str, Any]:
    """The RaLMSpecConfig fields an adapter's settings give (a None timeout: the engine's)."""
    knobs = {name: getattr(settings, name) for name in RALMSPEC_KNOBS}
    knobs["prompt"] = prompt
    if knobs["retrieval_timeout_s"] is None:
        del knobs["retrieval_timeout_s"]
    return knobs


class RaLMSpecEngines:
    """The :class:`~shared_core.engines.ralmspec.RaLMSpec` for an adapter's settings, and a call.

    ``retrieval_timeout_s=None`` keeps the prebuilt engine's setting (by default no limit).
    """

    def __init__(self) -> None:
        self._engines: SettingsCache[RaLMSpec] = SettingsCache()

    def get(self, settings: RaLMSpecEngineSettings, prompt: PromptMessages | None) -> RaLMSpec:
        knobs = _ralmspec_knobs(settings, prompt)
        key = (settings.model, settings.backend, settings.retriever, settings.engine,
               *knobs.values())
        return self._engines.get(key, lambda: self._build(settings, knobs))

    @staticmethod
    def check(settings: RaLMSpecEngineSettings, prompt: PromptMessages | None) -> None:
        """Refuse bad settings without building anything (an adapter's construction): the
        knobs together (``speculation_stride`` against its maximum, ...) and the model name."""
        if settings.engine is None:
            RaLMSpecConfig(**_ralmspec_knobs(settings, prompt))
            check_model_name(settings.model, "model")

    @staticmethod
    def _build(settings: RaLMSpecEngineSettings, knobs: dict[str, Any]) -> RaLMSpec:
        from shared_core.frontend.serving import ralmspec_engine

        if settings.engine is None:
            RaLMSpecConfig(**knobs)  # refuse bad settings before a model is loaded
        # checked: None, a RaLMSpec, or the ReloadingEngine of one that an unpickled adapter holds
        engine = cast("RaLMSpec | None", settings.engine)
        return ralmspec_engine(settings.model, settings.retriever, engine,
                               backend=settings.backend, **knobs)

    def stream(self, settings: RaLMSpecEngineSettings, question: str, prompt: PromptMessages | None
               ) -> TokenStream:
        """RaLMSpec (or RaLMSeq with ``settings.baseline``) for ``question`` as a stream."""
        engine = self.get(settings, prompt)
        start = engine.stream_baseline if settings.baseline else engine.stream
        return start(question, settings.max_new_tokens, temperature=settings.temperature,
                     seed=settings.seed)


class RetrieverSession:
    """The :class:`~shared_core.engines.ralmspec.SpeculativeRetrieval` of a speculative-retriever
    adapter: opened on first use, reopened when a setting changes or after :meth:`reset`."""

    def __init__(self) -> None:
        self._sessions: SettingsCache[SpeculativeRetrieval] = SettingsCache()

    def get(self, retriever: object, k: int, prefetch_k: int, retrieval_timeout_s: float | None
            ) -> SpeculativeRetrieval:
        def build() -> SpeculativeRetrieval:
            from shared_core.engines.ralmspec import SpeculativeRetrieval

            return SpeculativeRetrieval(retriever, k=k, prefetch_k=prefetch_k,
                                        retrieval_timeout_s=retrieval_timeout_s)

        return self._sessions.get((retriever, k, prefetch_k, retrieval_timeout_s), build)

    def reset(self) -> None:
        self._sessions.clear()


# ----------------------------------------------------------------------------- results


def specrag_details(result: SpeculativeRAGResult) -> dict[str, Any]:
    """What both Speculative RAG adapters report beside the answer and the documents."""
    return {"rationale": result.rationale, "best": result.best,
            "drafts": [d.as_dict() for d in result.drafts],
            "scores": [d.score for d in result.drafts], "stats": result.stats.as_dict()}


def ralmspec_details(result: GenerationResult) -> dict[str, Any]:
    """What both RaLMSpec adapters report beside the answer and the documents."""
    return {"doc_ids": list(_ralm_stats(result).doc_ids),
            "token_ids": list(result.token_ids), "stats": result.stats.as_dict()}


def ralmspec_documents(result: GenerationResult) -> tuple[Document, ...]:
    """The documents the answer was generated under, each once, in first-use order."""
    return _ralm_stats(result).documents


def ralmspec_scores(result: GenerationResult) -> tuple[float | None, ...]:
    """The retrieval score of each of :func:`ralmspec_documents` at its first use (None: the
    retriever gave none)."""
    return _ralm_stats(result).document_scores


def _ralm_stats(result: GenerationResult) -> RaLMSpecStats:
    from shared_core.engines.ralmspec.stats import RaLMSpecStats  # imported with the engine

    stats = result.stats
    if not isinstance(stats, RaLMSpecStats):
        msg = f"not a RaLMSpec result: its stats are {type(stats).__name__}"
        raise TypeError(msg)
    return stats
