"""RaLMSpec == RaLMSeq on tiny models and tiny corpora where speculation is forced to fail."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence

import pytest
import torch

from shared_core.engines.ralmspec import (
    BM25Backend,
    OS3Scheduler,
    RaLMSpec,
    RaLMSpecConfig,
    SearchBackend,
    as_backend,
    lexical_rank,
    ralmseq_generate,
    stream_ralmspec,
)
from shared_core.engines.ralmspec import engine as ralmspec_engine
from shared_core.retrieval import BM25Retriever, Document, Hit
from tests.fakes import RALM_DOCS, HashRetriever

DOCS = RALM_DOCS
QUESTIONS = ["who wrote the report?", "what is the capital of France?", "0 1 2 3 4"]
SMALL = {"max_doc_tokens": 48, "query_tokens": 8}


CONFIGS = {
    "base": RaLMSpecConfig(prefetch=False, scheduler=False, async_verify=False, **SMALL),
    "+P": RaLMSpecConfig(prefetch=True, prefetch_k=3, scheduler=False, async_verify=False,
                         **SMALL),
    "+S": RaLMSpecConfig(prefetch=False, scheduler=True, async_verify=False, **SMALL),
    "+A": RaLMSpecConfig(prefetch=False, scheduler=False, async_verify=True, **SMALL),
    "+PSA": RaLMSpecConfig(prefetch_k=4, **SMALL),
    "s=1": RaLMSpecConfig(speculation_stride=1, scheduler=False, **SMALL),
    "s=5,stride=1": RaLMSpecConfig(speculation_stride=5, scheduler=False, retrieval_stride=1,
                                   **SMALL),
    "+PSA,overlap=3": RaLMSpecConfig(prefetch_k=4, overlap_steps=3, **SMALL),
    "+PSA,static": RaLMSpecConfig(prefetch_k=4, cache="static", **SMALL),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("sticky", [1, 7])
def test_ralmspec_equals_ralmseq_greedy(tiny_target, name: str, sticky: int) -> None:
    config = CONFIGS[name]
    for question in QUESTIONS[:2]:
        ref = ralmseq_generate(tiny_target, HashRetriever(DOCS, sticky), question, 24,
                               config=config)
        out = RaLMSpec(tiny_target, HashRetriever(DOCS, sticky), config).generate(question, 24)
        assert out.token_ids == ref.token_ids
        assert out.text == ref.text
        assert out.stats.doc_ids and out.stats.doc_ids == ref.stats.doc_ids[: len(out.stats.doc_ids)]


def test_mismatches_are_exercised_and_counted(tiny_target) -> None:
    config = CONFIGS["base"]
    retriever = HashRetriever(DOCS)
    out = RaLMSpec(tiny_target, retriever, config).generate(QUESTIONS[0], 32)
    stats = out.stats
    assert stats.rounds > 0 and stats.accepted < stats.drafted  # some speculation failed
    assert max(retriever.calls) > 1  # batched verification
    assert stats.retrieval_calls < 32 // config.retrieval_stride + 1
    assert stats.strides and stats.as_dict()["extra"]["doc_ids"]


def test_ralmspec_equals_ralmseq_sampled(tiny_target) -> None:
    for config in (CONFIGS["base"], CONFIGS["+PSA"]):
        kwargs = {"temperature": 0.9, "top_k": 20, "seed": 7}
        ref = ralmseq_generate(tiny_target, HashRetriever(DOCS), QUESTIONS[1], 24, config=config,
                               **kwargs)
        out = RaLMSpec(tiny_target, HashRetriever(DOCS), config).generate(QUESTIONS[1], 24,
                                                                          **kwargs)
        assert out.token_ids == ref.token_ids


def test_bm25_and_generic_backends_equal_baseline(tiny_target) -> None:
    bm25 = BM25Retriever()
    bm25.add(DOCS)
    assert isinstance(as_backend(bm25), BM25Backend)
    generic = SearchBackend(HashRetriever(DOCS).search)  # lexical cache ranking
    for retriever in (bm25, generic):
        for config in (CONFIGS["base"], CONFIGS["+PSA"]):
            ref = ralmseq_generate(tiny_target, retriever, QUESTIONS[0], 20, config=config)
            out = RaLMSpec(tiny_target, retriever, config).generate(QUESTIONS[0], 20)
            assert out.token_ids == ref.token_ids


def test_stop_strings_and_stream(tiny_target) -> None:
    spec = RaLMSpec(tiny_target, HashRetriever(DOCS), CONFIGS["+PSA"])
    ref = spec.generate_baseline(QUESTIONS[0], 24)
    stream = spec.stream(QUESTIONS[0], 24)
    assert "".join(stream) == ref.text and stream.result is not None
    assert len(ref.text) > 4
    stop = ref.text[2:4]
    stopped = spec.generate(QUESTIONS[0], 24, stop=stop)
    assert stopped.text == spec.generate_baseline(QUESTIONS[0], 24, stop=stop).text
    assert stopped.stats.finish_reason == "stop"
    assert stopped.text == ref.text[: ref.text.find(stop)]  # cut before the stop string


def test_registry_entry_with_documents(tiny_target) -> None:
    stream = stream_ralmspec(tiny_target, QUESTIONS[0], max_new_tokens=8,
                             documents=[d.text for d in DOCS])
    assert 0 < stream.run().stats.new_tokens <= 8
    with pytest.raises(ValueError, match="retriever or documents"):
        stream_ralmspec(tiny_target, "q", max_new_tokens=4)


def test_bad_input(tiny_target) -> None:
    with pytest.raises(ValueError, match="retrieval_stride"):
        RaLMSpecConfig(retrieval_stride=0)
    with pytest.raises(ValueError, match="gamma_max"):
        RaLMSpecConfig(gamma_max=1.0)
    with pytest.raises(ValueError, match="speculation_stride"):
        RaLMSpecConfig(speculation_stride=9)
    spec = RaLMSpec(tiny_target, HashRetriever(DOCS), CONFIGS["base"])
    with pytest.raises(ValueError, match="question"):
        spec.generate("  ")
    with pytest.raises(ValueError, match="max_new_tokens"):
        spec.generate("q", 10_000)
    with pytest.raises(TypeError, match="retriever"):
        as_backend(object())


def test_os3_scheduler() -> None:
    sched = OS3Scheduler(async_verify=False, window=5, gamma_max=0.6)
    assert sched.next_stride() == 1
    for _ in range(6):
        sched.observe(a=0.1, b=2.0, correct=5, mismatches=0)  # cheap steps, slow retrieval
    assert sched.gamma == pytest.approx(0.6) and sched.next_stride() > 1
    cheap = OS3Scheduler(async_verify=False)
    for _ in range(5):
        cheap.observe(a=1.0, b=0.01, correct=0, mismatches=1)  # speculation always wrong
    assert cheap.gamma == 0 and cheap.next_stride() == 0  # plain RaLMSeq step wins
    # asynchronous formula: verification hidden behind one step favours shorter strides
    sync = OS3Scheduler(async_verify=False)
    asyn = OS3Scheduler(async_verify=True)
    assert asyn.expected_rate(1, 1.0, 1.0, 0.5) > sync.expected_rate(1, 1.0, 1.0, 0.5)


@pytest.mark.parametrize("async_verify", [False, True])
def test_scheduler_falls_back_to_plain_steps_and_stays_exact(tiny_target, async_verify) -> None:
    """A near-free retriever makes s = 0 optimal; with async verification the step carried
    from an overlapped round must not keep the engine speculating forever."""
    config = RaLMSpecConfig(prefetch=False, async_verify=async_verify, **SMALL)
    always_right = 10**6  # one top-1 for every query: speculation never mismatches
    out = RaLMSpec(tiny_target, HashRetriever(DOCS, always_right), config).generate(QUESTIONS[0], 40)
    assert 0 in out.stats.strides
    ref = ralmseq_generate(tiny_target, HashRetriever(DOCS, always_right), QUESTIONS[0], 40,
                           config=config)
    assert out.token_ids == ref.token_ids


def test_verify_cost_fit() -> None:
    sched = OS3Scheduler(async_verify=False)
    for s in (1, 2, 4):
        sched.observe(a=0.1, b=0.5 * s, correct=s, mismatches=0, queries=s)
    b0, b1 = sched.verify_cost()
    assert b0 == pytest.approx(0.0, abs=1e-9) and b1 == pytest.approx(0.5)


def test_lexical_rank_prefers_overlap_then_order() -> None:
    assert lexical_rank("capital of Germany", DOCS).id == "d1"
    assert lexical_rank("zzz", DOCS).id == "d0"


@pytest.mark.parametrize(("overlap_steps", "sticky"), [(1, 50), (4, 50), (4, 1)])
def test_async_verification_overlaps_wall_clock(tiny_target, monkeypatch, overlap_steps: int,
                                                sticky: int) -> None:
    """A retriever that is still busy overlaps with the speculation step(s).

    Structural, not timed: the worker's search answers only once the engine has stopped
    speculating and waits for it (a sleeping retriever raced the model's steps, and at load
    average 10 the overlapped steps did not fit in its sleep).
    """
    waiting = threading.Event()
    real_await = ralmspec_engine.await_search

    def await_marked(*args, **kwargs):  # type: ignore[no-untyped-def]
        waiting.set()
        return real_await(*args, **kwargs)

    monkeypatch.setattr(ralmspec_engine, "await_search", await_marked)

    class Slow(HashRetriever):
        def search(self, encoded, k):  # type: ignore[no-untyped-def]
            if threading.current_thread().name.startswith("ralmspec-verify"):
                assert waiting.wait(60), "the engine never waited for the search"
                waiting.clear()
            self.threads.add(threading.current_thread().name)
            return super().search(encoded, k)

    slow = Slow(DOCS, sticky=sticky)
    slow.threads = set()
    config = RaLMSpecConfig(scheduler=False, speculation_stride=2, overlap_steps=overlap_steps,
                            prefetch=sticky > 1, **SMALL)  # no prefetch: the cache misses
    out = RaLMSpec(tiny_target, slow, config).generate(QUESTIONS[0], 24)
    assert any(t.startswith("ralmspec-verify") for t in slow.threads)
    assert out.stats.overlap_s > 0
    if sticky > 1:  # steps speculated during a verification are verified next round
        assert (max(out.stats.strides) > 2) == (overlap_steps > 1)
    else:
        assert out.stats.accepted < out.stats.drafted  # mismatches roll back carried steps too
    ref = HashRetriever(DOCS, sticky=sticky)  # same hits as Slow, without the wait
    assert out.token_ids == ralmseq_generate(tiny_target, ref, QUESTIONS[0], 24,
                                             config=config).token_ids


def test_no_tensors_in_results(tiny_target) -> None:
    out = RaLMSpec(tiny_target, HashRetriever(DOCS), CONFIGS["+PSA"]).generate(QUESTIONS[2], 12)
    values = list(out.stats.as_dict().values()) + list(out.stats.as_dict()["extra"].values())
    assert not any(isinstance(v, torch.Tensor) for v in values)


class _Constant:
    def __init__(self, doc: Document):
        self.doc = doc

    def search(self, queries: Sequence[str], k: int) -> list[list[Hit]]:
        return [[Hit(self.doc, 1.0, 0)] for _ in queries]


def test_fixed_document_equals_transformers_generate(tiny_target) -> None:
    from shared_core.engines.baseline import autoregressive_generate
    from shared_core.engines.ralmspec import RaLMPrompt

    config = CONFIGS["+PSA"]
    ids = RaLMPrompt(tiny_target, QUESTIONS[0], config).ids(DOCS[3], [])
    out = RaLMSpec(tiny_target, _Constant(DOCS[3]), config).generate(QUESTIONS[0], 20)
    with torch.inference_mode():
        hf = tiny_target.model.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)
    want = hf[0, len(ids):].tolist()
    eos = next((i for i, t in enumerate(want) if t in tiny_target.eos_token_ids), len(want))
    assert out.token_ids == want[:eos]
    assert out.token_ids == autoregressive_generate(tiny_target, ids, 20).token_ids


def test_every_token_costs_one_forward_swaps_included(tiny_target) -> None:
    """A document swap's read ends with the last prompt/output id, so the token after a swap
    comes from that read's last row: RaLMSeq runs one forward per output token."""
    config = CONFIGS["base"]
    out = ralmseq_generate(tiny_target, HashRetriever(DOCS, 1), QUESTIONS[0], 24, config=config)
    docs = out.stats.doc_ids
    swaps = 1 + sum(a != b for a, b in itertools.pairwise(docs))
    assert swaps > 2  # the retriever changes documents between steps
    assert out.stats.target_forwards == len(out.token_ids)


def test_a_budget_beyond_the_static_cache_is_refused_before_decoding(tiny_target) -> None:
    """On ``cache="static"`` the positions RaLMSpec may use are the static cache's, not the
    model window's: a budget that fits the window but not the cache is refused up front (before:
    the static cache overflowed mid-generation)."""
    from dataclasses import replace

    lm = replace(tiny_target, static_capacity=140)  # the budget: up to 115 prompt ids + the reply
    spec = RaLMSpec(lm, HashRetriever(DOCS), CONFIGS["+PSA,static"])
    with pytest.raises(ValueError, match=r"exceeds the 140-token window of .* on its static cache"):
        spec.generate(QUESTIONS[0], 40)
    assert spec.generate(QUESTIONS[0], 4).token_ids  # within it: runs


def test_a_batchs_questions_share_their_retrievers_verify_workers(tiny_target) -> None:
    """The per-question views of a pipelined batch search on the retriever's own workers (one
    set per retriever), not on a new set per question whose threads pile up."""
    from shared_core.engines.ralmspec import retrievers

    retriever = HashRetriever(DOCS)
    engine = RaLMSpec(tiny_target, retriever, CONFIGS["+PSA"])
    before = set(retrievers._VERIFY_POOLS.entries)
    engine.batch(QUESTIONS, 12)
    engine.batch(QUESTIONS, 12)
    made = set(retrievers._VERIFY_POOLS.entries) - before
    assert made <= {id(retriever)} and retrievers._VERIFY_POOLS.holds(retriever)
