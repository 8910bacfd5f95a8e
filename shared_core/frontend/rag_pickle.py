"""Pickling the RAG adapters without weights (framework-neutral, torch-free at import).

An adapter built from model names pickles its settings only (its engine cache starts empty, see
:class:`~shared_core.frontend.rag.SettingsCache`). An adapter given a prebuilt ``engine=`` holds
loaded models; :func:`portable_state` swaps that engine for a :class:`ReloadingEngine`: the
engine's model names, config and retriever, rebuilt through the shared model cache on first use.
A model that has no loadable name (built in memory and wrapped) cannot be pickled this way:
that is a ``TypeError`` naming the engine, never a silent copy of the weights. The chat
adapters' ``engine_options`` pickle the same way (:func:`portable_options`).
"""

from __future__ import annotations

import pickle
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from shared_core.config.rag import RaLMSpecConfig, SpeculativeRAGConfig
from shared_core.engines.registry import check_engine_options
from shared_core.frontend.token_budget import offline_tiktoken
from shared_core.runtime.weights.embedded import EMBEDDED_LMS
from shared_core.util.redact import strip_credentials

if TYPE_CHECKING:
    from shared_core.engines.ralmspec import RaLMSpec
    from shared_core.engines.speculative_rag import SpeculativeRAG
    from shared_core.runtime.protocol import ServedLM, SessionLM


def _model_name(model: object, role: str) -> str | None:
    """A name :func:`shared_core.load_lm` can load for ``model`` (a name or a loaded LM)."""
    if model is None or isinstance(model, str):
        return model
    name = getattr(model, "name", None)
    loadable = isinstance(name, str) and (
        name.removesuffix("+specrag") in EMBEDDED_LMS or Path(name).expanduser().exists()
        or name.count("/") == 1)
    if not loadable:
        msg = (f"engine: its {role} {name!r} was built in memory and has no name load_lm can "
               "reload, so the adapter cannot be pickled without its weights; build the engine "
               "from a model alias, hub id or saved folder")
        raise TypeError(msg)
    return name


def _build_speculative_rag(recipe: dict[str, Any], config: SpeculativeRAGConfig
                           ) -> SpeculativeRAG:
    from shared_core.engines.speculative_rag import SpeculativeRAG

    return SpeculativeRAG(recipe["drafter"], recipe["verifier"], embedder=recipe["embedder"],
                          retriever=recipe["retriever"], config=config, dtype=recipe["dtype"],
                          backend=recipe.get("backend", "torch"))


def _build_ralmspec(recipe: dict[str, Any], config: RaLMSpecConfig) -> RaLMSpec:
    from shared_core.engines.ralmspec import RaLMSpec
    from shared_core.runtime.model_cache import resolve_lm

    # a URL gives a served model, a name an in-process one: what RaLMSpec takes
    lm = cast("SessionLM | ServedLM",
              resolve_lm(recipe["model"], backend=recipe.get("runtime", "torch")))
    return RaLMSpec(lm, recipe["backend"], config)


def _build(recipe: dict[str, Any], config: SpeculativeRAGConfig | RaLMSpecConfig
           ) -> SpeculativeRAG | RaLMSpec:
    if isinstance(config, SpeculativeRAGConfig):
        return _build_speculative_rag(recipe, config)
    return _build_ralmspec(recipe, config)


class ReloadingEngine:
    """A prebuilt engine as it pickles: model names, config and retriever; the engine is
    rebuilt (models from the shared cache) when first used, and pickles as this again."""

    def __init__(self, kind: str, recipe: dict[str, Any],
                 config: SpeculativeRAGConfig | RaLMSpecConfig) -> None:
        self.kind, self.recipe, self.config = kind, recipe, config
        self._build_lock = threading.Lock()
        self._engine: SpeculativeRAG | RaLMSpec | None = None

    def built(self) -> SpeculativeRAG | RaLMSpec:
        with self._build_lock:
            if self._engine is None:
                self._engine = _build(self.recipe, self.config)
            return self._engine

    def __getattr__(self, name: str) -> Any:  # only for what this object does not have itself
        if name.startswith("_") or name in ("kind", "recipe", "config"):
            raise AttributeError(name)
        return getattr(self.built(), name)

    def __reduce__(self) -> tuple[type, tuple[Any, ...]]:
        return ReloadingEngine, (self.kind, self.recipe, self.config)


class _Offline:
    """A LlamaIndex object as an adapter pickles it: its unpickling (which loads the tiktoken
    encodings it holds) reads the BPE files llama-index-core ships, never the network."""

    def __init__(self, value: object) -> None:
        self.value = value

    def __reduce__(self) -> tuple[Any, tuple[bytes]]:
        return _load_offline, (pickle.dumps(self.value),)


def _load_offline(data: bytes) -> Any:
    with offline_tiktoken():
        return pickle.loads(data)  # the adapter's own pickle, loaded by its caller


def offline_unpickled(value: object) -> object:
    """``value`` wrapped so that unpickling it never downloads a tiktoken encoding, when it is a
    LlamaIndex object (their tokenizers pickle as encoding names); anything else unchanged."""
    return _Offline(value) if type(value).__module__.startswith("llama_index") else value


def portable_engine(engine: Any) -> ReloadingEngine | None:
    """``engine`` as it should pickle: None, or a :class:`ReloadingEngine`."""
    if engine is None or isinstance(engine, ReloadingEngine):
        return engine
    if hasattr(engine, "answer") and hasattr(engine, "with_config"):  # SpeculativeRAG
        recipe = {"drafter": _model_name(engine._drafter_src, "drafter"),
                  "verifier": _model_name(engine._verifier_src, "verifier"),
                  "embedder": engine._embedder_src,
                  "retriever": offline_unpickled(engine.retriever),
                  "dtype": engine.dtype, "backend": engine.backend}
        return ReloadingEngine("SpeculativeRAG", recipe, engine.config)
    recipe = {"model": _model_name(engine.lm, "model"), "backend": engine.backend,
              "runtime": getattr(engine.lm, "backend", "torch")}
    return ReloadingEngine("RaLMSpec", recipe, engine.config)


def portable_state(state: dict[str, Any]) -> dict[str, Any]:
    """An adapter's ``__dict__`` with its ``engine`` made portable and no URL credentials (the
    rest unchanged)."""
    state = {name: offline_unpickled(strip_credentials(value)) for name, value in state.items()}
    if state.get("engine") is None:
        return state
    return {**state, "engine": portable_engine(state["engine"])}


def _plain(value: object) -> bool:
    """Numbers, strings, None, and lists / tuples / str-keyed dicts of them."""
    if value is None or isinstance(value, (str, int, float)):
        return True
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):  # not a subclass
        return all(_plain(item) for item in value)
    return type(value) is dict and all(isinstance(k, str) and _plain(v) for k, v in value.items())


def portable_options(engine: str, options: dict[str, Any]) -> dict[str, Any]:
    """A chat adapter's ``engine_options`` as its pickle keeps them: only options the engine
    takes (checked again), plain data only, URL credentials stripped. An option holding a live
    object (a model, an index, a decoder, an embedder) is a ``TypeError`` naming it, never a
    copy of its weights."""
    check_engine_options(engine, options)
    for key, value in options.items():
        if not _plain(value):
            msg = (f"engine_options[{key!r}] holds a {type(value).__name__}; an adapter pickles "
                   "its settings only (numbers, strings, lists of them), never a loaded object: "
                   "pass a name or text instead, or drop the option before pickling")
            raise TypeError(msg)
    return {key: strip_credentials(value) for key, value in options.items()}


__all__ = ["ReloadingEngine", "portable_engine", "portable_options", "portable_state"]
