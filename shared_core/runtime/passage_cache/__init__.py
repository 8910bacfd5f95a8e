"""Passage (chunk) KV cache: a RAG app never reads the same passage twice.

``load_lm(..., passage_cache="exact" | "blend")`` attaches a cache to a llama.cpp or torch
model (:func:`attach`); every session's first prefill then goes through it (:mod:`.llamacpp`,
:mod:`.torch_cache`). :func:`warm_passages` fills it ahead of time from the texts an app indexes;
:func:`register_passages` tells it which texts a prompt may contain (the RAG engines do);
:func:`passage_stats` reports what it did; :func:`clear_passages` forgets what it stored.

- ``"exact"``: only exact prompt prefixes are reused (in blocks, kept in memory and on disk across
  processes); with ``exact=True`` the output equals a cold prefill's token for token.
- ``"blend"``: cached passages are reused anywhere in a prompt, in any order, and a share
  (``recompute_share``) of their tokens is recomputed with full attention (CacheBlend). A
  passage not stored yet is read in context like the text around it and stored as that read
  left it, right after the prefill (both runtimes).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast, runtime_checkable

from shared_core.config import PassageCacheConfig, check_passage_cache, check_text
from shared_core.runtime.passage_cache.chunks import MIN_PASSAGE, PassageIndex, passage_interior

if TYPE_CHECKING:
    from shared_core.runtime.lm import LM
    from shared_core.runtime.passage_cache.report import PrefillReport
    from shared_core.runtime.passage_cache.store import ChunkStore
    from shared_core.runtime.protocol import ModelLM, SessionLM

logger = logging.getLogger(__name__)

__all__ = ["ModelProvider", "PassageCache", "PassageCacheConfig", "attach", "check_memory",
           "chunk_head", "clear_passages",
           "config_from", "ensure", "passage_cache_of", "passage_stats", "register_passage_ids",
           "register_passages", "source_texts", "warm_passages"]


class PassageCache(Protocol):
    """What both runtimes' caches offer beside their own prefill
    (:class:`.torch_cache.TorchPassageCache`, :class:`.llamacpp.LlamaCppPassageCache`)."""

    config: PassageCacheConfig
    head: tuple[int, ...]  # the ids each passage is computed after (:func:`chunk_head`)
    index: PassageIndex  # the passages a prompt may contain (blend)
    last: PrefillReport  # what the latest first prefill did

    @property
    def mode(self) -> str: ...

    @property
    def store(self) -> ChunkStore[Any] | None:
        """Where entries are kept (None: a copied torch model's cache before its first use)."""

    def warm(self, lm: LM, chunk_ids: Sequence[int]) -> bool:
        """Compute and store one passage alone; False when it was stored already."""

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


@runtime_checkable
class ModelProvider(Protocol):
    """Something that runs on a model it loads itself: a chat adapter (LangChain's
    ``ChatSpeculative``, LlamaIndex's ``SpeculativeLLM``). :func:`warm_passages`,
    :func:`register_passages`, :func:`clear_passages` and :func:`passage_stats` take one in place
    of the model, and act on the very model its calls run on."""

    def loaded_model(self) -> SessionLM:
        """The model a call runs on (loaded now if needed, its passage cache attached)."""
        ...


def _model_of(lm: ModelLM | ModelProvider) -> ModelLM:
    """``lm`` itself, or the model a :class:`ModelProvider` runs on."""
    return lm.loaded_model() if isinstance(lm, ModelProvider) else lm


# config_from's keywords as load_lm and the chat adapters name them
_SETTING_NAMES = {"recompute_share": "recompute_share", "memory_mb": "passage_cache_memory_mb",
                  "disk_mb": "passage_cache_disk_mb"}


def config_from(passage_cache: Any, *, exact: bool = False, **settings: Any
                ) -> PassageCacheConfig | None:
    """``load_lm``'s passage-cache keywords as a config (None: off); errors name the keyword.
    Without ``passage_cache`` the settings are still checked, and one other than its default
    is refused (it would be ignored: ValueError naming it and ``passage_cache``)."""
    mode = check_passage_cache(passage_cache, exact=exact)
    given = {k: v for k, v in settings.items() if v is not None}
    if mode is not None:
        return PassageCacheConfig(mode=mode, **given)
    defaults = {f.name: f.default for f in fields(PassageCacheConfig)}
    for name, value in given.items():
        PassageCacheConfig(mode="blend", **{name: value})  # TypeError / ValueError naming it
        if value != defaults[name]:
            setting = _SETTING_NAMES.get(name, name)
            needs = "'blend'" if name == "recompute_share" else "'exact' or 'blend'"
            msg = (f"{setting}={value!r} needs passage_cache={needs}: without passage_cache no "
                   "passage cache runs and the setting would be ignored")
            raise ValueError(msg)
    return None


def chunk_head(lm: ModelLM) -> tuple[int, ...]:
    """The ids a blend cache reads each passage after when it computes the passage alone: the
    model's chat template up to a user turn's content (a base model: what its tokenizer puts
    before any text, such as BOS). Read alone from position 0, a passage's first token becomes
    an attention sink (its keys and values are those of a sequence start) and, placed in a
    prompt, the question attends to one false sink per passage; read after the head every
    passage token is computed as in a prompt (APE, Yang et al. ICLR 2025, §3: a shared prefix
    for parallel-encoded contexts). Measured on the 0.5B (30 questions, 15 % recomputed,
    results/system/2026-11-28-blend-variants): first-token KL to a full prefill 0.47 with a
    head against 0.65 without. Passages stay independent of the user's own template: the head
    is the model's chat opener, not the prompt's (the RAG template's own head measured 0.33
    against this one's 0.38)."""
    if lm.has_chat_template:
        first, second = (lm.encode(lm.chat_prompt([{"role": "user", "content": text}]),
                                   add_special_tokens=False) for text in ("Alpha", "Beta"))
    else:
        first, second = (lm.encode(text) for text in ("Alpha", "Beta"))
    common = 0
    while common < min(len(first), len(second)) and first[common] == second[common]:
        common += 1
    return tuple(int(t) for t in first[:common])


def attach(model: Any, config: PassageCacheConfig, *, head: Sequence[int] = (),
           disk_dir: Path | None = None) -> PassageCache:
    """Give a loaded llama.cpp or torch model (``lm.model``) a passage cache, replacing any;
    ``head``: the ids passages are computed after (:func:`chunk_head`)."""
    old = getattr(model, "passage_cache", None)
    if old is not None:
        old.close()
    cache: PassageCache
    if callable(getattr(model, "named_parameters", None)):  # a torch module
        from shared_core.runtime.passage_cache.torch_cache import TorchPassageCache

        cache = TorchPassageCache(model, config, head=head, disk_dir=disk_dir)
    else:
        from shared_core.runtime.passage_cache.llamacpp import LlamaCppPassageCache

        cache = LlamaCppPassageCache(model, config, head=head, disk_dir=disk_dir)
    model.passage_cache = cache
    return cache


def check_memory(lm: SessionLM, mode: str) -> None:
    """Refuse a cache the model's memory cannot hold: stored blocks are cut out of a sequence
    and a blend places them at other positions (``Capabilities.rollback``, ``position_shift``)."""
    caps = lm.capabilities
    if not caps.rollback:
        msg = (f"passage_cache={mode!r} stores and restores KV per position; model {lm.name!r} "
               "keeps a recurrent state, which has no per-position cells (load it without "
               "passage_cache)")
        raise ValueError(msg)
    if mode == "blend" and not caps.position_shift:
        msg = (f"passage_cache='blend' moves cached passages to other positions; model "
               f"{lm.name!r} has multi-axis rotary positions (M-RoPE), which llama.cpp cannot "
               "shift: use passage_cache='exact'")
        raise ValueError(msg)


def passage_cache_of(lm: ModelLM) -> PassageCache | None:
    """The model's passage cache, or None."""
    cache: PassageCache | None = getattr(getattr(lm, "model", None), "passage_cache", None)
    return cache


def source_texts(source: Any, name: str = "texts") -> list[str]:
    """The passage texts of ``source``: a list of strings or documents (``page_content`` /
    ``text`` / ``get_content()``), a LlamaIndex index or docstore (``.docstore`` / ``.docs``), a
    LangChain vector store keeping its texts (``InMemoryVectorStore.store``, FAISS's
    ``docstore._dict``), a specrag retriever (``.documents``), or a retriever over one of these
    (LangChain's ``.vectorstore``, LlamaIndex's ``._index``, a speculative wrapper's
    ``.retriever``). Duck-typed: no framework is imported. Errors name ``name``; a mapping that
    is none of these (``{doc_id: text}``) is refused, since it iterates its keys."""
    source = _unwrapped(source)
    source = getattr(source, "docstore", source)
    for attribute, field in (("docs", None), ("_dict", None), ("store", "text")):
        table = getattr(source, attribute, None)
        if isinstance(table, dict):
            items = list(table.values())
            source = [item[field] if field and isinstance(item, dict) else item for item in items]
            break
    if isinstance(source, Mapping):
        msg = (f"{name} is a {type(source).__name__}, whose keys would be read as the passages; "
               f"pass {name}.values()")
        raise TypeError(msg)
    if (isinstance(source, str) or not isinstance(source, Iterable)
            or hasattr(type(source), "model_fields")):  # a pydantic model iterates its fields
        msg = (f"{name} must be a list of strings or documents, or an index / store / retriever "
               f"that keeps its texts, got {type(source).__name__}")
        raise TypeError(msg)
    return [check_text(_text_of(item), f"{name}[{i}]") for i, item in enumerate(source)]


def _unwrapped(source: Any) -> Any:
    """What a retriever searches, when that keeps its texts (a few wrappers deep)."""
    for _ in range(4):
        documents = getattr(source, "documents", None)
        if isinstance(documents, list):
            return documents
        inner = next((getattr(source, a) for a in ("retriever", "vectorstore", "_index")
                      if getattr(source, a, None) is not None), None)
        if inner is None:
            return source
        source = inner
    return source


def _text_of(item: Any) -> Any:
    for attribute in ("page_content", "text"):
        value = getattr(item, attribute, None)
        if isinstance(value, str):
            return value
    content = getattr(item, "get_content", None)
    return content() if callable(content) else item


def register_passages(lm: ModelLM | ModelProvider, texts: Iterable[Any]) -> int:
    """Tell a blend cache which passages a prompt may contain (each tokenized alone, found in
    prompts by its interior); returns how many were indexed. A no-op without a blend cache.
    ``lm``: the model, or a chat adapter (:class:`ModelProvider`: the model its calls run on)."""
    model = _model_of(lm)
    cache = passage_cache_of(model)
    if cache is None or cache.mode != "blend":
        return 0
    count = 0
    for text in source_texts(texts):
        count += bool(cache.index.add_interior(passage_interior(model.encode, text)))
    return count


def register_passage_ids(lm: ModelLM, ids: Sequence[int]) -> bool:
    """:func:`register_passages` for a passage whose ids a prompt holds verbatim (an engine that
    tokenizes a document on its own and splices it in: RaLMSpec)."""
    cache = passage_cache_of(lm)
    return cache is not None and cache.mode == "blend" and bool(cache.index.add(ids))


def warm_passages(lm: ModelLM | ModelProvider, texts: Iterable[Any], *, progress: bool = False
                  ) -> dict[str, int]:
    """Compute and store the KV of each passage ahead of time (blend caches; on disk too when
    this returns): resumable, since passages already stored are skipped; a tqdm bar with
    ``progress=True`` (off by default, as every library call's). ``lm``: the model, or a chat
    adapter built with ``passage_cache="blend"`` (:class:`ModelProvider`: the model its calls
    run on). ``texts``: strings, documents, a
    LlamaIndex index / docstore or a LangChain vector store (:func:`source_texts`; a
    ``{doc_id: text}`` dict is refused: pass its ``.values()``).

    Returns counts of passages: ``passages`` (all), ``computed`` (computed alone and put in the
    store), ``skipped`` (stored already), ``too_short`` (under ``MIN_PASSAGE`` ids past their
    first word and last id: never cached, prompts read them in full), ``too_long`` (with the
    cache's head they do not fit the model's window, so no prompt can hold them: skipped before
    any model work) and ``not_kept`` (of the computed, those whose KV fits neither the memory
    nor the disk budget: dropped, a warning says so). Too short and too long ones are logged
    once per call, naming the first."""
    provider = lm if isinstance(lm, ModelProvider) else None
    model = _model_of(lm)
    cache = passage_cache_of(model)
    if cache is None or cache.mode != "blend":
        what = "without one" if cache is None else f"with passage_cache={cache.mode!r}"
        given = f" (got {type(provider or model).__name__} {what})"
        msg = ("warm_passages needs a model loaded with passage_cache='blend', or a chat adapter "
               f"built with it{given} (exact reuse keys whole prompt prefixes, which a passage "
               "alone does not give)")
        raise ValueError(msg)
    from tqdm.auto import tqdm

    from shared_core.runtime.lm import LM, window_text

    if not isinstance(model, LM):  # a cache lives on an in-process model's weights
        msg = f"warm_passages needs an in-process model, got {type(model).__name__}"
        raise TypeError(msg)
    items = source_texts(texts)
    counts = dict.fromkeys(("computed", "skipped", "too_short", "too_long", "not_kept"), 0)
    first: dict[str, tuple[int, int]] = {}  # too short / too long: the first one's index, ids
    for i, text in enumerate(tqdm(items, desc="passage KV", disable=not progress,
                                  unit="passage")):
        inner = passage_interior(model.encode, text)
        if not inner:
            why = "too_short"
        elif len(cache.head) + len(inner) + 1 > model.max_context:  # + a question's id at least
            why = "too_long"
        else:
            cache.index.add_interior(inner)
            before = _not_kept(cache)
            computed = cache.warm(model, inner)
            why = "computed" if computed else "skipped"
            if computed and _not_kept(cache) > before:
                counts["not_kept"] += 1
        counts[why] += 1
        if why in ("too_short", "too_long"):
            first.setdefault(why, (i, len(inner)))
    if cache.store is not None:  # a copied torch model's cache binds its store on first use
        cache.store.flush()  # warmed ahead of time: on disk when this returns, for other processes
    _log_warm(counts, first, len(cache.head), window_text(model), cache.config)
    return {"passages": len(items), **counts}


def _not_kept(cache: PassageCache) -> int:
    """The entries the cache's store has dropped for fitting neither budget."""
    return 0 if cache.store is None else cache.store.stats.not_kept


def _log_warm(counts: dict[str, int], first: dict[str, tuple[int, int]], head: int,
              window: str, config: PassageCacheConfig) -> None:
    if "too_short" in first:
        i, _ = first["too_short"]
        logger.warning("warm_passages: %d passage(s) (the first: texts[%d]) have fewer than "
                       "MIN_PASSAGE=%d ids past their first word and last id: too short to "
                       "cache, prompts read them in full", counts["too_short"], i, MIN_PASSAGE)
    if "too_long" in first:
        i, length = first["too_long"]
        logger.warning("warm_passages: %d passage(s) skipped as longer than the window (the "
                       "first: texts[%d], %d ids after the cache's %d-id head, does not fit %s "
                       "with a question): no prompt can hold them", counts["too_long"], i,
                       length, head, window)
    if counts["not_kept"]:
        logger.warning("warm_passages: %d of %d passage(s) computed were not kept: their KV fits "
                       "neither passage_cache_memory_mb=%d nor passage_cache_disk_mb=%d (raise "
                       "one)", counts["not_kept"], counts["computed"], config.memory_mb,
                       config.disk_mb)
    logger.info("warm_passages: %s", counts)


def clear_passages(lm: ModelLM | ModelProvider) -> int:
    """Forget every passage KV the model's cache holds, in memory and on disk (its own folder;
    other models' entries stay), and the prompt prefixes the model keeps for reuse
    (:func:`shared_core.runtime.lm.clear_prefix_cache`): the next prompt is read cold, its
    passages anew. Registered passages stay known. ``lm``: the model, or a chat adapter
    (:class:`ModelProvider`). Returns the disk entries deleted (0 without a cache)."""
    model = _model_of(lm)
    cache = passage_cache_of(model)
    if cache is None:
        return 0
    from shared_core.runtime.lm import clear_prefix_cache

    clear_prefix_cache(model)
    store = cache.store
    if store is None:  # a copied torch model's cache not bound to a store yet
        return 0
    removed = int(store.clear())
    logger.info("clear_passages: %d disk entries deleted", removed)
    return removed


def passage_stats(lm: ModelLM | ModelProvider) -> dict[str, Any]:
    """The cache's store counters and its last prefill's report ({} without a cache); ``lm``:
    the model, or a chat adapter (:class:`ModelProvider`)."""
    cache = passage_cache_of(_model_of(lm))
    return cache.stats() if cache is not None else {}


def ensure(lm: ModelLM, config: PassageCacheConfig | None) -> None:
    """Give ``lm`` the passage cache ``config`` asks for (None: keep what it has). A served
    model, a blend cache on an exact model, or a loaded model that already has another cache is
    refused (ValueError naming ``passage_cache``; a model is loaded once per process)."""
    if config is None:
        return
    backend = getattr(lm, "backend", "torch")
    if backend not in ("llama.cpp", "torch"):
        msg = (f"passage_cache={config.mode!r} runs on torch and llama.cpp models; model "
               f"{getattr(lm, 'name', lm)!r} runs on {backend} (turn on the server's own cache)")
        raise ValueError(msg)
    local = cast("SessionLM", lm)  # an in-process runtime, checked above
    check_memory(local, config.mode)
    if backend == "llama.cpp":
        exact = bool(local.model.settings.exact)
    else:
        from shared_core.runtime.torch.prefix import store_for

        store = store_for(local.model)
        exact = store is not None and store.exact
    check_passage_cache(config.mode, exact=exact)
    current = passage_cache_of(lm)
    if current is None:
        attach(local.model, config, head=chunk_head(lm))
    elif current.config != config:
        msg = (f"passage_cache={config.mode!r}: model {lm.name!r} already has a passage cache "
               f"({current.config}); pass the same settings or release the model first")
        raise ValueError(msg)
