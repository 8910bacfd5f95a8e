"""The passage cache on llama.cpp with the embedded SmolLM2.

``exact``: a warm prefill (blocks restored from memory or from the disk tier) gives the greedy
tokens of a cold one (across a process restart: tests/conformance). Condition:
``load_lm(exact=True)`` and one thread (``SPECRAG_NUM_THREADS=1``); llama.cpp's batched rows are
bit-stable only without weight repacking. ``blend``: reuses passages anywhere and reports what it
reused and recomputed (its quality is measured by ``python -m shared_core.bench passage-cache``,
not asserted here). A failed assembly leaves an empty session, a cleared context and only whole store entries.
"""

from __future__ import annotations

import itertools
import os

import pytest
from fakes import PASSAGES

from shared_core.config import PassageCacheConfig
from shared_core.runtime.models import load_lm
from shared_core.runtime.passage_cache import attach, passage_stats, register_passages, warm_passages
from shared_core.runtime.passage_cache import llamacpp as passage_llamacpp
from shared_core.runtime.passage_cache.llamacpp import BLOCK, PLACE_SEQ
from shared_core.runtime.passage_cache.store import SUFFIX, _checked_payload
from tests.tiny import require_llamacpp_smollm2

pytestmark = pytest.mark.integration

require_llamacpp_smollm2()

N_NEW = 10


def prompt_ids(lm, order, question):
    text = "Context:\n" + "\n\n".join(PASSAGES[i] for i in order) + f"\n\nQuestion: {question}"
    return list(lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
        return_dict=True)["input_ids"])


def greedy(lm, ids, n=N_NEW):
    session = lm.open_session()
    logits = session.prefill(ids)
    out = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = session.extend([out[-1]])[-1]
    return out, session


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = os.environ.get("SPECRAG_NUM_THREADS")
    os.environ["SPECRAG_NUM_THREADS"] = "1"
    yield
    if before is None:
        del os.environ["SPECRAG_NUM_THREADS"]
    else:
        os.environ["SPECRAG_NUM_THREADS"] = before


def _load(mode, **kw):
    return load_lm("smollm2-135m-instruct", backend="llama.cpp", n_ctx=1024, prefix_cache=False,
                   passage_cache=mode, **kw)


@pytest.fixture(scope="module")
def exact_model():
    return _load("exact", exact=True)


@pytest.fixture(scope="module")
def blend_model():
    return _load("blend")


def _fresh(lm, tmp_path, mode, **settings):
    """The model with a new, empty cache whose disk tier is under ``tmp_path``."""
    attach(lm.model, PassageCacheConfig(mode=mode, **settings), disk_dir=tmp_path / "passage_kv")
    return lm


def test_exact_warm_equals_cold_and_reuses_blocks(exact_model, tmp_path):
    lm = _fresh(exact_model, tmp_path, "exact")
    ids = prompt_ids(lm, [0, 1, 2], "Who built the weir?")
    cold, session = greedy(lm, ids)
    assert session.passage_report.reused == 0 and session.passage_report.stored == 2
    del session
    warm, session = greedy(lm, ids)
    assert session.passage_report.reused == 2 * BLOCK == session.reused_tokens
    assert session.passage_report.read == len(ids) - 2 * BLOCK
    assert warm == cold
    other = prompt_ids(lm, [1, 0, 2], "Who built the weir?")  # another prefix: nothing reused
    _, session = greedy(lm, other, 1)
    assert session.passage_report.reused == 0


def test_a_corrupt_block_on_disk_is_recomputed_not_used(exact_model, tmp_path):
    lm = _fresh(exact_model, tmp_path, "exact")
    ids = prompt_ids(lm, [0, 2], "Who built the weir?")
    cold, session = greedy(lm, ids)
    del session
    lm.model.passage_cache.store.flush()
    files = sorted((tmp_path / "passage_kv").rglob(f"*{SUFFIX}"))
    assert files
    for path in files:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    lm.model.passage_cache.store.clear_memory()
    warm, session = greedy(lm, ids)
    assert warm == cold
    assert session.passage_report.reused == 0
    assert passage_stats(lm)["store"]["corrupt"] == 1  # the first block: the walk stops there
    assert session.passage_report.stored == len(files)  # written again, whole


def _recorded_decodes(monkeypatch) -> list:
    """Every ``llama_decode`` the passage cache makes from now on, as its entries."""
    batches: list = []
    original = passage_llamacpp.decode
    monkeypatch.setattr(passage_llamacpp, "decode",
                        lambda lm_, slot, entries: batches.append(entries) or original(
                            lm_, slot, entries))
    return batches


def test_blend_reuses_passages_in_any_order_and_reports_counts(blend_model, tmp_path,
                                                              monkeypatch):
    lm = _fresh(blend_model, tmp_path, "blend", recompute_share=0.15)
    assert warm_passages(lm, PASSAGES, progress=False)["computed"] == 3
    assert warm_passages(lm, PASSAGES, progress=False) == {  # resumable
        "passages": 3, "computed": 0, "skipped": 3, "too_short": 0, "too_long": 0, "not_kept": 0}
    ids = prompt_ids(lm, [2, 0, 1], "How many sluice gates does the weir have?")
    batches = _recorded_decodes(monkeypatch)
    tokens, session = greedy(lm, ids)
    report = session.passage_report
    scratch = [b for b in batches if b and b[0][2][0] not in (0, PLACE_SEQ)]
    # in prompt order, each gap after the recomputed runs of the chunk before it: every id's
    # final KV is computed after the final KV of every id before it (a prefill's order)
    positions = [sorted(e[1] for e in decode) for decode in scratch]
    assert all(a[-1] < b[0] for a, b in itertools.pairwise(positions))
    assert sum(map(len, scratch)) > report.recomputed > 0  # the gaps and the recomputed runs
    assert report.reused > 0 and report.computed_alone == 0
    assert round(0.15 * report.reused) <= report.recomputed <= 3 * round(0.15 * report.reused)
    assert report.probe > 0
    assert report.reused + report.read + report.kept == len(ids)
    assert session.reused_tokens == report.reused
    assert len(tokens) == N_NEW
    assert session._slot.tokens is None  # blended cells never serve as an exact prefix


def test_blend_recomputing_everything_reads_in_a_prefills_order(blend_model, tmp_path,
                                                                   monkeypatch):
    """At ``recompute_share=1`` every reused id is recomputed, and each id's final KV is computed
    after every id before it (a gap after the recomputed chunk before it, not before: read
    first, a gap kept the cached KV of the chunk before it, and 6 of 15 greedy answers differed
    from a plain prefill's where the exact cache's numerics alone change 3)."""
    lm = _fresh(blend_model, tmp_path, "blend", recompute_share=1.0)
    warm_passages(lm, PASSAGES, progress=False)
    ids = prompt_ids(lm, [1, 2, 0], "Who built the weir?")
    batches = _recorded_decodes(monkeypatch)
    session = lm.open_session()
    session.prefill(ids)
    report = session.passage_report
    placed = [span for span in lm.model.passage_cache.chunks_of(ids[:-1])]
    assert report.recomputed == sum(len(span) for span in placed) > 0
    written = [sorted(e[1] for e in decode) for decode in batches
               if decode and decode[0][2][0] not in (PLACE_SEQ,)]
    final = [p for decode in written for p in decode if p >= placed[0].start]
    assert final == sorted(final) and set(range(placed[0].start, len(ids) - 1)) <= set(final)


REPORT = " ".join(
    f"Sentence {i} of the report says that the {w} river flows {d} past the old mill of {t}."
    for i, (w, d, t) in enumerate([
        ("green", "north", "Arden"), ("slow", "east", "Brill"), ("wide", "south", "Carr"),
        ("cold", "west", "Dunmore"), ("deep", "north", "Elm"), ("brown", "east", "Fenn"),
        ("quiet", "south", "Gask"), ("clear", "west", "Holt"), ("grey", "north", "Ince")]))


def _chat(lm, text):
    return list(lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True,
        return_dict=True)["input_ids"])


def test_blend_finds_unregistered_text_by_content_defined_chunks(blend_model, tmp_path):
    """A plain prompt (nobody registered its passages): content-defined chunks are read in
    context the first time, stored as read and reused by a prompt in another template; no
    share, no probe."""
    lm = _fresh(blend_model, tmp_path, "blend", recompute_share=0.0)
    _, session = greedy(lm, _chat(lm, f"Context:\n{REPORT}\n\nQuestion: which mill?"), 2)
    first = session.passage_report
    assert first.reused == 0 and first.computed_alone == 0 and first.unseen > 0
    assert first.recomputed == 0 and first.probe == 0 and first.stored >= 1
    del session
    other = _chat(lm, f"Read the report, then answer.\n[report] {REPORT} [end]\nWhich river?")
    _, session = greedy(lm, other, 2)
    assert session.passage_report.reused > 0
    assert register_passages(lm, PASSAGES) == 3


def test_blend_keeps_chat_turns_without_a_chunk_out_of_the_store(blend_model, tmp_path):
    """Short prompts with no chunk store nothing, so chat traffic never evicts what
    ``warm_passages`` prepared (before: each turn stored its ids as 8-id head blocks, and ten
    turns evicted warmed passages from tiers that held them); a RAG prompt's head is stored."""
    lm = _fresh(blend_model, tmp_path, "blend", recompute_share=0.0, memory_mb=4, disk_mb=4)
    assert warm_passages(lm, PASSAGES, progress=False)["computed"] == 3
    puts = passage_stats(lm)["store"]["puts"]
    for topic in ("volcanoes", "tea", "bicycles", "octopuses", "printing", "the sky", "glaciers",
                  "honey bees", "Roman roads", "lighthouses"):
        ids = _chat(lm, f"Write two friendly sentences about {topic} for a curious child.")
        _, session = greedy(lm, ids, 1)
        assert session.passage_report.stored == 0
    assert passage_stats(lm)["store"]["puts"] == puts
    assert warm_passages(lm, PASSAGES, progress=False)["skipped"] == 3
    _, session = greedy(lm, prompt_ids(lm, [0, 1], "Who built the weir?"), 1)
    assert session.passage_report.reused > 0 and session.passage_report.stored > 0


def _entries_whole(tmp_path):
    for path in (tmp_path / "passage_kv").rglob(f"*{SUFFIX}"):
        assert _checked_payload(path.read_bytes(), path.name.removesuffix(SUFFIX)) is not None


@pytest.mark.parametrize("mode", ["exact", "blend"])
def test_an_interrupted_assembly_leaves_context_and_store_consistent(
        exact_model, blend_model, tmp_path, monkeypatch, mode):
    lm = _fresh(exact_model if mode == "exact" else blend_model, tmp_path, mode)
    cache = lm.model.passage_cache
    if mode == "blend":
        warm_passages(lm, PASSAGES[:1], progress=False)
        register_passages(lm, PASSAGES)
    ids = prompt_ids(lm, [0, 1, 2], "Who built the weir?")
    reference, session = greedy(lm, ids, 4)
    del session
    cache.store.clear_memory()
    for path in (tmp_path / "passage_kv").rglob(f"*{SUFFIX}"):
        path.unlink()
    original = cache.store.put
    calls = []

    def interrupted(key, payload):
        calls.append(key)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return original(key, payload)

    monkeypatch.setattr(cache.store, "put", interrupted)
    session = lm.open_session()
    with pytest.raises(KeyboardInterrupt):
        session.prefill(ids)
    llama, memory = lm.model.llama, session._slot.memory
    assert session.tokens == []
    for seq in range(PLACE_SEQ + 1):
        assert llama.llama_memory_seq_pos_max(memory, seq) == -1
    _entries_whole(tmp_path)
    monkeypatch.setattr(cache.store, "put", original)
    again, _ = greedy(lm, ids, 4)
    if mode == "exact":
        assert again == reference
    assert len(again) == 4


def test_bad_settings_name_the_parameter(exact_model):
    with pytest.raises(ValueError, match="passage_cache"):
        load_lm("smollm2-135m-instruct", backend="llama.cpp", passage_cache="fast")
    with pytest.raises(ValueError, match="passage_cache='blend'"):
        load_lm("smollm2-135m-instruct", backend="llama.cpp", passage_cache="blend", exact=True)
    with pytest.raises(ValueError, match="recompute_share"):
        load_lm("smollm2-135m-instruct", backend="llama.cpp", passage_cache="blend",
                recompute_share=-0.1)
    with pytest.raises(ValueError, match="passage_cache_memory_mb"):
        load_lm("smollm2-135m-instruct", backend="llama.cpp", passage_cache="exact",
                passage_cache_memory_mb=-1)
    with pytest.raises(ValueError, match="warm_passages needs"):
        warm_passages(exact_model, PASSAGES, progress=False)


def test_the_chat_adapters_turn_it_on_by_one_setting_and_report_it():
    """``ChatSpeculative`` / ``SpeculativeLLM`` with ``passage_cache="blend"``: the second
    question over the same report (another template) reads its chunks from the cache, and both
    frameworks report reused / recomputed / read prompt ids."""
    from langchain_core.messages import HumanMessage
    from llama_index.core.base.llms.types import ChatMessage, MessageRole

    from langchain_specrag.chat_models.speculative import ChatSpeculative
    from llamaindex_specrag.llms.speculative import SpeculativeLLM
    from shared_core.frontend.serving import release

    settings = {"model": "smollm2-135m-instruct", "backend": "llama.cpp", "engine": "autoregressive",
                "passage_cache": "blend", "passage_cache_disk_mb": 0, "prefix_cache": False}
    release("smollm2-135m-instruct", None, None, "llama.cpp")  # an earlier test's copy has other settings
    chat = ChatSpeculative(max_tokens=3, **settings)
    llm = SpeculativeLLM(max_new_tokens=3, **settings)
    try:
        chat.invoke([HumanMessage(f"Context:\n{REPORT}\n\nQuestion: which mill?")])
        reply = chat.invoke([HumanMessage(f"Read this.\n[report] {REPORT} [end]\nWhich river?")])
        report = reply.response_metadata["passage_cache"]
        assert report["reused"] > 0
        assert reply.usage_metadata["input_token_details"]["cache_read"] >= report["reused"]
        answer = llm.chat([ChatMessage(role=MessageRole.USER,
                                       content=f"Notes: {REPORT}\nWhat flows past Gask?")])
        assert answer.raw["passage_cache"]["reused"] > 0
        assert answer.raw["passage_cache"]["recomputed"] > 0
    finally:
        release("smollm2-135m-instruct", None, None, "llama.cpp")


def test_exact_standard_rag_rows_reuse_prefix_blocks_and_equal_a_cold_run(exact_model, tmp_path):
    """``generate_parallel`` (standard RAG, the drafter's rows) restores the rows' common prefix
    from stored blocks; the answer equals the cold one token for token."""
    from shared_core.engines.speculative_rag.prompts import rag_prompt
    from shared_core.retrieval.base import Document

    lm = _fresh(exact_model, tmp_path, "exact")
    docs = [Document(text=t, id=str(i)) for i, t in enumerate(PASSAGES)]
    prompt = rag_prompt(lm, "Who built the weir?", docs)
    [(cold, _)] = lm.generate_parallel([prompt], 6, lambda r, ids: False)
    [(warm, _)] = lm.generate_parallel([prompt], 6, lambda r, ids: False)
    assert lm.model.passage_cache.last.reused == (len(prompt) - 1) // BLOCK * BLOCK > 0
    assert warm == cold


def test_the_benchmark_reports_every_method_and_resumes_without_redoing_a_question(tmp_path):
    """``python -m shared_core.bench passage-cache`` on two questions: every method reported with
    its paired test, the rows kept, and a second run finds them and runs no question again."""
    import argparse

    from shared_core.bench.system import passage_cache as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--model", "smollm2-135m-instruct", "--datasets", "nq",
                              "--limit", "2", "--shares", "0", "--exact", "1",
                              "--max-new-tokens", "2", "--kv-dir", str(tmp_path / "kv")])
    args.out, args.plot = str(tmp_path / "report.json"), None
    report = bench.run(args)
    methods = report["datasets"]["nq"]["methods"]
    from shared_core.bench.system.server_cache import xllamacpp_installed

    server = {"llama_server_cache_reuse"} if xllamacpp_installed() else set()
    assert set(methods) == {"full", "blend_stream", "blend_0", "llama_ram_cache", "exact_cold",
                            "exact_warm", *server}
    assert methods["exact_warm"]["answer_equal"] == "1/1"  # the exact contract
    assert methods["blend_0"]["cache"]["reused"] > 0
    assert {"gained", "lost", "p_value"} <= set(methods["blend_0"]["accuracy_vs_full"])
    rows = (tmp_path / "report.json.rows.jsonl").read_text().splitlines()
    assert len(rows) == 2
    again = bench.run(args)
    assert (tmp_path / "report.json.rows.jsonl").read_text().splitlines() == rows
    assert again["datasets"]["nq"]["methods"]["full"]["ttft_s"] == methods["full"]["ttft_s"]
