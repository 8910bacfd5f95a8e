"""Secrets never leave (issue 28 deliverable 3): a URL's password and an API key are planted, and
every message, log record, repr, str and pickle of the objects involved is searched for them.

The connection errors are real (a closed local port refuses); server answers come from an
``httpx.MockTransport``.
"""

from __future__ import annotations

import logging
import pickle
import traceback
from typing import Any

import httpx
import pytest

from langchain_specrag.chat_models.speculative import ChatSpeculative
from langchain_specrag.runnables.ralmspec import RaLMSpecRunnable
from langchain_specrag.runnables.speculative_rag import SpeculativeRAGRunnable
from llamaindex_specrag.llms.speculative import SpeculativeLLM
from llamaindex_specrag.query_engines.ralmspec import RaLMSpecQueryEngine
from shared_core.runtime.models import load_lm
from shared_core.runtime.remote import RemoteConfig, RemoteError, RemoteLM
from shared_core.runtime.remote.http import Transport
from shared_core.util.redact import EXCERPT_CHARS, excerpt, redact

PASSWORD = "pw-5ecret-Planted-7781"
API_KEY = "sk-planted-API-key-0042"
SECRETS = (PASSWORD, API_KEY)
CLOSED = f"http://alice:{PASSWORD}@127.0.0.1:9"  # port 9 (discard) refuses connections
FAST = RemoteConfig(max_retries=1, backoff_s=0.0, connect_timeout_s=5.0)


def leaks(*things: Any) -> list[str]:
    """Every str / repr / pickle of ``things`` (and an exception's args and traceback text,
    its cause included) that contains a planted secret."""
    found = []
    for thing in things:
        views = {"str": str(thing), "repr": repr(thing)}
        if isinstance(thing, BaseException):
            views["args"] = repr(thing.args)
            views["traceback"] = "".join(traceback.format_exception(thing))
        try:
            views["pickle"] = pickle.dumps(thing).decode("latin-1")
        except (TypeError, pickle.PicklingError, AttributeError) as e:
            views["pickle refused"] = str(e)
        found += [f"{type(thing).__name__} {view}" for view, text in views.items()
                  if any(s in text for s in SECRETS)]
    return found


def logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if any(s in r.getMessage() for s in SECRETS)]


@pytest.fixture(autouse=True)
def all_logs(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)  # every logger, httpx's included


def test_redact_covers_urls_keys_headers_and_registered_values() -> None:
    text = (f"GET {CLOSED}/v1?api_key={API_KEY}&x=1 headers={{'Authorization': 'Bearer "
            f"{API_KEY}'}} token: {API_KEY} password={PASSWORD}")
    out = redact(text)
    assert not any(s in out for s in SECRETS), out
    assert "http://***@127.0.0.1:9/v1" in out and "x=1" in out
    assert redact("max_tokens=16 token_ids=[1, 2]") == "max_tokens=16 token_ids=[1, 2]"
    quoted = excerpt("a\x00b\x1b[31m\r\n" + "y" * 1000)
    assert len(quoted) <= EXCERPT_CHARS and quoted.startswith("a b [31m y")
    assert not any(ord(c) < 32 for c in quoted)


def test_refused_connection_errors_and_logs_hold_no_secret(caplog) -> None:
    with pytest.raises(RemoteError) as info:
        RemoteLM(f"{CLOSED}/", api_key=API_KEY, config=FAST)
    err = info.value
    assert "127.0.0.1:9" in str(err)  # still says where it failed
    assert leaks(err) == [] and logged(caplog) == []
    assert "retrying" in caplog.text  # the retry was logged, redacted


def test_server_answers_are_short_sanitised_and_redacted(caplog) -> None:
    seen: list[str] = []

    def server(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization", ""))
        body = (f"bad credentials {PASSWORD} / Authorization: Bearer {API_KEY}\x00\x1b[2J"
                + "z" * 2000)
        return httpx.Response(503 if len(seen) == 1 else 401, text=body)

    http = Transport(f"https://bob:{PASSWORD}@models.internal:8443", api_key=API_KEY, config=FAST,
                     transport=httpx.MockTransport(server))
    with pytest.raises(RemoteError) as info:
        http.request("GET", "/v1/models")
    err = info.value
    # behaviour kept: the URL's user-info is sent as basic auth (it wins over the bearer key)
    assert seen and seen[0] == httpx.BasicAuth("bob", PASSWORD)._auth_header
    assert err.status == 401 and "https://models.internal:8443/v1/models" in str(err)
    body = str(err).split("RemoteLM(api_key) or $SPECRAG_REMOTE_API_KEY): ", 1)[1]
    assert len(body) <= EXCERPT_CHARS and not any(ord(c) < 32 for c in body)
    assert leaks(err, http) == [] and logged(caplog) == []
    assert pickle.loads(pickle.dumps(err)).status == 401


def test_a_key_in_the_url_query_stays_out_of_messages(caplog) -> None:
    with pytest.raises(RemoteError) as info:
        RemoteLM(f"http://127.0.0.1:9/?api_key={API_KEY}", config=FAST)
    assert "api_key=***" in str(info.value)
    assert leaks(info.value) == [] and logged(caplog) == []


def test_adapters_wrapping_a_url_hold_no_secret(caplog) -> None:
    url = f"{CLOSED}/v1"
    chat = ChatSpeculative(model=url)
    llm = SpeculativeLLM(model=url, context_window=2048)  # metadata without loading
    ralm = RaLMSpecRunnable(model=url)
    specrag = SpeculativeRAGRunnable(drafter=url, verifier=url)
    query_engine = RaLMSpecQueryEngine(model=url)
    views = [chat._identifying_params, chat._get_ls_params(), llm.metadata]
    assert leaks(chat, llm, ralm, specrag, query_engine, *views) == []
    with pytest.raises(ValueError, match="served model's URL") as info:
        chat.invoke("hello")
    assert leaks(info.value) == [] and logged(caplog) == []
    with pytest.raises(ValueError, match="served model's URL") as info:
        load_lm(url)
    assert "http://***@127.0.0.1:9/v1" in str(info.value) and leaks(info.value) == []


def test_engine_options_pickle_as_validated_plain_settings_without_secrets(caplog) -> None:
    """Issue 28: ``engine_options`` reach a pickle only as options the engine takes, plain data,
    each URL's user-info stripped (nested too); a live object there is refused by name."""
    url = f"{CLOSED}/embed"
    options = {"embedder": url, "min_rag_tokens": 64, "eta": 0.0}
    chat = ChatSpeculative(model="smollm2-135m-instruct", engine="rapid", engine_options=options)
    llm = SpeculativeLLM(model="smollm2-135m-instruct", context_window=2048,
                         engine_options={"corpus": [f"notes kept at {url}", "plain text"]})
    assert leaks(chat, llm) == [] and logged(caplog) == []
    copy = pickle.loads(pickle.dumps(chat))
    assert copy.engine_options == {**options, "embedder": "http://127.0.0.1:9/embed"}
    assert chat.engine_options["embedder"] == url  # the live instance keeps what it was given
    assert pickle.loads(pickle.dumps(llm)).engine_options["corpus"] == [
        "notes kept at http://***@127.0.0.1:9/embed", "plain text"]
    remote = RemoteLM.__new__(RemoteLM)  # a live object standing in for a served draft model
    chat.engine_options = {"draft_lm": remote}
    with pytest.raises(TypeError, match=r"engine_options\['draft_lm'\] holds a RemoteLM") as info:
        pickle.dumps(chat)
    assert leaks(info.value) == []
    chat.engine_options = {"api_key": API_KEY}  # set after construction: refused in the pickle
    with pytest.raises(TypeError, match="'api_key'") as info:
        pickle.dumps(chat)
    assert leaks(info.value) == []
