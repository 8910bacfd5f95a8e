"""The one model resolver and process-wide cache: a name, path, URL or LoRA name -> one model.

:func:`resolve_lm` is how every engine, adapter and benchmark that takes a model *name* gets it:

- an object (an :class:`~shared_core.runtime.lm.LM`, a :class:`~shared_core.runtime.remote.RemoteLM`, a fake)
  is used as given;
- ``http://`` / ``https://`` is a served model (vLLM / SGLang), a :class:`RemoteLM`;
- ``"<base>+specrag"`` is a shipped LoRA-tuned drafter (:mod:`shared_core.runtime.weights.lora`);
- anything else goes to :func:`~shared_core.runtime.models.load_lm` (alias, hub id, folder, ``.gguf``)
  on ``backend``.

Each result is kept once per ``(name, device, dtype, backend)``, so two engines (or an engine
and an adapter) naming the same model share one copy of the weights, and with it the one lock
of :func:`shared_core.runtime.model_lock.lock_for`. :func:`release` / :func:`release_all` drop loaded
models (users running a generation keep their reference).

``prefix_cache`` (``load_lm``'s prompt-prefix budget, docs/backends.md), llama.cpp's
``n_ctx`` / ``n_threads`` and ``exact`` are not part of the key, so one model never has two copies: the first
load fixes them, ``None`` later takes what was loaded, and a different explicit setting for a
loaded model is refused (ValueError naming it; release the model first). Served models and tuned
drafters ignore them.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

from shared_core.config import LOAD_LM_BACKEND, check_prefix_cache
from shared_core.runtime.model_lock import FairLock, lock_for
from shared_core.runtime.weights.lora import ADAPTERS, SUFFIX
from shared_core.util.per_object import PerObject

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer

    from shared_core.runtime.protocol import ModelLM, SessionLM

Key = tuple[str, str | None, str | None, str]
PrefixCache = bool | int | None  # load_lm's prefix_cache
_LOADED: dict[Key, ModelLM] = {}
# models dropped by release(): objects that keep state for an adapter across calls (its engine
# decoders) let go of them (engines.loop.kept), so the adapter pins no released model
RELEASED: PerObject[bool] = PerObject(lambda: True)


def models_of(kept: object) -> tuple[object, ...]:
    """The models a decoder or engine holds (its ``lm`` and ``draft_lm``)."""
    return tuple(m for m in (getattr(kept, "lm", None), getattr(kept, "draft_lm", None))
                 if m is not None)


def holds_released(kept: object, in_use: tuple[object, ...] = ()) -> bool:
    """Whether ``kept`` (a decoder, an engine) holds a model :func:`release` dropped that the
    call at hand does not run on (``in_use``: a caller still running on a released model it
    holds keeps its state): its keeper lets it go (or rebuilds it) instead of pinning it."""
    return any(RELEASED.holds(m) and not any(m is u for u in in_use) for m in models_of(kept))


@dataclass(frozen=True)
class _LoadSettings:
    """The load settings outside the key that a model in ``_LOADED`` loaded with."""

    prefix_cache: PrefixCache = None
    n_ctx: int | None = None
    n_threads: int | None = None
    exact: bool | None = None  # None: load_lm's default (off)

    def conflict(self, loaded: _LoadSettings) -> str | None:
        """The first setting given here (not None) that ``loaded`` has otherwise."""
        if (self.prefix_cache is not None
                and _prefix_setting(self.prefix_cache) != _prefix_setting(loaded.prefix_cache)):
            return "prefix_cache"
        if self.exact is not None and self.exact != bool(loaded.exact):
            return "exact"
        return next((name for name in ("n_ctx", "n_threads")
                     if getattr(self, name) not in (None, getattr(loaded, name))), None)


_SETTINGS: dict[Key, _LoadSettings] = {}  # what each model in _LOADED loaded with
_EMBEDDERS: dict[tuple[str, str | None], SentenceTransformer] = {}
_LOCK = threading.Lock()
_URL_SCHEMES = ("http://", "https://")


def is_url(name: str) -> bool:
    """Whether ``name`` names a served model (an ``http(s)://`` URL)."""
    return name.strip().lower().startswith(_URL_SCHEMES)


def _key(name: str, device: str | None, dtype: str | None, backend: str) -> Key:
    """The cache key; settings a kind of model ignores are left out, so they share one copy."""
    if is_url(name):
        return (name, None, None, "served")
    if name.endswith(SUFFIX):
        return (name, None, dtype, "torch")
    return (name, device, dtype, backend)


def _load(name: str, device: str | None, dtype: str | None, backend: str, served: bool,
          settings: _LoadSettings | None = None) -> ModelLM:
    if served and is_url(name):
        from shared_core.runtime.remote import RemoteLM

        return RemoteLM(name)
    if name.endswith(SUFFIX):
        from shared_core.runtime.weights.lora import load_tuned_drafter

        return load_tuned_drafter(name, dtype)
    from shared_core.runtime.models import load_lm

    settings = settings or _LoadSettings()
    return load_lm(name, device=device, dtype=dtype, backend=backend,
                   prefix_cache=settings.prefix_cache, n_ctx=settings.n_ctx,
                   n_threads=settings.n_threads, exact=bool(settings.exact))


def _prefix_setting(prefix_cache: PrefixCache) -> str | int:
    """What a ``prefix_cache`` value means: ``"on"`` (the default budget), ``"off"`` or a budget
    (``True`` is not ``1``: one context / MiB)."""
    if prefix_cache is None or prefix_cache is True:
        return "on"
    if prefix_cache is False or prefix_cache == 0:
        return "off"
    return int(prefix_cache)


def _check_same_settings(key: Key, settings: _LoadSettings) -> None:
    """ValueError naming the setting when a loaded model was loaded with another value."""
    loaded = _SETTINGS.get(key, _LoadSettings())
    name = None if key[3] == "served" or key[0].endswith(SUFFIX) else settings.conflict(loaded)
    if name is not None:
        msg = (f"{name}={getattr(settings, name)!r}: model {key[0]!r} is already loaded with "
               f"{name}={getattr(loaded, name)!r} and a model is loaded once per process; pass "
               "the same setting (or leave it None), or release the model first "
               "(shared_core.frontend.serving.release)")
        raise ValueError(msg)


def cached_lm(name: str, device: str | None = None, dtype: str | None = None,
              backend: str = LOAD_LM_BACKEND, *, served: bool = True,
              prefix_cache: PrefixCache = None, n_ctx: int | None = None,
              n_threads: int | None = None, exact: bool | None = None) -> ModelLM:
    """The process-wide model for a name, path, URL or LoRA name (see the module docstring).

    ``served=False`` is for callers that need an in-process model (the token engines): a URL
    then fails naming it, before any connection. Loading happens under a lock, so concurrent
    first calls load once; a failed load caches nothing and the next call tries again.
    ``prefix_cache``, ``n_ctx``, ``n_threads`` and ``exact`` reach :func:`~shared_core.runtime.models.load_lm`
    on the first load and must agree with it afterwards (module docstring).
    """
    check_prefix_cache(prefix_cache)
    settings = _LoadSettings(prefix_cache, n_ctx, n_threads, exact)
    if not served and is_url(name):  # not the cached client: load_lm refuses it, naming the URL
        return _load(name, device, dtype, backend, served)
    key = _key(name, device, dtype, backend)
    with _LOCK:
        if key in _LOADED:
            _check_same_settings(key, settings)
        else:
            _LOADED[key] = _load(name, device, dtype, backend, served, settings)
            _SETTINGS[key] = settings
        return _LOADED[key]


def resolve_lm(model: str | ModelLM, *, device: str | None = None, dtype: str | None = None,
               backend: str = LOAD_LM_BACKEND, prefix_cache: PrefixCache = None) -> ModelLM:
    """``model`` as a model object: a string through the shared cache (:func:`cached_lm`),
    anything else as given."""
    if isinstance(model, str):
        return cached_lm(model, device, dtype, backend, prefix_cache=prefix_cache)
    return model


def loaded_model(model: str, device: str | None = None, dtype: str | None = None,
                 backend: str = LOAD_LM_BACKEND, prefix_cache: PrefixCache = None,
                 n_ctx: int | None = None, n_threads: int | None = None,
                 exact: bool | None = None) -> tuple[SessionLM, FairLock]:
    """The shared in-process ``(model, lock)`` for a model config (the adapters' token engines),
    loaded on first use; a served model's URL is refused."""
    lm = cached_lm(model, device, dtype, backend, served=False, prefix_cache=prefix_cache,
                   n_ctx=n_ctx, n_threads=n_threads, exact=exact)
    return cast("SessionLM", lm), lock_for(lm)  # served=False: cached_lm refused a URL


def loaded_copies(name: str) -> list[ModelLM]:
    """The copies of ``name`` loaded in this process, one per device / dtype / backend key."""
    with _LOCK:
        return [lm for key, lm in _LOADED.items() if key[0] == name]


def release(name: str, device: str | None = None, dtype: str | None = None,
            backend: str | None = None) -> bool:
    """Drop cached copies of a model; True if one was cached: the copy of that key when
    ``backend`` is given, else every copy of ``name`` (whatever device, dtype and backend it
    loaded with; the adapters load with ``backend="auto"``).

    Generations already running keep their reference until they end; the next call that names
    the model loads it again. Adapters look the model up on every call, so they do not pin it.
    """
    with _LOCK:
        keys = ([_key(name, device, dtype, backend)] if backend is not None
                else [key for key in _LOADED if key[0] == name])
        for key in keys:
            _SETTINGS.pop(key, None)
        dropped = [lm for lm in (_LOADED.pop(key, None) for key in keys) if lm is not None]
        for lm in dropped:
            RELEASED.get(lm)
        return bool(dropped)


def release_all() -> int:
    """Drop every cached model; return how many were dropped."""
    with _LOCK:
        n = len(_LOADED)
        for lm in _LOADED.values():
            RELEASED.get(lm)
        _LOADED.clear()
        _SETTINGS.clear()
        return n


def check_model_name(name: object, param: str) -> None:
    """Reject an unknown alias or LoRA name before loading anything (objects pass)."""
    if not isinstance(name, str) or is_url(name):
        return
    from shared_core.runtime.weights.embedded import EMBEDDED_LMS

    if name.endswith(SUFFIX) and name not in ADAPTERS:
        msg = f"{param}={name!r}: no tuned adapter; known: {', '.join(sorted(ADAPTERS))}"
        raise ValueError(msg)
    base = name.removesuffix(SUFFIX)
    if base in EMBEDDED_LMS or "/" in base or base.startswith((".", "~")):
        return
    known = ", ".join(sorted(EMBEDDED_LMS))
    msg = (f"{param}={name!r} is not a known model alias; use one of {known}, a Hugging Face id "
           "(org/name), a local folder, a served model's URL or an LM object")
    raise ValueError(msg)


def cached_embedder(name: str, device: str | None = None) -> SentenceTransformer:
    """The process-wide :func:`~shared_core.runtime.models.load_embedder` result for ``name`` on
    ``device`` (retrievers, stores, engines and the embedding adapters share one copy; a failed
    load caches nothing)."""
    key = (name, device)
    with _LOCK:
        if key not in _EMBEDDERS:
            from shared_core.runtime.models import load_embedder

            _EMBEDDERS[key] = load_embedder(name, device=device)
        return _EMBEDDERS[key]
