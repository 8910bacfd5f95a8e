"""Speculative RAG on tiny in-process models: subsets, batching equivalence, scoring, errors."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from shared_core.engines.speculative_rag import (
    AnswerDraft,
    SpeculativeRAG,
    SpeculativeRAGConfig,
    check_inputs,
    combined_score,
    draft_prompt,
    generate_batch,
    kmeans_labels,
    one_per_cluster_subsets,
    parse_draft,
    same_cluster_subsets,
    select_best,
    to_documents,
    verifier_rows,
    verify_batch,
)
from shared_core.retrieval.base import Document, Hit
from tests.fakes import SPECRAG_DOCS, BucketEmbedder, LCRetriever, LIRetriever
from tests.tiny import tiny_lm

DOCS = SPECRAG_DOCS
EMBEDDER = BucketEmbedder(dim=32, floor=0.0)  # documents sharing words land close together


class FakeRetriever:
    def __init__(self, docs: list[Document]) -> None:
        self.docs, self.calls = docs, 0

    def search(self, queries: list[str], k: int) -> list[list[Hit]]:
        self.calls += 1
        return [[Hit(d, 1.0, r) for r, d in enumerate(self.docs[:k])] for _ in queries]


@pytest.fixture(scope="module")
def drafter():
    return tiny_lm(2, seed=1)


@pytest.fixture(scope="module")
def verifier():
    return tiny_lm(2, seed=2)


def engine(drafter, verifier, **config):
    cfg = SpeculativeRAGConfig(**{"num_drafts": 3, "docs_per_draft": 2, "max_draft_tokens": 8,
                                  **config})
    return SpeculativeRAG(drafter, verifier, embedder=EMBEDDER, config=cfg)


# ---------------------------------------------------------------- 1. multi-perspective subsets

def test_one_per_cluster_subsets_are_distinct_and_seeded():
    labels = [0, 1, 0, 1, 2, 2, 0, 1, 2, 0]
    subsets, relaxed = one_per_cluster_subsets(labels, 3, 5, random.Random(7))
    assert relaxed == 0 and len(subsets) == 5 and len(set(subsets)) == 5
    for s in subsets:
        assert sorted(labels[i] for i in s) == [0, 1, 2]
    assert subsets == one_per_cluster_subsets(labels, 3, 5, random.Random(7))[0]
    used = {i for s in subsets for i in s}
    assert len(used) >= 9  # least-used-first spreads the drafts over the documents


def test_one_per_cluster_falls_back_when_clusters_are_too_small():
    labels = [0, 1, 1, 1]  # only 3 one-per-cluster pairs exist
    subsets, relaxed = one_per_cluster_subsets(labels, 2, 4, random.Random(0))
    assert relaxed == 1 and len(set(subsets)) == 4 and all(len(s) == 2 for s in subsets)


def test_same_cluster_subsets_stay_inside_a_cluster():
    labels = [0, 0, 0, 1, 1, 1]
    subsets, relaxed = same_cluster_subsets(labels, 2, 4, random.Random(0))
    assert relaxed == 0 and len(set(subsets)) == 4
    assert all(len({labels[i] for i in s}) == 1 for s in subsets)


def test_kmeans_is_seeded_and_separates_clusters():
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.normal(0, 0.05, (5, 8)) + 1, rng.normal(0, 0.05, (5, 8)) - 1])
    x = (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)
    labels = kmeans_labels(x, 2, seed=3)
    assert labels == kmeans_labels(x, 2, seed=3)
    assert len(set(labels[:5])) == 1 and len(set(labels[5:])) == 1 and labels[0] != labels[5]


def test_kmeans_without_faiss_finds_the_same_clusters(monkeypatch):
    import sys

    rng = np.random.default_rng(3)
    centres = rng.standard_normal((3, 16)) * 4
    vectors = np.concatenate([c + rng.standard_normal((6, 16)) for c in centres]).astype(
        np.float32)
    with_faiss = kmeans_labels(vectors, 3, seed=5)
    monkeypatch.setitem(sys.modules, "faiss", None)  # the GPU machine has no faiss
    without = kmeans_labels(vectors, 3, seed=5)
    assert without == kmeans_labels(vectors, 3, seed=5)  # seeded
    # the same partition (cluster ids may be numbered differently)
    assert len({(a, b) for a, b in zip(with_faiss, without, strict=True)}) == 3
    assert sorted(np.bincount(without).tolist()) == [6, 6, 6]


def test_engine_subsets_follow_strategy(drafter, verifier):
    eng = engine(drafter, verifier, subset_strategy="random")
    subsets = eng.sample_subsets("q", DOCS)
    assert len(set(subsets)) == 3 and subsets == eng.sample_subsets("q", DOCS)


# ---------------------------------------------------------------- 2. batched drafting

def test_batched_drafting_equals_per_row(drafter):
    prompts = [draft_prompt(drafter, "who is the capital?", DOCS[i:i + n], "rationale_first")
               for i, n in ((0, 2), (2, 1), (1, 4))]
    assert len({len(p) for p in prompts}) == 3  # different lengths: left padding matters
    batched = generate_batch(drafter, prompts, 10, stop_on_answer_line=False)
    for prompt, (ids, logp) in zip(prompts, batched, strict=True):
        [(alone_ids, alone_logp)] = generate_batch(drafter, [prompt], 10,
                                                   stop_on_answer_line=False)
        assert ids == alone_ids
        assert logp == pytest.approx(alone_logp, abs=1e-3)
        assert len(logp) == len(ids)


def test_draft_logprob_is_the_models_probability(drafter):
    prompt = draft_prompt(drafter, "capital of France?", DOCS[:2], "answer_first")
    [(ids, logp)] = generate_batch(drafter, [prompt], 6, stop_on_answer_line=False)
    full = torch.tensor([prompt + ids])
    with torch.inference_mode():
        logits = drafter.model(full).logits.log_softmax(-1)[0]
    expected = sum(float(logits[len(prompt) + i - 1, t]) for i, t in enumerate(ids))
    assert sum(logp) == pytest.approx(expected, abs=1e-3)


# ---------------------------------------------------------------- 3. verification

def test_batched_verifier_scores_equal_per_draft_and_full_softmax(verifier):
    drafts = [("Paris is the capital.", "Paris"), ("The fox jumps over the dog.", "a fox"),
              ("x", "Berlin is the capital of Germany")]
    batched, _ = verify_batch(verifier, "capital of France?", drafts)
    rows, sc_spans, yes_spans = verifier_rows(verifier, "capital of France?", drafts)
    for i, draft in enumerate(drafts):
        [alone], _ = verify_batch(verifier, "capital of France?", [draft])
        assert batched[i] == pytest.approx(alone, abs=1e-3)
        with torch.inference_mode():
            logp = verifier.model(torch.tensor([rows[i]])).logits.log_softmax(-1)[0]
        for (start, end), value in zip((sc_spans[i], yes_spans[i]), batched[i][:2], strict=True):
            ref = sum(float(logp[t - 1, rows[i][t]]) for t in range(start, end))
            assert value == pytest.approx(ref, abs=1e-3)
        assert batched[i][2] == sc_spans[i][1] - sc_spans[i][0]


def test_answer_returns_every_draft_with_three_scores(drafter, verifier):
    result = engine(drafter, verifier, force_answer_line=True, draft_order="rationale_first").answer(
        "capital of France?", DOCS)
    assert len(result.drafts) == 3 and result.text == result.drafts[result.best].answer
    for d in result.drafts:
        assert None not in (d.log_self_contain, d.log_self_reflect)
        assert d.score == pytest.approx(d.log_draft + d.log_self_contain + d.log_self_reflect)
        assert len(d.doc_ids) == 2 and d.draft_tokens > 0 and d.self_contain_tokens > 0
    assert result.best == max(range(3), key=lambda i: result.drafts[i].score)
    stats = result.stats.as_dict()
    # a random tiny model never writes "Answer:", so every row takes the forced-answer step
    assert stats["answer_continuations"] == 3 and all("\nAnswer:" in d.raw for d in result.drafts)
    assert stats["num_drafts"] == 3 and stats["verify_tokens"] > 0
    assert not any(isinstance(v, torch.Tensor) for v in stats.values())


def test_stats_say_which_runtime_and_threads_ran(drafter, verifier):
    """As every token engine's stats do (before: none of the four keys)."""
    drafter.backend_reason = "asked for"
    verifier.backend_reason = "a torch dtype was given"
    try:
        stats = engine(drafter, verifier).answer("capital of France?", DOCS).stats.as_dict()
        standard = engine(drafter, verifier).standard_rag("capital of France?", DOCS,
                                                          model="drafter").stats.as_dict()
    finally:
        drafter.backend_reason = verifier.backend_reason = "built by the caller"
    assert stats["backend"] == "torch" == standard["backend"]
    assert stats["backend_reason"] == ("drafter: asked for, verifier: a torch dtype was given")
    assert standard["backend_reason"] == "asked for"
    assert stats["threads"] == torch.get_num_threads() == standard["threads"]


def test_stages_yield_typed_events_then_the_answer(drafter, verifier):
    """The round as typed events, in stage order, ending with the result ``answer`` returns;
    ``answer``'s ``on_event`` hook sees each event's name and data."""
    from shared_core.engines.speculative_rag.events import (
        Answered,
        DocumentsRetrieved,
        DraftsVerified,
        DraftsWritten,
        SubsetsSampled,
    )

    eng = engine(drafter, verifier)
    events = list(eng.stages("capital of France?", DOCS))
    assert [type(e) for e in events] == [DocumentsRetrieved, SubsetsSampled, DraftsWritten,
                                         DraftsVerified, Answered]
    result = events[-1].result
    assert events[0].num_documents == len(DOCS)
    assert events[1].subsets == tuple(d.doc_indices for d in result.drafts)
    assert events[2].answers == tuple(d.answer for d in result.drafts)
    assert (events[3].scores, events[3].best) == (tuple(d.score for d in result.drafts),
                                                  result.best)
    seen = []
    direct = eng.answer("capital of France?", DOCS, on_event=lambda n, d: seen.append((n, d)))
    assert seen == [(e.name, e.data) for e in events[:4]]
    assert seen[1][1] == {"subsets": [list(s) for s in events[1].subsets]}
    assert (direct.text, direct.drafts) == (result.text, result.drafts)


def test_stages_check_now_and_stop_when_the_reader_does(drafter, verifier, monkeypatch):
    eng = engine(drafter, verifier)
    with pytest.raises(ValueError, match="question"):
        eng.stages("  ", DOCS)  # before the first event is read
    drafted = []
    monkeypatch.setattr(SpeculativeRAG, "draft", lambda self, *a: drafted.append(a) or [])
    stages = eng.stages("capital of France?", DOCS)
    assert [type(next(stages)).__name__ for _ in range(2)] == ["DocumentsRetrieved",
                                                               "SubsetsSampled"]
    stages.close()  # the reader stops before drafting: no draft is written
    assert drafted == []


def test_drafter_only_needs_no_verifier(drafter):
    cfg = SpeculativeRAGConfig(num_drafts=2, max_draft_tokens=4, use_self_contain=False,
                               use_self_reflect=False)
    result = SpeculativeRAG(drafter, None, embedder=EMBEDDER, config=cfg).answer("q", DOCS)
    assert all(d.log_self_contain is None for d in result.drafts)
    assert result.stats.verify_tokens == 0


def test_score_switches_and_random_selection():
    drafts = [AnswerDraft("a", "", "", (), (), True, log_draft=-1.0, score=-3.0),
              AnswerDraft("b", "", "", (), (), True, log_draft=-2.0, score=-1.0)]
    assert select_best(drafts, "score", random.Random(0)) == 1
    picks = {select_best(drafts, "random", random.Random(s)) for s in range(20)}
    assert picks == {0, 1}


def test_draft_is_kept_as_the_earlier_name_of_answer_draft():
    from shared_core.drafters.base import Draft as TokenDraft
    from shared_core.engines.speculative_rag import Draft

    assert Draft is AnswerDraft and TokenDraft is not AnswerDraft


def test_vote_selects_the_answer_most_drafts_agree_on():
    def draft(answer: str, score: float) -> AnswerDraft:
        return AnswerDraft(answer, "", "", (), (), True, log_draft=score, score=score)

    drafts = [draft("Berlin", -1.0), draft("the Paris.", -9.0), draft("paris", -5.0), draft("", -2.0),
              draft("", -3.0)]
    assert select_best(drafts, "score", random.Random(0)) == 0
    assert select_best(drafts, "vote", random.Random(0)) == 2  # best-scored of the "paris" pair
    # empty answers never win a vote; without agreement the score decides
    assert select_best([draft("", -1.0), draft("", -1.5), draft("Rome", -4.0)], "vote",
                       random.Random(0)) == 2
    assert select_best([draft("Rome", -4.0), draft("Oslo", -2.0)], "vote", random.Random(0)) == 1


def test_length_normalised_score_divides_by_token_counts():
    d = AnswerDraft("a", "", "", (), (), True, log_draft=-6.0, log_self_contain=-8.0,
                    log_self_reflect=-0.5, draft_tokens=3, self_contain_tokens=4)
    assert combined_score(d, SpeculativeRAGConfig()) == pytest.approx(-14.5)
    normalised = SpeculativeRAGConfig(length_normalize=True)
    assert combined_score(d, normalised) == pytest.approx(-2.0 - 2.0 - 0.5)
    no_sc = SpeculativeRAGConfig(length_normalize=True, use_self_contain=False)
    assert combined_score(d, no_sc) == pytest.approx(-2.5)
    with pytest.raises(ValueError, match="selection"):
        SpeculativeRAGConfig(selection="majority")


def test_retriever_input(drafter, verifier):
    retriever = FakeRetriever(DOCS)
    eng = engine(drafter, verifier, retrieve_k=6)
    result = eng.answer("capital of France?", retriever=retriever)
    assert retriever.calls == 1 and len(result.documents) == 6
    rag = eng.standard_rag("capital?", DOCS[:2], model="drafter")
    assert rag.stats.num_documents == 2 and rag.raw.startswith("Answer:")


# ---------------------------------------------------------------- errors, parsing, inputs

@pytest.mark.parametrize(("kwargs", "match"), [
    ({"question": "  ", "documents": DOCS}, "question"),
    ({"question": "q", "documents": []}, "documents"),
])
def test_bad_inputs_fail_before_model_work(kwargs, match):
    class Exploding:
        def __getattr__(self, name):
            raise AssertionError("model touched")

    eng = SpeculativeRAG(Exploding(), Exploding(), embedder=Exploding())
    with pytest.raises(ValueError, match=match):
        eng.answer(**kwargs)


def test_unknown_model_and_bad_config():
    with pytest.raises(ValueError, match="drafter='no-such-model'"):
        SpeculativeRAG("no-such-model")
    with pytest.raises(ValueError, match="verifier="):
        SpeculativeRAG("smollm2-135m-instruct", "nope")
    with pytest.raises(ValueError, match="num_drafts"):
        SpeculativeRAGConfig(num_drafts=0)
    with pytest.raises(ValueError, match="subset_strategy"):
        SpeculativeRAGConfig(subset_strategy="kmeans")
    with pytest.raises(ValueError, match="dtype='int8'"):
        SpeculativeRAG("smollm2-135m-instruct", dtype="int8")
    with pytest.raises(ValueError, match="documents is None"):
        check_inputs("q", None, SpeculativeRAGConfig()) and SpeculativeRAG(
            "smollm2-135m-instruct")._documents("q", None, None, 3)


@pytest.mark.parametrize(("text", "rationale", "answer", "ok"), [
    ("Rationale: Paris is the capital.\nAnswer: Paris.\n", "Paris is the capital.", "Paris", True),
    ("Rationale: It says so. The answer is: \"Berlin\"", "It says so. The", "Berlin", True),
    ("Rationale: Doc 1 names it.\nAnswer:\n\nLyon\n", "Doc 1 names it.", "Lyon", False),
    ("Rationale: Madrid is the capital of Spain. It is big.", "Madrid is the capital of Spain. "
     "It is big.", "Madrid is the capital of Spain", False),
    ("Rationale:", "", "", False),
])
def test_parse_draft_and_fallbacks(text, rationale, answer, ok):
    assert parse_draft(text) == (rationale, answer, ok)


def test_to_documents_accepts_framework_objects():
    from langchain_core.documents import Document as LCDocument
    from llama_index.core.schema import NodeWithScore, TextNode

    docs = to_documents(["plain", LCDocument(page_content="lc", metadata={"a": 1}, id="x"),
                         NodeWithScore(node=TextNode(text="li", id_="n1"), score=0.5),
                         Hit(DOCS[0], 1.0, 0)])
    assert [d.text for d in docs] == ["plain", "lc", "li", DOCS[0].text]
    assert docs[1].id == "x" and docs[2].metadata["score"] == 0.5
    with pytest.raises(TypeError, match=r"documents\[0\]"):
        to_documents([object()])


# ---------------------------------------------------------------- adapters (tiny models)

def test_langchain_runnable_invoke_details_events_and_nesting(drafter, verifier):
    from langchain_core.callbacks import BaseCallbackHandler

    from langchain_specrag import SpeculativeRAGRunnable

    class Recorder(BaseCallbackHandler):
        def __init__(self):
            self.events, self.retriever_parents, self.chain_ids = [], [], []

        def on_custom_event(self, name, data, *, run_id, **kwargs):
            self.events.append((name, run_id))

        def on_retriever_start(self, serialized, query, *, run_id, parent_run_id=None, **kw):
            self.retriever_parents.append(parent_run_id)

        def on_chain_start(self, serialized, inputs, *, run_id, parent_run_id=None, **kw):
            self.chain_ids.append(run_id)

    eng = engine(drafter, verifier)
    rag = SpeculativeRAGRunnable(retriever=LCRetriever(DOCS), engine=eng, num_drafts=3,
                                 retrieve_k=6)
    recorder = Recorder()
    answer = rag.invoke("capital of France?", {"callbacks": [recorder]})
    assert isinstance(answer, str)
    assert [e[0] for e in recorder.events] == ["specrag_retrieved", "specrag_subsets",
                                                "specrag_drafted", "specrag_verified"]
    assert recorder.retriever_parents == [recorder.chain_ids[0]]  # retriever run nests
    details = rag.with_config(run_name="x").invoke({"question": "capital?", "documents": None})
    assert details == rag.invoke("capital?")
    full = SpeculativeRAGRunnable(engine=eng, num_drafts=3, with_details=True).invoke(
        {"question": "capital?", "documents": [d.text for d in DOCS]})
    assert set(full) >= {"answer", "drafts", "scores", "documents", "stats"}
    assert len(full["drafts"]) == 3 and full["answer"] == full["drafts"][full["best"]]["answer"]
    assert list(rag.stream("capital?")) == [details]


async def test_langchain_runnable_async_and_events(drafter, verifier):
    from langchain_specrag import SpeculativeRAGRunnable

    rag = SpeculativeRAGRunnable(retriever=LCRetriever(DOCS), engine=engine(drafter, verifier),
                                 num_drafts=3, retrieve_k=6)
    sync = rag.invoke("capital of France?")
    assert await rag.ainvoke("capital of France?") == sync
    assert await rag.abatch(["capital of France?", "capital of France?"]) == [sync, sync]
    names = [e["name"] async for e in rag.astream_events("capital of France?", version="v2")
             if e["event"] == "on_custom_event"]
    assert names == ["specrag_retrieved", "specrag_subsets", "specrag_drafted",
                     "specrag_verified"]
    with pytest.raises(ValueError, match="retriever is None"):
        await SpeculativeRAGRunnable(engine=engine(drafter, verifier)).ainvoke("q")


def test_llamaindex_query_engine(drafter, verifier):
    import asyncio

    from llamaindex_specrag import SpeculativeRAGQueryEngine

    qe = SpeculativeRAGQueryEngine(LIRetriever(DOCS, score=1.0), engine=engine(drafter, verifier))
    response = qe.query("capital of France?")
    assert len(response.source_nodes) == 6 and len(response.metadata["drafts"]) == 3
    assert response.response == response.metadata["drafts"][response.metadata["best"]]["answer"]
    assert asyncio.run(qe.aquery("capital of France?")).response == response.response


def test_adapters_do_not_import_torch():
    import subprocess
    import sys

    code = ("import sys, langchain_specrag, llamaindex_specrag; "
            "from langchain_specrag.runnables import speculative_rag as a; "
            "from llamaindex_specrag.query_engines import speculative_rag as b; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_langchain_schemas_and_configurable_fields():
    from langchain_core.runnables import ConfigurableField

    from langchain_specrag import SpeculativeRAGRunnable

    rag = SpeculativeRAGRunnable()  # cheap: no model is loaded before the first call
    schema = rag.get_input_jsonschema()
    assert {"type": "string"} in schema["anyOf"] and "SpeculativeRAGInput" in schema["$defs"]
    configurable = rag.configurable_fields(num_drafts=ConfigurableField(id="num_drafts"))
    assert "num_drafts" in str(configurable.config_schema().model_json_schema())


def test_engine_retrieve_accepts_langchain_and_llamaindex_retrievers():
    from shared_core.engines.speculative_rag import retrieve

    assert [d.id for d in retrieve(LCRetriever(DOCS), "q", 3)] == ["d0", "d1", "d2"]
    assert [d.id for d in retrieve(LIRetriever(DOCS, score=0.1), "q", 4)] == ["d0", "d1", "d2", "d3"]
    assert [d.id for d in retrieve(FakeRetriever(DOCS), "q", 2)] == ["d0", "d1"]
    with pytest.raises(TypeError, match="no search/invoke/retrieve"):
        retrieve(object(), "q", 2)


# ---------------------------------------------------------------- benchmark helpers (no models)

def test_bench_metrics_and_reselection():
    from shared_core.bench.specrag import _path
    from shared_core.bench.specrag.data import is_correct
    from shared_core.bench.specrag.report import _drafts_of
    from shared_core.bench.specrag.selection import draft_oracle, reselect
    from shared_core.engines.speculative_rag import SpeculativeRAGResult, SpeculativeRAGStats

    assert is_correct("nq", "It was Wilhelm Conrad Röntgen.", ["Wilhelm Conrad Röntgen"])
    assert not is_correct("nq", "Henry Moseley", ["Wilhelm Conrad Röntgen"])
    assert is_correct("pubhealth", "True, the claim holds", ["true"])
    assert not is_correct("pubhealth", "false or true", ["true"])
    assert is_correct("pubhealth", "The statement is not correct.", ["false"])
    assert is_correct("pubhealth", "The statement is correct", ["true"])
    assert is_correct("pubhealth", "No, vaping is not banned", ["false"])
    assert not is_correct("pubhealth", "Vaping bans in India", ["true"])  # no verdict cue
    assert not is_correct("pubhealth", "Notably the claim is incorrect", ["true"])  # not "no"
    drafts = (AnswerDraft("a", "", "", ("d0",), (0,), True, log_draft=-1.0,
                          log_self_contain=-9.0, log_self_reflect=-1.0, score=-11.0),
              AnswerDraft("b", "", "", ("d1",), (1,), True, log_draft=-5.0,
                          log_self_contain=-2.0, log_self_reflect=-1.0, score=-8.0))
    result = SpeculativeRAGResult("b", "", 1, drafts, tuple(DOCS[:2]),
                                  SpeculativeRAGStats(verify_s=2.0, total_s=5.0))
    cfg = SpeculativeRAGConfig()
    assert reselect(result, "drafter_only", cfg).text == "a"
    only = reselect(result, "drafter_only", cfg).stats
    assert only.total_s == 3.0 and only.verify_s == 0.0 and result.stats.total_s == 5.0
    assert reselect(result, "abl_no_draft_score", cfg).text == "b"
    assert reselect(result, "abl_no_self_contain", cfg).text == "a"
    assert reselect(result, "sel_vote", cfg).stats.total_s == 5.0  # the vote keeps the verifier
    questions = [{"gold": ["b"]}, {"gold": ["c"]}]
    assert draft_oracle("nq", questions, {"specrag": [result, result], "rag": ["x", "y"]}) == {
        "specrag": 0.5}  # a draft says "b" (question 1), none says "c"
    assert _path("out/r.json", "nq", True) == "out/r_nq.json"
    dumped = _drafts_of({"specrag": [result], "rag_verifier": ["x"]}, 0)
    assert list(dumped) == ["specrag_drafts"]
    assert [d["answer"] for d in dumped["specrag_drafts"]] == ["a", "b"]
    assert dumped["specrag_drafts"][1]["log_self_contain"] == -2.0
    assert _path("out/{dataset}.json", "nq", True) == "out/nq.json"


def test_bench_split_keeps_training_out_of_evaluation():
    from shared_core.bench.specrag.data import load_dataset
    from shared_core.config.data_splits import SQUAD_EVAL_TITLES
    from shared_core.tools.train_drafter import build_examples
    from tests.tiny import data_dir

    root = data_dir()
    if root is None:
        pytest.skip("../shared/data not found (set SPECRAG_DATA_DIR)")
    train_ids = {ex["id"] for ex in build_examples(root, 200, 0)}
    for name in ("nq", "squad"):
        _, questions = load_dataset(name, 100, root)
        assert not train_ids & {q["id"] for q in questions}
    assert len(SQUAD_EVAL_TITLES) == 6
    corpus, claims = load_dataset("pubhealth", 5, root)
    assert {c["gold"][0] for c in claims} <= {"true", "false"} and len(corpus) > 172


def test_drafter_lora_recipe_runs_on_a_tiny_model():
    from shared_core.tools.train_drafter import encode_example, load_tuned_drafter, train_lora

    lm = tiny_lm(2, seed=5)
    ex = {"question": "capital of France?", "docs": DOCS[:2], "rationale": "Paris is the capital.",
          "answer": "Paris"}
    ids, labels = encode_example(lm, ex, max_len=512)
    target = [t for t in labels if t != -100]
    assert len(ids) == len(labels) and lm.decode(target).strip().startswith("Paris is")
    _, losses = train_lora(lm, [(ids, labels)] * 4, epochs=3, batch_size=2, lr=5e-3)
    assert len(losses) == 6 and losses[-1] < losses[0]
    with pytest.raises(ValueError, match="no tuned adapter"):
        load_tuned_drafter("tiny+specrag")


def test_top_ranked_documents_are_covered_before_lower_ones():
    # the top document (index 0) sits in the big cluster: some subsets must leave docs out,
    # and the ones left out are the lowest-ranked, never the retriever's best
    labels = [0, 0, 0, 0, 0, 0, 0, 0, 1, 1]
    for seed in range(20):
        subsets, _ = one_per_cluster_subsets(labels, 2, 5, random.Random(seed))
        used = {d for s in subsets for d in s}
        assert subsets[0] == (0, 8)
        assert {0, 1, 2, 3, 4} <= used and not used & {5, 6, 7}


def test_lora_training_runs_with_grad_mode_left_off_by_the_caller():
    from shared_core.tools.train_drafter import encode_example, train_lora

    lm = tiny_lm(2, seed=6)
    ex = {"question": "capital of France?", "docs": DOCS[:2], "rationale": "Paris.", "answer": "Paris"}
    ids, labels = encode_example(lm, ex, max_len=512)
    with torch.no_grad():  # as a generator suspended inside inference_mode leaves a thread
        _, losses = train_lora(lm, [(ids, labels)] * 2, epochs=1, batch_size=2, lr=5e-3)
    assert len(losses) == 1 and math.isfinite(losses[0])


def test_bench_main_leaves_a_per_dataset_pattern_to_the_runner(tmp_path, monkeypatch):
    """``--out 'x_{dataset}.json'``: the runner writes one report per dataset; the combined
    report is not also written under the literal pattern."""
    from shared_core.bench import __main__ as bench
    from shared_core.bench import specrag

    monkeypatch.setattr(specrag, "run", lambda args: {"engine": "specrag", "reports": {}})
    out = tmp_path / "r_{dataset}.json"
    assert bench.main(["specrag", "--dataset", "nq", "--out", str(out)]) == 0
    assert list(tmp_path.iterdir()) == []
    plain = tmp_path / "r.json"
    assert bench.main(["specrag", "--dataset", "nq", "--out", str(plain)]) == 0
    assert plain.is_file()
