"""CONTRACT tests of RemoteLM's request building and response parsing (no server here).

The transport is ``httpx.MockTransport`` answering in the shapes of vLLM 0.32's
``/v1/completions`` / ``/tokenize`` / ``/metrics`` and SGLang's native ``/generate`` (as read in
their source). These check what the client sends and how it reads answers, retries and fails; the
behaviour against a real server is tested in tests/integration/test_remote_vllm.py.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from tiny import tiny_tokenizer

from shared_core.config import SamplingConfig
from shared_core.runtime.remote import RemoteCapabilityError, RemoteConfig, RemoteError, RemoteLM
from shared_core.runtime.remote.protocol import RemoteProtocolError, parse_metrics, vllm_parse_score

FAST = RemoteConfig(max_retries=2, backoff_s=0.0)


def _lp(row: list[int], t: int) -> float:
    return -0.01 * (t + 1) - 0.001 * row[t]  # a deterministic "log-prob" the tests can recompute


class FakeVLLM:
    """vLLM-shaped answers; records every request."""

    def __init__(self, tok: Any, *, token_ids: bool = True, fail_first: int = 0,
                 by_sum: bool = False) -> None:
        self.tok, self.token_ids, self.fail_first, self.by_sum = tok, token_ids, fail_first, by_sum
        self.requests: list[httpx.Request] = []

    def bodies(self, path: str) -> list[dict[str, Any]]:
        return [json.loads(r.content) for r in self.requests if r.url.path == path]

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        if self.fail_first:
            self.fail_first -= 1
            return httpx.Response(503, text="loading")
        path = request.url.path
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "tiny", "root": "/nowhere",
                                                       "max_model_len": 512}]})
        if path == "/version":
            return httpx.Response(200, json={"version": "0.32.0"})
        if path == "/tokenize":
            text = json.loads(request.content)["prompt"]
            return httpx.Response(200, json={"tokens": self.tok.encode(text, add_special_tokens=False)})
        if path == "/metrics":
            return httpx.Response(200, text="# HELP x\nvllm:prefix_cache_queries_total{e=\"0\"} 40.0\n"
                                            "vllm:prefix_cache_hits_total{e=\"0\"} 30.0\n")
        if path == "/v1/completions":
            return httpx.Response(200, json=self._complete(json.loads(request.content)))
        return httpx.Response(404, text="no route")

    def _complete(self, body: dict[str, Any]) -> dict[str, Any]:
        choices = []
        for p in body["prompt"]:
            if body.get("echo") and body["max_tokens"] == 0:
                plp = [None] + [{str(p[t]): {"logprob": _lp(p, t), "rank": 1}} for t in range(1, len(p))]
                choices.append({"index": len(choices), "prompt_logprobs": plp, "token_ids": [],
                                "finish_reason": "length"})
                continue
            for j in range(body["n"]):
                first = (sum(p) if self.by_sum else p[-1]) + 1 + j  # by_sum: the doc matters
                ids = [3 + (first + i) % 47 for i in range(body["max_tokens"])]
                choices.append({"index": len(choices), "token_ids": ids if self.token_ids else None,
                                "logprobs": {"token_logprobs": [-0.5] * len(ids)},
                                "finish_reason": "length"})
        return {"choices": choices}


class FakeSGLang:
    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.requests: list[dict[str, Any]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/get_model_info":
            return httpx.Response(200, json={"model_path": "/nowhere", "is_generation": True})
        if path == "/get_server_info":
            return httpx.Response(200, json={"context_length": 256, "version": "0.5.23"})
        if path == "/metrics":
            return httpx.Response(200, text="sglang:prompt_tokens_total 10\nsglang:cached_tokens_total 4\n")
        if path != "/generate":
            return httpx.Response(404)
        body = json.loads(request.content)
        self.requests.append(body)
        if "text" in body:
            ids = [1, *self.tok.encode(body["text"], add_special_tokens=False)]  # BOS prepended
            return httpx.Response(200, json={"meta_info": {"input_token_logprobs":
                                                           [[None, t, None] for t in ids]}})
        params, items = body["sampling_params"], []
        for i, p in enumerate(body["input_ids"]):
            if params["max_new_tokens"] == 0:
                start = body["logprob_start_len"][i]
                triples = [[None if t == 0 else _lp(p, t), p[t], None] for t in range(start, len(p))]
                items.append({"meta_info": {"input_token_logprobs": triples}})
            else:
                ids = [(p[-1] + 1 + k) % 50 for k in range(params["max_new_tokens"])]
                items.append({"output_ids": ids, "meta_info": {
                    "output_token_logprobs": [[-0.25, t, None] for t in ids],
                    "finish_reason": {"type": "length"}}})
        return httpx.Response(200, json=items)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _vllm(tok: Any, **kwargs: Any) -> tuple[RemoteLM, FakeVLLM]:
    server = FakeVLLM(tok, **kwargs)
    lm = RemoteLM("http://vllm.test", tokenizer=tok, config=FAST, api_key="sk-test",
                  transport=httpx.MockTransport(server))
    return lm, server


def test_vllm_connect_probe_and_auth(tok):
    lm, server = _vllm(tok)
    assert lm.engine == "vllm" and lm.model == "tiny" and lm.max_context == 512
    caps = lm.capabilities
    assert (caps.version, caps.token_ids_io, caps.batched_scoring, caps.prefix_cache_metrics) == \
        ("0.32.0", True, True, True)
    assert all(r.headers["authorization"] == "Bearer sk-test" for r in server.requests)
    assert lm.prefix_cache_stats() == {"queries": 40.0, "hits": 30.0}


def test_vllm_generate_sends_token_ids_in_one_request(tok):
    lm, server = _vllm(tok)
    before = len(server.bodies("/v1/completions"))
    out = lm.generate([[5, 6, 7], [9]], 3, n=2, sampling=SamplingConfig(0.7, top_k=5, seed=3))
    [body] = server.bodies("/v1/completions")[before:]
    assert body["prompt"] == [[5, 6, 7], [9]] and body["n"] == 2 and body["return_token_ids"]
    assert (body["temperature"], body["top_k"], body["seed"], body["max_tokens"]) == (0.7, 5, 3, 3)
    assert [[g.token_ids for g in row] for row in out] == [[[11, 12, 13], [12, 13, 14]],
                                                           [[13, 14, 15], [14, 15, 16]]]
    assert out[0][0].logprobs == [-0.5] * 3


def test_vllm_score_is_one_echo_request_without_generation(tok):
    lm, server = _vllm(tok)
    before = len(server.bodies("/v1/completions"))
    prefix, conts = [3, 4, 5], [[6, 7], [8]]
    scores = lm.score(prefix, conts)
    [body] = server.bodies("/v1/completions")[before:]
    assert (body["echo"], body["max_tokens"], body["prompt"]) == (True, 0, [[3, 4, 5, 6, 7], [3, 4, 5, 8]])
    rows = [prefix + c for c in conts]
    assert scores == [[_lp(rows[0], 3), _lp(rows[0], 4)], [_lp(rows[1], 3)]]


def test_sglang_native_generate_and_score(tok):
    server = FakeSGLang(tok)
    lm = RemoteLM("http://sglang.test", tokenizer=tok, config=FAST, transport=httpx.MockTransport(server))
    assert (lm.engine, lm.max_context, lm.capabilities.version) == ("sglang", 256, "0.5.23")
    assert lm.capabilities.batched_scoring and lm.capabilities.token_ids_io
    out = lm.generate([[5, 6]], 2, n=2)
    assert [g.token_ids for g in out[0]] == [[7, 8], [7, 8]] and out[0][0].logprobs == [-0.25, -0.25]
    assert server.requests[-1]["input_ids"] == [[5, 6], [5, 6]]
    scores = lm.score([3, 4], [[6, 7]])
    body = server.requests[-1]
    assert body["logprob_start_len"] == [2] and body["sampling_params"]["max_new_tokens"] == 0
    assert scores == [[_lp([3, 4, 6, 7], 2), _lp([3, 4, 6, 7], 3)]]
    assert lm.prefix_cache_stats() == {"queries": 10.0, "hits": 4.0}


def test_retries_then_succeeds_and_gives_up(tok):
    lm, server = _vllm(tok, fail_first=2)  # the first two requests get 503: retried
    assert lm.engine == "vllm"
    server.fail_first = 3  # more failures than retries
    with pytest.raises(RemoteError, match=r"failed after 3 attempt\(s\).*503"):
        lm.generate([[1, 2]], 1)


def test_connection_errors_are_retried_with_backoff(tok):
    calls = []

    def refuse(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        raise httpx.ConnectError("refused")

    with pytest.raises(RemoteError, match="failed after 3 attempt"):
        RemoteLM("http://down.test", tokenizer=tok, engine="vllm", config=FAST,
                 transport=httpx.MockTransport(refuse))
    assert calls == ["/v1/models"] * 3
    assert RemoteConfig(backoff_s=0.5, backoff_max_s=3).backoff(4) == 3


async def test_sync_and_async_requests_share_one_retry_policy(tok):
    """Same outcomes, same attempts, same errors from ``request`` and ``arequest``."""
    from shared_core.runtime.remote.http import Transport

    for fail_first, retries in ((2, None), (3, None), (1, 0)):
        outcomes = []
        for asynchronous in (False, True):
            server = FakeVLLM(tok, fail_first=fail_first)
            http = Transport("http://fake.test", api_key=None, config=FAST,
                             transport=httpx.MockTransport(server))
            try:
                call = http.arequest if asynchronous else http.request
                answer = call("GET", "/version", retries=retries)
                outcomes.append((await answer if asynchronous else answer, len(server.requests)))
            except RemoteError as e:
                outcomes.append((str(e), e.status, len(server.requests)))
            finally:
                http.close()
                await http.aclose()
        assert outcomes[0] == outcomes[1], (fail_first, retries)
    assert outcomes[0] == ("GET http://fake.test/version failed after 1 attempt(s): HTTP 503: "
                           "loading", 503, 1)
    for asynchronous in (False, True):  # a 404 does not retry and names the route
        server = FakeVLLM(tok)
        http = Transport("http://fake.test", api_key=None, config=FAST,
                         transport=httpx.MockTransport(server))
        with pytest.raises(RemoteError, match=r"GET http://fake.test/nowhere -> HTTP 404"):
            if asynchronous:
                await http.arequest("GET", "/nowhere")
            else:
                http.request("GET", "/nowhere")
        assert len(server.requests) == 1
        http.close()
        await http.aclose()


def test_missing_capability_names_what_the_engine_needs(tok):
    lm, _ = _vllm(tok, token_ids=False)
    assert not lm.capabilities.token_ids_io and "return_token_ids" in lm.capabilities.notes["token_ids_io"]
    lm.require("batched_scoring", by="Speculative RAG's verifier")
    with pytest.raises(RemoteCapabilityError, match=r"RaLMSpec needs .* token_ids_io: token-id prompts"):
        lm.require("token_ids_io", by="RaLMSpec")
    with pytest.raises(ValueError, match="unknown capability 'trees'"):
        lm.require("trees", by="x")


def test_tokenizer_mismatch_is_refused(tok):
    server = FakeVLLM(tok)
    other = SimpleNamespace(encode=lambda text, add_special_tokens=True: [1, 2, 3],  # another model
                            eos_token_id=2, model_max_length=512)
    with pytest.raises(ValueError, match="tokenizer does not match the served model 'tiny'"):
        RemoteLM("http://vllm.test", tokenizer=other, transport=httpx.MockTransport(server))
    with pytest.raises(ValueError, match="not on this machine: pass tokenizer="):
        RemoteLM("http://vllm.test", transport=httpx.MockTransport(server))


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"url": "vllm.test"}, ValueError, "url must start with http"),
    ({"engine": "tgi"}, ValueError, "engine must be one of"),
    ({"config": {"timeout_s": 1}}, TypeError, "config must be a RemoteConfig"),
])
def test_bad_arguments_fail_before_any_request(tok, kwargs, error, match):
    calls = []
    transport = httpx.MockTransport(lambda r: calls.append(r) or httpx.Response(500))
    args = {"url": "http://vllm.test", **kwargs}
    with pytest.raises(error, match=match):
        RemoteLM(args.pop("url"), tokenizer=tok, transport=transport, **args)
    assert calls == []


def test_bad_request_arguments_are_named(tok):
    lm, _ = _vllm(tok)
    with pytest.raises(ValueError, match="prompts must hold non-empty lists of token ids"):
        lm.generate([[1, -2]], 1)
    with pytest.raises(ValueError, match="prompts must be a non-empty list"):
        lm.generate([], 1)
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        lm.generate([[1]], 0)
    with pytest.raises(ValueError, match="starts must give"):
        lm.score_rows([[1, 2]], [2])
    with pytest.raises(ValueError, match="timeout_s must be"):
        RemoteConfig(timeout_s=0)


def test_malformed_answers_raise_protocol_errors():
    with pytest.raises(RemoteProtocolError, match="expected 2 scored rows"):
        vllm_parse_score({"choices": [{"index": 0, "prompt_logprobs": [None]}]}, [[1], [2]])
    assert parse_metrics("a 1\na{x=\"1\"} 2\nb nan-ish\n# c 3\n", ["a", "b"]) == {"a": 3.0}


async def test_async_generate_and_score_match_sync(tok):
    lm, _ = _vllm(tok)
    assert await lm.agenerate([[5, 6]], 2) == lm.generate([[5, 6]], 2)
    assert await lm.ascore_rows([[3, 4, 5]]) == lm.score_rows([[3, 4, 5]])
    await lm.aclose()
    lm.close()


def test_ralmspec_wiring_on_a_served_lm(tok):
    """RaLMSpec / RaLMSeq take a RemoteLM: one token-id request per step, prompt = head + document
    + tail + output so far, outputs equal (the fake answers depend on the whole prompt)."""
    from shared_core.engines.ralmspec import RaLMSpec, RaLMSpecConfig
    from shared_core.retrieval import BM25Retriever, Document

    lm, server = _vllm(tok, by_sum=True)
    bm25 = BM25Retriever()
    bm25.add([Document(f"d{i}", t) for i, t in enumerate(
        ["the cat sat on the mat", "a dog ran in the park", "the sun is a star", "rivers flow"])])
    config = RaLMSpecConfig(max_doc_tokens=16, max_prompt_tokens=256)
    before = len(server.bodies("/v1/completions"))
    seq = RaLMSpec(lm, bm25, config).generate_baseline("where did the cat sit", 12)
    requests = server.bodies("/v1/completions")[before:]
    assert len(requests) == 3 and all(b["max_tokens"] == 4 for b in requests)
    assert requests[1]["prompt"][0][-4:] == list(seq.token_ids[:4])  # output so far is in the prompt
    spec = RaLMSpec(lm, bm25, config).generate("where did the cat sit", 12)
    assert spec.token_ids == seq.token_ids and seq.stats.served_requests == 3


def test_speculative_rag_on_served_models_sends_one_draft_and_one_score_request(tok):
    from fakes import HashEmbedder

    from shared_core.engines.speculative_rag import SpeculativeRAG, SpeculativeRAGConfig

    lm, server = _vllm(tok, by_sum=True)
    config = SpeculativeRAGConfig(num_drafts=3, docs_per_draft=1, max_draft_tokens=6,
                                  subset_strategy="random")
    before = len(server.bodies("/v1/completions"))
    result = SpeculativeRAG(lm, lm, embedder=HashEmbedder(), config=config).answer(
        "where did the cat sit", ["the cat sat on the mat", "a dog ran", "the sun is a star"])
    draft_req, score_req = server.bodies("/v1/completions")[before:]
    assert len(draft_req["prompt"]) == 3 and draft_req["max_tokens"] == 6 and not draft_req.get("echo")
    assert len(score_req["prompt"]) == 3 and score_req["echo"] and score_req["max_tokens"] == 0
    n_yes = len(tok.encode(" Yes", add_special_tokens=False))  # the scored "Yes" span ends each row
    for d, row in zip(result.drafts, score_req["prompt"], strict=True):
        yes = range(len(row) - n_yes, len(row))
        assert d.log_self_reflect == pytest.approx(sum(_lp(row, t) for t in yes))
    assert result.best == max(range(3), key=lambda i: (result.drafts[i].score, -i))


def test_the_chat_adapters_refuse_a_served_model_when_built_saying_where_it_works(tok) -> None:
    """The token engines run forwards in this process: a RemoteLM as a chat adapter's ``lm`` is
    refused when the adapter is built (it failed at the first call, on a missing attribute)."""
    from langchain_specrag import ChatSpeculative
    from llamaindex_specrag import SpeculativeLLM

    lm, _ = _vllm(tok)
    for build in (lambda: ChatSpeculative(lm=lm), lambda: SpeculativeLLM(lm)):
        with pytest.raises(TypeError, match=r"lm must be a model from load_lm, got RemoteLM: a "
                                            r"served model.*Speculative RAG"):
            build()


class _Broken(FakeVLLM):
    """A vLLM whose completions answer ``status`` with ``body`` (a cut-off JSON by default)."""

    def __init__(self, tok: Any, status: int = 200, body: str = '{"choices": [') -> None:
        super().__init__(tok)
        self.status, self.body = status, body

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path != "/v1/completions":
            return super().__call__(request)
        return httpx.Response(self.status, text=self.body,
                              headers={"content-type": "application/json"})


@pytest.mark.parametrize(("status", "body", "match"), [
    (200, '{"choices": [', r"POST http://vllm\.test/v1/completions: the answer is not valid JSON"),
    (401, '{"error": "bad key"}',
     r"HTTP 401 \(the server's key: RemoteLM\(api_key\) or \$SPECRAG_REMOTE_API_KEY\)"),
])
def test_a_broken_answer_is_a_remote_error_naming_the_request_and_the_setting(
        tok, status: int, body: str, match: str) -> None:
    """A body a proxy cut short is a RemoteError (was a bare JSONDecodeError, also out of the
    constructor's probe); a refused key names the setting that sends one."""
    lm = RemoteLM("http://vllm.test", tokenizer=tok, config=FAST,
                  transport=httpx.MockTransport(_Broken(tok, status, body)))  # the probe records it
    with pytest.raises(RemoteError, match=match):
        lm.generate([[5, 6]], 2)


def test_a_timeout_names_the_setting_that_waits_longer(tok) -> None:
    def slow(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/completions":
            raise httpx.ReadTimeout("timed out")
        return FakeVLLM(tok)(request)

    lm = RemoteLM("http://vllm.test", tokenizer=tok, config=FAST, transport=httpx.MockTransport(slow))
    with pytest.raises(RemoteError, match=r"failed after 3 attempt\(s\) \(a longer wait: "
                                          r"RemoteConfig\(timeout_s=\.\.\.\)\)"):
        lm.generate([[5, 6]], 2)


def test_async_calls_work_from_one_event_loop_after_another(tok) -> None:
    """A real pooled HTTP/1.1 server: each ``asyncio.run`` gets its own async client (one client
    for every loop failed with "Event loop is closed" on the second run)."""
    import asyncio
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    fake = FakeVLLM(tok)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: the async client pools the connection

        def _answer(self) -> None:
            raw = self.rfile.read(int(self.headers.get("content-length") or 0))
            answer = fake(httpx.Request(self.command, f"http://x{self.path}", content=raw))
            self.send_response(answer.status_code)
            self.send_header("content-type", answer.headers.get("content-type", "application/json"))
            self.send_header("content-length", str(len(answer.content)))
            self.end_headers()
            self.wfile.write(answer.content)

        do_GET = do_POST = _answer

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        lm = RemoteLM(f"http://127.0.0.1:{server.server_address[1]}", tokenizer=tok,
                      config=RemoteConfig(max_retries=0))
        first, *later = [asyncio.run(lm.agenerate([[5, 6]], 3)) for _ in range(3)]
        assert all(run[0][0].token_ids == first[0][0].token_ids for run in later)
        lm.close()
    finally:
        server.shutdown()
        server.server_close()


class _LlamaServer(FakeVLLM):
    """An OpenAI-compatible server that is not vLLM: llama.cpp's ``/tokenize`` reads
    ``content`` (a vLLM body gets no tokens); Ollama has no such route."""

    def __init__(self, tok: Any, route: bool) -> None:
        super().__init__(tok)
        self.route = route

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/tokenize":
            body = json.loads(request.content)
            if not self.route:
                return httpx.Response(404, text="404 page not found")
            return httpx.Response(200, json={"tokens": self.tok.encode(body.get("content", ""))})
        return super().__call__(request)


@pytest.mark.parametrize("route", [True, False])
def test_an_openai_compatible_server_that_is_not_vllm_is_named_as_such(tok, route: bool) -> None:
    """It was taken for vLLM, then refused with "tokenizer does not match" (pass tokenizer=),
    though the tokenizer was the served model's."""
    with pytest.raises(RemoteError, match=r"tokenizes as no vLLM does .*llama\.cpp's or Ollama's"):
        RemoteLM("http://llama.test", tokenizer=tok, config=FAST,
                 transport=httpx.MockTransport(_LlamaServer(tok, route)))


def test_the_tokenizer_comes_from_the_hub_id_a_server_was_started_with(tok, monkeypatch) -> None:
    """``vllm serve org/name`` lists ``root: org/name``: the tokenizer loads from that id (it was
    refused as "not on this machine"); a folder of another machine is still refused, saying how
    to pass one and where an adapter takes the RemoteLM."""
    import transformers

    from shared_core.runtime.remote.lm import _load_tokenizer

    asked: list[str] = []
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda name, **_: asked.append(name) or tok)
    assert _load_tokenizer(None, "HuggingFaceTB/SmolLM2-135M-Instruct") is tok
    assert asked == ["HuggingFaceTB/SmolLM2-135M-Instruct"]
    for root in ("/models/smollm2", "./smollm2", "a/b/c"):
        with pytest.raises(ValueError, match=r"not on this machine.*RemoteLM\(url, tokenizer=\.\.\.\)"
                                             r".*engine=SpeculativeRAG"):
            _load_tokenizer(None, root)
    assert asked == ["HuggingFaceTB/SmolLM2-135M-Instruct"]
