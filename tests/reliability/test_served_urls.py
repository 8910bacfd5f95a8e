"""Served-model base URLs as users write them: a path prefix, a query string, a
trailing slash or an OpenAI-style ``/v1`` suffix reach the right endpoint, and the base URL's
query parameters go with every request (a real local HTTP server records path and query)."""

from __future__ import annotations

import asyncio
from urllib.parse import parse_qsl

import pytest
from recording_server import recording_server

from shared_core.runtime.remote import RemoteConfig, RemoteError, RemoteLM
from shared_core.runtime.remote.http import Transport

FAST = RemoteConfig(max_retries=0, connect_timeout_s=5.0)

# (what the user wrote after http://127.0.0.1:<port>, expected path prefix, expected query)
WRITTEN = [
    ("", "", []),
    ("/", "", []),
    ("/v1", "", []),
    ("/v1/", "", []),
    ("?key=K1", "", [("key", "K1")]),
    ("/?key=K1", "", [("key", "K1")]),
    ("/v1?key=K1&x=a%20b", "", [("key", "K1"), ("x", "a b")]),
    ("/v1/?api-version=2", "", [("api-version", "2")]),
    ("/proxy/vllm", "/proxy/vllm", []),
    ("/proxy/vllm/v1/?sig=S&se=2030", "/proxy/vllm", [("sig", "S"), ("se", "2030")]),
]


@pytest.fixture(scope="module")
def server():
    with recording_server() as recording:
        yield recording


@pytest.mark.parametrize(("written", "prefix", "query"), WRITTEN)
def test_every_request_reaches_the_endpoint_with_the_query(server, written, prefix, query) -> None:
    http = Transport(f"{server.url}{written}", api_key=None, config=FAST)
    server.requests.clear()
    http.request("GET", "/v1/models")
    http.request("POST", "/v1/completions", {"prompt": [1, 2]})
    http.request("GET", "/metrics")
    asyncio.run(http.arequest("POST", "/generate", {"input_ids": [1]}))
    paths = [(r.method, r.path) for r in server.requests]
    assert paths == [("GET", f"{prefix}/v1/models"), ("POST", f"{prefix}/v1/completions"),
                     ("GET", f"{prefix}/metrics"), ("POST", f"{prefix}/generate")]
    assert all(parse_qsl(r.query, keep_blank_values=True) == query for r in server.requests)
    assert http.url("/v1/models").startswith(f"{server.url}{prefix}/v1/models")


def test_a_served_model_url_with_a_key_reaches_v1_models_and_errors_name_it() -> None:
    with recording_server(status=401) as server, pytest.raises(RemoteError) as info:
        RemoteLM(f"{server.url}/v1/?key=K-planted-secret", engine="vllm", config=FAST)
    assert [(r.path, r.query) for r in server.requests] == [("/v1/models",
                                                            "key=K-planted-secret")]
    assert f"{server.url}/v1/models?key=***" in str(info.value)
    assert "K-planted-secret" not in str(info.value)
