"""RemoteLM: a served model (vLLM or SGLang) used on token ids, beside the in-process ``LM``.

The client keeps a local tokenizer of the served model (by default loaded from the server's
model folder when that folder is on this machine), checked at connect time against the server's
own tokenization, so prompts are built locally exactly as for an in-process ``LM`` (``encode``,
``prompt_ids``, ``chat_prompt`` are the ``LM`` methods) and only token ids cross the wire.

At connect time a probe records what the server can do (:class:`Capabilities`); an engine calls
:meth:`RemoteLM.require` and gets a :class:`RemoteCapabilityError` naming what is missing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

from shared_core.config import SamplingConfig, check_choice, check_int, check_text
from shared_core.runtime.lm import ChatTokenizer
from shared_core.runtime.protocol import Row, Spans, StopRule
from shared_core.runtime.remote import protocol as P
from shared_core.runtime.remote.config import ENGINES, Engine, RemoteConfig
from shared_core.runtime.remote.http import RemoteError, Transport
from shared_core.runtime.weights.sources import is_hub_id
from shared_core.util.redact import redact

if TYPE_CHECKING:
    import httpx
    from transformers import PreTrainedTokenizerBase

    from shared_core.runtime.protocol import ModelLM

logger = logging.getLogger(__name__)

#: what ``RemoteLM(tokenizer=...)`` takes: a tokenizer, an LM (its tokenizer), a folder or hub id
TokenizerSource: TypeAlias = "PreTrainedTokenizerBase | ModelLM | str | Path | None"

# What each capability means, for error messages.
NEEDS: dict[str, str] = {
    "token_ids_io": "token-id prompts and token-id outputs (vLLM: prompt as ids + "
                    "return_token_ids; SGLang: input_ids / output_ids)",
    "batched_scoring": "log-probs of given tokens of several prompts in one request (vLLM: "
                       "echo + logprobs + max_tokens=0; SGLang: /generate with return_logprob "
                       "and max_new_tokens=0)",
    "prefix_cache_metrics": "prefix-cache counters on /metrics (vLLM: vllm:prefix_cache_*; "
                            "SGLang: start it with --enable-metrics)",
}
_CACHE_METRICS = {
    "vllm": ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total"),
    "sglang": ("sglang:prompt_tokens_total", "sglang:cached_tokens_total"),
}


class RemoteCapabilityError(ValueError):
    """The server lacks something the caller (an engine) needs."""


@dataclass(frozen=True)
class Capabilities:
    engine: str
    version: str | None
    model: str
    max_model_len: int | None
    token_ids_io: bool
    batched_scoring: bool
    prefix_cache_metrics: bool
    notes: dict[str, str] = field(default_factory=dict)  # why a probe failed


class RemoteLM(ChatTokenizer):
    """A model behind a vLLM (OpenAI completions) or SGLang (native ``/generate``) server.

    Args:
        url: the server's base URL, e.g. ``http://127.0.0.1:8000``.
        tokenizer: a tokenizer, an ``LM`` (its tokenizer) or a folder / Hugging Face id; ``None``
            loads the server's own model folder when it exists on this machine.
        engine: ``"vllm"``, ``"sglang"`` or ``"auto"`` (detected from the endpoints).
        model: the served model name (default: the server's first model).
        api_key: sent as ``Authorization: Bearer``; default ``$SPECRAG_REMOTE_API_KEY``.
        config: :class:`RemoteConfig` (timeouts, retries, pool size).
        transport: an ``httpx`` transport (tests: ``httpx.MockTransport``).
    """

    served = True  # engines branch on this: requests instead of local forwards

    def __init__(self, url: str, *, tokenizer: TokenizerSource = None, engine: Engine = "auto",
                 model: str | None = None, api_key: str | None = None,
                 config: RemoteConfig | None = None,
                 transport: httpx.BaseTransport | httpx.AsyncBaseTransport | None = None) -> None:
        check_text(url, "url")
        if not url.startswith(("http://", "https://")):
            msg = f"url must start with http:// or https://, got {redact(url)!r}"
            raise ValueError(msg)
        check_choice(engine, "engine", ENGINES)
        if config is not None and not isinstance(config, RemoteConfig):
            msg = f"config must be a RemoteConfig or None, got {type(config).__name__}"
            raise TypeError(msg)
        self.config = config or RemoteConfig()
        self.http = Transport(url, api_key=api_key, config=self.config, transport=transport)
        # for messages, logs and reprs: the server's base URL; credentials live only in the
        # transport
        self.url = redact(self.http.base_url)
        self.engine = self._detect_engine() if engine == "auto" else engine
        self.model, root, max_len, version = self._server_model(model)
        self.tokenizer = _load_tokenizer(tokenizer, root)
        self.name = f"{self.model}@{self.url}"
        self.device = f"served:{self.engine}"  # reports only: nothing runs in this process
        self.dtype = "server"
        self.max_context = max_len or int(getattr(self.tokenizer, "model_max_length", 0) or 2048)
        eos = self.tokenizer.eos_token_id
        self.eos_token_ids = frozenset() if eos is None else frozenset({int(eos)})
        self._check_tokenizer()
        self.capabilities = self._probe(version, max_len)
        logger.info("connected to %s: %s", self.url, self.capabilities)

    # ------------------------------------------------------------------ connect-time probes
    def _detect_engine(self) -> str:
        try:
            self.http.request("GET", "/get_model_info", retries=0)
            return "sglang"
        except RemoteError:
            pass
        self.http.request("GET", "/v1/models")  # raises with the server's answer if neither
        return "vllm"

    def _server_model(self, model: str | None) -> tuple[str, str | None, int | None, str | None]:
        """(served name, model folder or id, max context, server version)."""
        if self.engine == "sglang":
            info = self.http.request("GET", "/get_model_info")
            path = P._field(info, "model_path", "/get_model_info")
            server = _optional(self.http, "/get_server_info") or {}
            return model or path, path, server.get("context_length"), server.get("version")
        listing = P._field(self.http.request("GET", "/v1/models"), "data", "/v1/models")
        if not listing:
            raise RemoteError(f"{self.url}/v1/models lists no model")
        chosen = next((m for m in listing if m.get("id") == model), None) if model else listing[0]
        if chosen is None:
            names = ", ".join(m.get("id", "?") for m in listing)
            msg = f"model={model!r} is not served by {self.url}; it serves {names}"
            raise ValueError(msg)
        version = (_optional(self.http, "/version") or {}).get("version")
        return chosen["id"], chosen.get("root"), chosen.get("max_model_len"), version

    def _check_tokenizer(self) -> None:
        text = self.config.probe_text
        local = self.encode(text)
        if self.engine == "vllm":
            body = {"model": self.model, "prompt": text, "add_special_tokens": False}
            try:
                served = P._field(self.http.request("POST", "/tokenize", body), "tokens",
                                  "/tokenize")
            except RemoteError as e:
                if e.status != 404:
                    raise
                served = []
            if local and not served:  # llama.cpp's server reads "content"; Ollama has no route
                msg = (f"{self.url} lists models but tokenizes as no vLLM does (POST /tokenize "
                       "gave no tokens): RemoteLM speaks vLLM's and SGLang's APIs (token-id "
                       "prompts, prompt log-probs); an OpenAI-compatible server such as "
                       "llama.cpp's or Ollama's is not enough")
                raise RemoteError(msg)
        else:
            body = {"text": text, "sampling_params": {"max_new_tokens": 0},
                    "return_logprob": True, "logprob_start_len": 0}
            [item] = P._items(self.http.request("POST", "/generate", body), 1)
            served = [t[1] for t in P._field(item["meta_info"], "input_token_logprobs", "meta_info")]
            served = served[len(served) - len(local):]  # the server may prepend BOS
        if list(served) != local:
            msg = (f"tokenizer does not match the served model {self.model!r}: {text!r} -> "
                   f"{local[:12]}... locally, {list(served)[:12]}... on the server; pass "
                   "tokenizer= the served model's folder or Hugging Face id")
            raise ValueError(msg)

    def _probe(self, version: str | None, max_len: int | None) -> Capabilities:
        notes: dict[str, str] = {}
        probe = self.encode(self.config.probe_text)
        token_io = batched = cache = False
        try:
            token_io = bool(self.generate([probe], 1)[0][0].token_ids)
        except (RemoteError, P.RemoteProtocolError) as e:
            notes["token_ids_io"] = str(e)
        try:
            scored = self.score_rows([probe[:4], probe[:6]])
            batched = len(scored) == 2 and all(v is not None for v in scored[1][1:])
        except (RemoteError, P.RemoteProtocolError) as e:
            notes["batched_scoring"] = str(e)
        try:
            cache = bool(self.prefix_cache_stats())
        except (RemoteError, P.RemoteProtocolError) as e:
            notes["prefix_cache_metrics"] = str(e)
        return Capabilities(self.engine, version, self.model, max_len, token_io, batched, cache, notes)

    def require(self, *needs: str, by: str) -> None:
        """Raise :class:`RemoteCapabilityError` unless the server has every one of ``needs``."""
        unknown = [n for n in needs if n not in NEEDS]
        if unknown:
            msg = f"unknown capability {unknown[0]!r}; known: {', '.join(NEEDS)}"
            raise ValueError(msg)
        missing = [n for n in needs if not getattr(self.capabilities, n)]
        if missing:
            lines = "; ".join(f"{n}: {NEEDS[n]}" + (f" (probe: {self.capabilities.notes[n][:200]})"
                                                    if n in self.capabilities.notes else "")
                              for n in missing)
            version = self.capabilities.version or "unknown version"
            msg = f"{by} needs what the {self.engine} server at {self.url} ({version}) lacks: {lines}"
            raise RemoteCapabilityError(msg)

    # ------------------------------------------------------------------ requests
    def _generate_request(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, n: int,
                          sampling: SamplingConfig | None, stop_token_ids: Sequence[int]
                          ) -> tuple[str, list[dict[str, Any]]]:
        _check_prompts(prompts, "prompts")
        check_int(max_new_tokens, "max_new_tokens")
        check_int(n, "n")
        sampling = sampling or SamplingConfig()
        if self.engine == "vllm":
            return "/v1/completions", [P.vllm_generate_body(self.model, prompts, max_new_tokens,
                                                            sampling, n, stop_token_ids)]
        rows = [p for p in prompts for _ in range(n)]  # one item per sample
        return "/generate", [P.sglang_generate_body(rows, max_new_tokens, sampling, stop_token_ids)]

    def _parse_generate(self, response: object, num_prompts: int, n: int) -> list[list[Generation]]:
        if self.engine == "vllm":
            return P.vllm_parse_generate(response, num_prompts, n)
        flat = P.sglang_parse_generate(response, num_prompts * n)
        return [flat[i * n:(i + 1) * n] for i in range(num_prompts)]

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, n: int = 1,
                 sampling: SamplingConfig | None = None, stop_token_ids: Sequence[int] = ()
                 ) -> list[list[Generation]]:
        """Per prompt, ``n`` continuations (ONE request for all prompts); greedy by default."""
        path, [body] = self._generate_request(prompts, max_new_tokens, n, sampling, stop_token_ids)
        return self._parse_generate(self.http.request("POST", path, body), len(prompts), n)

    async def agenerate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                        n: int = 1, sampling: SamplingConfig | None = None,
                        stop_token_ids: Sequence[int] = ()) -> list[list[Generation]]:
        path, [body] = self._generate_request(prompts, max_new_tokens, n, sampling, stop_token_ids)
        return self._parse_generate(await self.http.arequest("POST", path, body), len(prompts), n)

    def _score_request(self, rows: Sequence[Sequence[int]], starts: Sequence[int] | None
                       ) -> tuple[str, dict[str, Any], list[int]]:
        _check_prompts(rows, "rows")
        starts = [1] * len(rows) if starts is None else [int(s) for s in starts]
        if len(starts) != len(rows) or any(not 1 <= s < len(r) for s, r in zip(starts, rows, strict=True)):
            msg = "starts must give, per row, a position in 1..len(row)-1"
            raise ValueError(msg)
        if self.engine == "vllm":
            return "/v1/completions", P.vllm_score_body(self.model, rows), starts
        return "/generate", P.sglang_score_body(rows, starts), starts

    def _parse_score(self, response: object, rows: Sequence[Sequence[int]], starts: list[int]
                     ) -> list[list[float | None]]:
        if self.engine == "vllm":
            out: list[list[float | None]] = []
            for row, start in zip(P.vllm_parse_score(response, rows), starts, strict=True):
                values: list[float | None] = [None] * start
                out.append(values + row[start:])
            return out
        return P.sglang_parse_score(response, rows, starts)

    def score_rows(self, rows: Sequence[Sequence[int]], starts: Sequence[int] | None = None
                   ) -> list[list[float | None]]:
        """Per row, log P(row[t] | row[:t]) for t >= ``starts[i]`` (default 1), ``None`` before;
        ONE request for all rows, no generation."""
        path, body, starts_ = self._score_request(rows, starts)
        return self._parse_score(self.http.request("POST", path, body), rows, starts_)

    async def ascore_rows(self, rows: Sequence[Sequence[int]], starts: Sequence[int] | None = None
                          ) -> list[list[float | None]]:
        path, body, starts_ = self._score_request(rows, starts)
        return self._parse_score(await self.http.arequest("POST", path, body), rows, starts_)

    def generate_parallel(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                          stop: StopRule, on_prefilled: Callable[[], None] | None = None
                          ) -> list[Row]:
        """Greedy continuations of all prompts in ONE request, each row cut where ``stop`` ends
        it (the server knows only EOS); ``on_prefilled`` is never called: the request is one
        step (:class:`shared_core.runtime.protocol.ModelLM`)."""
        del on_prefilled
        self.require("token_ids_io", by="batched drafting (Speculative RAG's drafter)")
        results = []
        for row, [gen] in enumerate(self.generate(prompts, max_new_tokens)):
            ids, logps = gen.token_ids, gen.logprobs or []
            n = next((t for t in range(1, len(ids) + 1) if stop(row, ids[:t])), len(ids))
            results.append((ids[:n], logps[:n]))
        return results

    def span_logprobs(self, rows: Sequence[Sequence[int]], spans: Spans) -> list[list[float]]:
        """Summed log P over each ``(start, end)`` span of each row, ONE scoring request."""
        self.require("batched_scoring", by="batched scoring (Speculative RAG's verifier)")
        # None only before a row's start (1 here), so every scored lp[t] is a float
        return [[sum(float(lp[t]) for t in range(max(start, 1), end))  # type: ignore[arg-type, misc]
                 for start, end in row_spans]
                for lp, row_spans in zip(self.score_rows(rows), spans, strict=True)]

    def score(self, prefix: Sequence[int], continuations: Sequence[Sequence[int]]
              ) -> list[list[float]]:
        """Per continuation, the log-prob of each of its tokens after ``prefix`` (one request)."""
        _check_prompts([prefix], "prefix")
        _check_prompts(continuations, "continuations")
        rows = [list(prefix) + list(c) for c in continuations]
        scored = self.score_rows(rows, [len(prefix)] * len(rows))
        # None only before each row's start (len(prefix)), cut off here
        return [[float(v) for v in s[len(prefix):]] for s in scored]  # type: ignore[arg-type]

    def prefix_cache_stats(self) -> dict[str, float]:
        """``{"queries", "hits"}`` token counters from the server's /metrics (cumulative)."""
        text = self.http.request("GET", "/metrics")
        names = _CACHE_METRICS[self.engine]
        found = P.parse_metrics(text if isinstance(text, str) else "", names)
        if names[0] not in found:
            raise P.RemoteProtocolError(f"/metrics has no {names[0]}")
        return {"queries": found[names[0]], "hits": found.get(names[1], 0.0)}

    def close(self) -> None:
        self.http.close()

    async def aclose(self) -> None:
        await self.http.aclose()

    def __enter__(self) -> RemoteLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RemoteLM({self.url!r}, engine={self.engine!r}, model={self.model!r})"

    def __reduce__(self) -> Any:
        msg = (f"RemoteLM({self.url!r}) holds open connections and credentials; it is not "
               "picklable: pickle its URL and connect again")
        raise TypeError(msg)


Generation = P.Generation


def _check_prompts(prompts: object, name: str) -> None:
    if not isinstance(prompts, Sequence) or isinstance(prompts, str) or not prompts:
        msg = f"{name} must be a non-empty list of token-id lists"
        raise TypeError(msg) if not isinstance(prompts, Sequence) else ValueError(msg)
    for row in prompts:
        if (not isinstance(row, Sequence) or isinstance(row, str) or not row
                or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in row)):
            msg = f"{name} must hold non-empty lists of token ids (ints >= 0), got {str(row)[:80]}"
            raise ValueError(msg)


def _optional(http: Transport, path: str) -> Any:
    try:
        return http.request("GET", path, retries=0)
    except RemoteError:
        return None


def _load_tokenizer(tokenizer: TokenizerSource, root: str | None) -> PreTrainedTokenizerBase:
    if tokenizer is not None and not isinstance(tokenizer, (str, Path)):
        found: PreTrainedTokenizerBase = getattr(tokenizer, "tokenizer", tokenizer)  # an LM's
        return found
    source = tokenizer if tokenizer is not None else root
    # the server's model: a folder here, or the hub id it was started with (vllm serve org/name)
    found_here = source is not None and (Path(source).is_dir() or is_hub_id(str(source)))
    if source is None or (tokenizer is None and not found_here):
        msg = (f"the server's model folder {root!r} is not on this machine: pass tokenizer= "
               "(a tokenizer, an LM, or the served model's folder / Hugging Face id), as "
               "RemoteLM(url, tokenizer=...); an adapter takes that RemoteLM inside its engine, "
               "engine=SpeculativeRAG(drafter, verifier)")
        raise ValueError(msg)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(source))
