"""RaLMSpec ``batch``/``abatch`` with cross-question pipelining (question i+1's first retrieval
rides in question i's last batched search) and OS³ with several overlapped steps."""

from __future__ import annotations

import math

import pytest
from fakes import HashEmbedder
from tiny import CORPUS

from shared_core.engines.os3 import OS3Scheduler
from shared_core.engines.ralmspec import RaLMSpec, RaLMSpecConfig
from shared_core.retrieval import DenseRetriever, Document

QUESTIONS = ["Who wrote the report?", "What is the capital of France?",
             "What does a suffix automaton find?", "What jumps over the lazy dog?"]
CONFIG = RaLMSpecConfig(max_doc_tokens=48, speculation_stride=3, scheduler=False,
                        async_verify=False)


class Counted(DenseRetriever):
    """The real exact dense retriever, counting its batched index calls and their sizes."""

    def __init__(self) -> None:
        super().__init__(HashEmbedder(), index="exact", query_batch_size=1)
        self.batches: list[int] = []

    def search_vectors(self, vectors, k):  # type: ignore[override]
        self.batches.append(len(vectors))
        return super().search_vectors(vectors, k)


@pytest.fixture
def retriever() -> Counted:
    dense = Counted()
    dense.add([Document(f"doc-{i}", t) for i, t in enumerate(dict.fromkeys(CORPUS))])
    return dense


@pytest.mark.parametrize("switches", [{}, {"async_verify": True}, {
    "scheduler": True, "prefetch": True, "async_verify": True, "overlap_steps": 3}])
def test_batch_equals_ralmseq_per_question_with_fewer_searches(retriever, tiny_target,
                                                               switches) -> None:
    config = RaLMSpecConfig(**{**CONFIG.__dict__, **switches})
    engine = RaLMSpec(tiny_target, retriever, config)
    refs = [engine.generate_baseline(q, 20) for q in QUESTIONS]
    retriever.batches.clear()
    alone = [engine.generate(q, 20) for q in QUESTIONS]
    calls_alone = len(retriever.batches)
    retriever.batches.clear()
    batched = engine.batch(QUESTIONS, 20)
    assert [r.token_ids for r in batched] == [r.token_ids for r in refs]
    assert [r.token_ids for r in alone] == [r.token_ids for r in refs]
    pipelined = [r.stats.first_retrieval_pipelined for r in batched]
    assert pipelined[0] is False and sum(pipelined) >= 1
    assert sum(r.stats.backend_searches for r in batched) == len(retriever.batches)
    if not switches:
        # every pipelined question saved its own first search; none was added. With async
        # verification or prefetching, how many speculative steps run before a verification
        # returns depends on timing, and so does the number of searches (16 or 17 of 19 seen
        # on one machine): only the synchronous engine's count is fixed.
        assert len(retriever.batches) == calls_alone - sum(pipelined)


async def test_abatch_equals_batch(retriever, tiny_target) -> None:
    engine = RaLMSpec(tiny_target, retriever, CONFIG)
    got = await engine.abatch(QUESTIONS[:2], 12)
    assert [r.token_ids for r in got] == [r.token_ids for r in engine.batch(QUESTIONS[:2], 12)]


def test_batch_checks_every_question_before_model_work(retriever, tiny_target) -> None:
    engine = RaLMSpec(tiny_target, retriever, CONFIG)
    with pytest.raises(TypeError, match=r"questions\[1\]"):
        engine.batch(["fine", 3], 8)
    with pytest.raises(ValueError, match="questions"):
        engine.batch([], 8)
    assert retriever.batches == []


def test_os3_overlap_steps_model() -> None:
    one = OS3Scheduler(async_verify=True, overlap_steps=1)
    four = OS3Scheduler(async_verify=True, overlap_steps=4)
    a, b, gamma = 1.0, 3.0, 0.9
    for s in (1, 2, 5):
        # m = 1 keeps the paper-style formula with one overlapped step
        expected = (1 - gamma**s) / (1 - gamma) / (s * a + max(a, b) + (1 - 2 * gamma**s) * a)
        assert one.expected_rate(s, a, b, gamma) == pytest.approx(expected)
        # m = 4: ceil(b/a) = 3 steps fill the search, all carried when the round is right
        o = min(4, math.ceil(b / a))
        expected = (1 - gamma**s) / (1 - gamma) / (
            s * a + max(o * a, b) + (1 - gamma**s) * a - gamma**s * o * a)
        assert four.expected_rate(s, a, b, gamma) == pytest.approx(expected)
        assert four.expected_rate(s, a, b, gamma) > one.expected_rate(s, a, b, gamma)
    # a search shorter than a step leaves room for one overlapped step only
    assert four.expected_rate(2, 1.0, 0.5, 0.8) == pytest.approx(one.expected_rate(2, 1.0, 0.5, 0.8))


def test_bench_pipelined_methods_are_checked_before_model_work() -> None:
    import argparse

    from shared_core.bench import ralmspec as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert bench._pipelined_methods(parser.parse_args([]).pipelined) == []
    assert bench._pipelined_methods(parser.parse_args(["--pipelined"]).pipelined) == ["+PSA"]
    args = parser.parse_args(["--pipelined", "+A(o4),+PSA"])
    assert bench._pipelined_methods(args.pipelined) == ["+A(o4)", "+PSA"]
    args = parser.parse_args(["--pipelined", "+PSA,nope", "--model", "not-a-model"])
    with pytest.raises(ValueError, match="--pipelined"):
        bench.run_doc(args)  # fails on the name, before loading the (unknown) model
