"""The RaLMSpec adapters on the fast runtime: ``backend=`` as on every other
adapter (default ``"auto"``, the one default in :mod:`shared_core.config`, checked when the
adapter is built), reaching the model cache; and no transformers deprecation warning from our
model calls."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
from fakes import ADAPTER_DOCS, LCRetriever, LIRetriever

from langchain_specrag import ChatSpeculative, RaLMSpecRunnable
from llamaindex_specrag import RaLMSpecQueryEngine
from shared_core.config import DEFAULT_BACKEND
from shared_core.frontend import serving
from shared_core.runtime.model_lock import lock_for

ADAPTERS = {"langchain": lambda **kw: RaLMSpecRunnable(retriever=LCRetriever(ADAPTER_DOCS), **kw),
            "llamaindex": lambda **kw: RaLMSpecQueryEngine(retriever=LIRetriever(ADAPTER_DOCS),
                                                           **kw)}


def _answer(adapter: Any) -> str:
    return adapter.invoke("Where is Paris?") if hasattr(adapter, "invoke") else str(
        adapter.query("Where is Paris?"))


@pytest.mark.parametrize("framework", list(ADAPTERS))
def test_backend_defaults_to_auto_like_the_chat_adapters_and_is_checked(framework: str) -> None:
    assert ADAPTERS[framework]().backend == DEFAULT_BACKEND == ChatSpeculative().backend == "auto"
    with pytest.raises(ValueError, match="backend"):
        ADAPTERS[framework](backend="cuda")


@pytest.mark.parametrize("backend", ["auto", "llama.cpp", "torch"])
@pytest.mark.parametrize("framework", list(ADAPTERS))
def test_the_backend_reaches_the_model_cache_and_no_deprecation_warning_shows(
        framework: str, backend: str, tiny_target, monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[tuple[str, str]] = []

    def loaded(model: str, device: Any = None, dtype: Any = None, backend: str = "torch",
               prefix_cache: Any = None) -> Any:
        asked.append((model, backend))
        return tiny_target, lock_for(tiny_target)  # the tiny torch model stands in

    monkeypatch.setattr(serving, "loaded_model", loaded)
    adapter = ADAPTERS[framework](model="org/some-model", backend=backend, max_new_tokens=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # transformers' past_key_values rename
        warnings.simplefilter("error", DeprecationWarning)
        assert isinstance(_answer(adapter), str)
    assert asked == [("org/some-model", backend)]
    adapter.backend = "torch" if backend != "torch" else "auto"  # a changed setting: a new engine
    _answer(adapter)
    assert asked[-1] == ("org/some-model", adapter.backend)
