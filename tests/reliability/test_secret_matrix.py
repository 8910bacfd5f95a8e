"""Secrets as a class: a credential of each kind is planted in each
setting that can hold a served model's URL, and every form that setting leaves the process in
is searched for it: repr, str, pickle, pydantic dumps (``model_dump``, ``model_dump_json``,
``dict``, ``json``), LlamaIndex ``to_dict`` / ``to_json``, LangChain ``dumpd`` / ``dumps``, what
callbacks and instrumentation events receive, the error of a call (str, args, traceback) and
every log record (httpx's included).

The calls are real: a local HTTP server answers 401 and echoes the request (URL and headers) in
its body, as proxies do; no model is loaded (a URL reaches a model loader only to be refused or
to connect).
"""

from __future__ import annotations

import logging
import pickle
import traceback
import warnings
from collections.abc import Callable
from typing import Any, ClassVar
from urllib.parse import quote, unquote

import pytest
from fakes import ADAPTER_DOCS, LCRetriever, LIRetriever
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.documents import Document as LCDocument
from langchain_core.load import dumpd, dumps
from llama_index.core.callbacks import CallbackManager
from llama_index.core.callbacks.base_handler import BaseCallbackHandler as LIBaseHandler
from llama_index.core.instrumentation import get_dispatcher
from llama_index.core.instrumentation.event_handlers import BaseEventHandler
from pydantic import BaseModel
from recording_server import recording_server

from langchain_specrag import SpecragEmbeddings
from langchain_specrag.chat_models.speculative import ChatSpeculative
from langchain_specrag.runnables.ralmspec import RaLMSpecRunnable
from langchain_specrag.runnables.speculative_rag import SpeculativeRAGRunnable
from llamaindex_specrag import SpecragEmbedding
from llamaindex_specrag.llms.speculative import SpeculativeLLM
from llamaindex_specrag.query_engines.ralmspec import RaLMSpecQueryEngine
from llamaindex_specrag.query_engines.speculative_rag import SpeculativeRAGQueryEngine
from shared_core.runtime.remote import RemoteConfig, RemoteLM
from shared_core.runtime.remote.config import API_KEY_ENV

FAST = RemoteConfig(max_retries=0, connect_timeout_s=5.0)
MODEL = "smollm2-135m-instruct"


def _query(name: str) -> Callable[[str, str], str]:
    return lambda base, secret: f"{base}/v1?model=m&{name}={secret}&x=1"


# secret kind -> the URL a user writes with ``secret`` in it (``base``: http://127.0.0.1:<port>)
KINDS: dict[str, Callable[[str, str], str]] = {
    "user-info password": lambda base, s: base.replace("http://", f"http://alice:{s}@") + "/v1",
    **{f"?{name}=": _query(name) for name in (
        "key", "api_key", "apikey", "token", "access_token", "sig", "signature", "secret",
        "password", "Key", "API-KEY", "X-Amz-Signature", "X-Amz-Security-Token",
        "X-Goog-Signature")},
    "X-Amz-Credential": lambda base, s: (f"{base}/v1?X-Amz-Algorithm=AWS4-HMAC-SHA256&"
                                         f"X-Amz-Credential={s}%2F20260101%2Fus-east-1%2Fs3"),
    "Authorization header": lambda base, s: f"{base}/v1",  # the key: $SPECRAG_REMOTE_API_KEY
}
QUESTION = {"question": "Where is Paris?", "documents": [LCDocument(page_content=ADAPTER_DOCS[0].text)]}


class LCRecorder(BaseCallbackHandler):
    """Everything LangChain hands a callback handler at the start and error of a run."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def _keep(self, *args: Any, **kwargs: Any) -> None:
        self.seen.append(repr((args, kwargs)))

    on_chat_model_start = on_llm_start = on_chain_start = on_retriever_start = _keep
    on_llm_error = on_chain_error = on_custom_event = _keep


class LIRecorder(LIBaseHandler):
    """LlamaIndex's legacy callbacks (their payload holds the LLM's ``to_dict()``)."""

    def __init__(self) -> None:
        super().__init__([], [])
        self.seen: list[str] = []

    def on_event_start(self, event_type: Any, payload: Any = None, event_id: str = "",
                       parent_id: str = "", **kwargs: Any) -> str:
        self.seen.append(repr(payload))
        return event_id

    def on_event_end(self, event_type: Any, payload: Any = None, event_id: str = "",
                     **kwargs: Any) -> None:
        self.seen.append(repr(payload))

    def start_trace(self, trace_id: str | None = None) -> None:
        pass

    def end_trace(self, trace_id: str | None = None, trace_map: Any = None) -> None:
        pass


class EventRecorder(BaseEventHandler):
    """LlamaIndex instrumentation events (``LLMChatStartEvent.model_dict`` and the rest)."""

    seen: ClassVar[list[str]] = []

    @classmethod
    def class_name(cls) -> str:
        return "EventRecorder"

    def handle(self, event: Any, **kwargs: Any) -> None:
        self.seen.append(repr(event.model_dump()))


# setting -> (build the object(s) holding ``url``, the call that sends it somewhere or None)
Built = tuple[Any, Callable[[], Any] | None]


def _chat(url: str, lc: LCRecorder, li: LIRecorder) -> Built:
    chat = ChatSpeculative(model=url)
    return chat, lambda: chat.invoke("hi", config={"callbacks": [lc]})


def _llm(url: str, lc: LCRecorder, li: LIRecorder) -> Built:
    llm = SpeculativeLLM(model=url, context_window=2048, callback_manager=CallbackManager([li]))
    return llm, lambda: llm.complete("hi")


# both roles hold the URL: a call stops at the drafter, before any model runs
def _specrag_lc(url: str, lc: LCRecorder, li: LIRecorder) -> Built:
    runnable = SpeculativeRAGRunnable(drafter=url, verifier=url)
    return runnable, lambda: runnable.invoke(QUESTION, config={"callbacks": [lc]})


def _specrag_li(url: str, lc: LCRecorder, li: LIRecorder) -> Built:
    engine = SpeculativeRAGQueryEngine(retriever=LIRetriever(ADAPTER_DOCS[:2]), drafter=url,
                                       verifier=url)
    return engine, lambda: engine.query("Where is Paris?")


def _ralm_lc(url: str, lc: LCRecorder, li: LIRecorder) -> Built:
    runnable = RaLMSpecRunnable(model=url, retriever=LCRetriever(ADAPTER_DOCS))
    return runnable, lambda: runnable.invoke("Where is Paris?", config={"callbacks": [lc]})


def _ralm_li(url: str, lc: LCRecorder, li: LIRecorder) -> Built:
    engine = RaLMSpecQueryEngine(model=url, retriever=LIRetriever(ADAPTER_DOCS))
    return engine, lambda: engine.query("Where is Paris?")


SETTINGS: dict[str, Callable[..., Built]] = {
    "ChatSpeculative(model=)": _chat,
    "ChatSpeculative(engine_options=)": lambda url, lc, li: (ChatSpeculative(
        model=MODEL, engine="rapid", engine_options={"embedder": url}), None),
    "ChatSpeculative(base_url=, api_key=) (ignored)": lambda url, lc, li: (ChatSpeculative(
        model=MODEL, base_url=url, api_key=unquote(url)), None),
    "SpeculativeLLM(model=)": _llm,
    "SpeculativeLLM(engine_options=)": lambda url, lc, li: (SpeculativeLLM(
        model=MODEL, context_window=2048, engine="rapid", engine_options={"embedder": url}), None),
    "SpeculativeRAGRunnable(drafter=, verifier=)": _specrag_lc,
    "SpeculativeRAGQueryEngine(drafter=, verifier=)": _specrag_li,
    "RaLMSpecRunnable(model=)": _ralm_lc,
    "RaLMSpecQueryEngine(model=)": _ralm_li,
    "RemoteLM(url)": lambda url, lc, li: (None, lambda: RemoteLM(url, config=FAST)),
    "SpecragEmbeddings(model=)": lambda url, lc, li: (None, lambda: SpecragEmbeddings(model=url)),
    "SpecragEmbedding(model_name=)": lambda url, lc, li: (None, lambda: SpecragEmbedding(
        model_name=url)),
}


def object_forms(obj: Any) -> dict[str, str]:
    """Every serialized form of an adapter (those its classes have)."""
    forms = {"repr": repr(obj), "str": str(obj)}
    try:
        forms["pickle"] = pickle.dumps(obj).decode("latin-1")
    except TypeError as e:  # refused: the refusal is a form too
        forms["pickle"] = str(e)
    views: dict[str, Callable[[], Any]] = {}
    if isinstance(obj, BaseModel):
        views |= {"model_dump": obj.model_dump, "model_dump_json": obj.model_dump_json,
                  "dict": obj.dict, "json": obj.json}
    if hasattr(obj, "to_dict"):
        views |= {"to_dict": obj.to_dict, "to_json": obj.to_json}
    if hasattr(obj, "lc_id"):
        views |= {"dumpd": lambda: dumpd(obj), "dumps": lambda: dumps(obj)}
    for name, view in views.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # pydantic's dict() / json()
                forms[name] = repr(view())
        except ValueError as e:  # e.g. JSON of a retriever object: the error is the form
            forms[name] = str(e)
    return forms


def error_forms(exc: BaseException) -> dict[str, str]:
    return {"error str": str(exc), "error args": repr(exc.args),
            "traceback": "".join(traceback.format_exception(exc))}


def leaked(forms: dict[str, str], secret: str) -> list[str]:
    """The forms holding the secret, as written or URL-encoded / decoded."""
    variants = {secret, quote(secret, safe=""), unquote(secret)}
    return [name for name, text in forms.items() if any(v in text for v in variants)]


@pytest.fixture(scope="module")
def server():
    with recording_server(status=401) as recording:
        yield recording


def all_forms(setting: str, url: str, caplog: pytest.LogCaptureFixture) -> dict[str, str]:
    lc, li = LCRecorder(), LIRecorder()
    dispatcher = get_dispatcher()
    events = EventRecorder()
    dispatcher.add_event_handler(events)
    try:
        forms: dict[str, str] = {}
        call: Callable[[], Any] | None = None
        try:
            obj, call = SETTINGS[setting](url, lc, li)
        except (TypeError, ValueError) as e:  # refused at construction: the error is a form
            obj, forms = None, error_forms(e)
        if obj is not None:
            forms |= object_forms(obj)
        if call is not None:
            with pytest.raises(Exception) as info:  # any error: its forms are read
                call()
            forms |= error_forms(info.value)
    finally:
        dispatcher.event_handlers.remove(events)
    forms["callbacks"] = "\n".join(lc.seen + li.seen)
    forms["events"] = "\n".join(events.seen)
    forms["logs"] = "\n".join(r.getMessage() for r in caplog.records)
    return forms


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_planted_secret_leaves_in_no_form(kind: str, setting: str, server, caplog,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    caplog.set_level(logging.DEBUG)  # every logger, httpx's included
    # one secret per case, so no other case can have registered it for redaction
    secret = f"Plt{list(KINDS).index(kind)}x{list(SETTINGS).index(setting)}zQ"
    url = KINDS[kind](server.url, secret)
    if kind == "Authorization header":
        monkeypatch.setenv(API_KEY_ENV, secret)
    server.requests.clear()
    forms = all_forms(setting, url, caplog)
    assert leaked(forms, secret) == [], f"{kind} planted in {setting} leaks"
    if server.requests and kind == "Authorization header":  # the credential still went out
        assert all(r.headers["Authorization"] == f"Bearer {secret}" for r in server.requests)
    elif server.requests and kind != "user-info password":
        assert all(secret in unquote(r.query) for r in server.requests)
