"""The RAG adapters compose and stream (issue 16 items 4 and 6), on tiny models.

- inputs: a prompt's output (``StringPromptValue``, ``ChatPromptValue``, a message list), a string
  or a dict answer the same question; ``prompt | runnable`` and the
  ``{"question": ..., "documents": retriever} | runnable`` recipe work;
- ``prompt=``: LangChain / LlamaIndex templates and format strings, checked at construction with
  errors naming ``prompt``, reaching the engine as the same (role, format string) pairs;
- streaming: Speculative RAG's stage events then the answer in chunks (sum = ``invoke``), the
  LlamaIndex ``streaming=True`` responses (joined = the non-streaming text) for both engines.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from fakes import ADAPTER_DOCS, LCRetriever, LIRetriever, adapter_index, adapter_ranked
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.prompts import PromptTemplate as LCPromptTemplate
from langchain_core.runnables import RunnablePassthrough
from llama_index.core.base.response.schema import AsyncStreamingResponse, StreamingResponse
from llama_index.core.llms import ChatMessage
from llama_index.core.prompts import ChatPromptTemplate as LIChatPromptTemplate
from llama_index.core.prompts import PromptTemplate as LIPromptTemplate
from tiny import tiny_lm

from langchain_specrag import RaLMSpecRunnable, SpeculativeRAGRunnable
from llamaindex_specrag import RaLMSpecQueryEngine, SpeculativeRAGQueryEngine
from shared_core.config.rag import RaLMSpecConfig, SpeculativeRAGConfig
from shared_core.engines.ralmspec import RaLMSpec
from shared_core.engines.speculative_rag import SpeculativeRAG
from shared_core.frontend.rag_streams import answer_chunks

DOCS = ADAPTER_DOCS

QUESTION = "What is the capital of France?"
EVENTS = ["specrag_retrieved", "specrag_subsets", "specrag_drafted", "specrag_verified"]


@pytest.fixture(scope="module")
def specrag() -> SpeculativeRAG:
    config = SpeculativeRAGConfig(num_drafts=2, docs_per_draft=2, max_draft_tokens=12,
                                  retrieve_k=6, subset_strategy="random")
    return SpeculativeRAG(tiny_lm(1, seed=1), tiny_lm(1, seed=2), config=config)


@pytest.fixture(scope="module")
def ralmspec(tiny_target) -> RaLMSpec:
    config = RaLMSpecConfig(max_doc_tokens=32, query_tokens=8, prefetch_k=3)
    return RaLMSpec(tiny_target, adapter_index(), config)


def _runnables(specrag: SpeculativeRAG, ralmspec: RaLMSpec) -> list:
    return [SpeculativeRAGRunnable(retriever=LCRetriever(adapter_ranked), engine=specrag),
            RaLMSpecRunnable(engine=ralmspec, max_new_tokens=12)]


# ----------------------------------------------------------------------------- inputs


def test_a_prompts_output_is_a_question(specrag, ralmspec) -> None:
    chat = ChatPromptTemplate.from_messages([
        ("system", "You answer briefly."), ("human", "Hello"), ("ai", "Hi, ask away."),
        ("human", "{question}")])
    as_text = LCPromptTemplate.from_template("{question}")
    for runnable in _runnables(specrag, ralmspec):
        reference = runnable.invoke(QUESTION)
        messages = [SystemMessage("Be brief."), HumanMessage("hi"), AIMessage("hello"),
                    HumanMessage(QUESTION)]
        inputs = [as_text.invoke({"question": QUESTION}), chat.invoke({"question": QUESTION}),
                  messages, {"question": QUESTION}]
        assert [runnable.invoke(value) for value in inputs] == [reference] * len(inputs)
        assert (chat | runnable).invoke({"question": QUESTION}) == reference
        assert "".join((chat | runnable).stream({"question": QUESTION})) == reference


def test_as_tool_takes_a_question(specrag, ralmspec) -> None:
    """An agent's tool: ``{"question": str}`` by default (the input type is a union, from which
    LangChain infers no schema); the tool answers as ``invoke`` does."""
    for runnable in _runnables(specrag, ralmspec):
        tool = runnable.as_tool(name="handbook", description="Answers from the handbook.")
        assert list(tool.args) == ["question"]
        assert tool.invoke({"question": QUESTION}) == runnable.invoke(QUESTION)
        typed = runnable.as_tool(name="t", description="d", arg_types={"question": str})
        assert list(typed.args) == ["question"]


@pytest.mark.parametrize("value", [[SystemMessage("no question here")], 42, [1, 2]])
def test_inputs_without_a_question_are_named_errors(specrag, ralmspec, value) -> None:
    for runnable in _runnables(specrag, ralmspec):
        with pytest.raises((TypeError, ValueError), match=r"input|human message"):
            runnable.invoke(value)


def test_retrieved_documents_recipe_equals_the_retriever_setting(specrag) -> None:
    given = {"question": RunnablePassthrough(), "documents": LCRetriever(adapter_ranked)} | \
        SpeculativeRAGRunnable(engine=specrag, with_details=True)
    built_in = SpeculativeRAGRunnable(retriever=LCRetriever(adapter_ranked), engine=specrag,
                                      with_details=True)
    a, b = given.invoke(QUESTION), built_in.invoke(QUESTION)
    assert [d.id for d in a["documents"]] == [d.id for d in b["documents"]] == [
        d.id for d in adapter_ranked(QUESTION)]
    assert (a["answer"], a["scores"], a["best"]) == (b["answer"], b["scores"], b["best"])


# ----------------------------------------------------------------------------- prompt=

PROMPT_TEXT = "Passages:\n{documents}\n\nAnswer {{briefly}}: {question}"
EXPECTED = (("user", PROMPT_TEXT),)
PLAIN_TEXT = "Passages:\n{documents}\n\nAnswer briefly: {question}"  # LlamaIndex reads {{x}} as x
CHAT_EXPECTED = (("system", "Use only the passages."), ("user", "{documents}\n\nQ: {question}"))


def _lc_chat() -> ChatPromptTemplate:
    return ChatPromptTemplate.from_messages([("system", "Use only the passages."),
                                             ("human", "{documents}\n\nQ: {question}")])


def _li_chat() -> LIChatPromptTemplate:
    return LIChatPromptTemplate(message_templates=[
        ChatMessage(role="system", content="Use only the passages."),
        ChatMessage(role="user", content="{documents}\n\nQ: {question}")])


def _adapters(specrag: SpeculativeRAG, ralmspec: RaLMSpec, prompt: object, framework: str) -> list:
    if framework == "langchain":
        return [SpeculativeRAGRunnable(engine=specrag, prompt=prompt),
                RaLMSpecRunnable(engine=ralmspec, prompt=prompt)]
    return [SpeculativeRAGQueryEngine(LIRetriever(adapter_ranked), engine=specrag, prompt=prompt),
            RaLMSpecQueryEngine(engine=ralmspec, prompt=prompt)]


@pytest.mark.parametrize(("framework", "prompt", "expected"), [
    ("langchain", PROMPT_TEXT, EXPECTED), ("llamaindex", PROMPT_TEXT, EXPECTED),
    ("langchain", LCPromptTemplate.from_template(PROMPT_TEXT), EXPECTED),
    ("llamaindex", LIPromptTemplate(PLAIN_TEXT), (("user", PLAIN_TEXT),)),
    ("langchain", LCPromptTemplate.from_template(
        "Passages:\n{{ documents }}\n\nAnswer {briefly}: {{ question }}",
        template_format="jinja2"), EXPECTED),
    ("langchain", _lc_chat(), CHAT_EXPECTED), ("llamaindex", _li_chat(), CHAT_EXPECTED),
])
def test_prompt_templates_reach_the_engine_as_the_same_messages(specrag, ralmspec, framework,
                                                                  prompt, expected) -> None:
    for adapter in _adapters(specrag, ralmspec, prompt, framework):
        assert adapter._engine().config.prompt == expected
        assert adapter.prompt is prompt  # the adapter shows what was passed


def test_llamaindex_prompt_mixin_shows_and_sets_the_prompt(specrag, ralmspec) -> None:
    """``get_prompts`` / ``update_prompts`` (LlamaIndex's prompt mixin) read and set ``prompt``,
    checked as at construction; a refused template leaves the setting as it was."""
    for engine in _adapters(specrag, ralmspec, None, "llamaindex"):
        assert engine.get_prompts() == {}  # the engine's built-in prompt
        engine.update_prompts({"prompt": _li_chat()})
        assert engine._engine().config.prompt == CHAT_EXPECTED
        assert engine.get_prompts() == {"prompt": engine.prompt}
        with pytest.raises(ValueError, match="prompt"):
            engine.update_prompts({"prompt": LIPromptTemplate("Question: {question}")})
        assert engine._engine().config.prompt == CHAT_EXPECTED
    [pairs] = _adapters(specrag, ralmspec, CHAT_EXPECTED, "llamaindex")[1].get_prompts().values()
    assert isinstance(pairs, LIChatPromptTemplate)
    assert [(m.role.value, m.content) for m in pairs.message_templates] == list(CHAT_EXPECTED)


@pytest.mark.parametrize("framework", ["langchain", "llamaindex"])
@pytest.mark.parametrize(("prompt", "error"), [
    ("Question: {question}", ValueError), ("{documents} {question} {extra}", ValueError),
    ("{documents} {documents} {question}", ValueError), ("{documents {question}", ValueError),
    (42, TypeError), ((("robot", "{documents} {question}"),), ValueError),
])
def test_a_bad_prompt_fails_at_construction_naming_prompt(specrag, ralmspec, framework, prompt,
                                                          error) -> None:
    makers = [lambda p: _adapters(specrag, ralmspec, p, framework)[0],
              lambda p: _adapters(specrag, ralmspec, p, framework)[1]]
    for make in makers:
        with pytest.raises(error, match="prompt"):
            make(prompt)


@pytest.mark.parametrize("template", [
    LCPromptTemplate.from_template("Only {question}"),
    LCPromptTemplate.from_template("{documents} {question} {tone}"),
    LIPromptTemplate("Only {question}"),
])
def test_a_template_with_other_variables_is_refused(specrag, template) -> None:
    framework = "langchain" if isinstance(template, LCPromptTemplate) else "llamaindex"
    with pytest.raises(ValueError, match="prompt must take exactly the input variables"):
        _adapters(specrag, None, template, framework)[0]


def test_a_changed_prompt_rebuilds_the_engine_sharing_its_models(specrag) -> None:
    runnable = SpeculativeRAGRunnable(engine=specrag)
    before = runnable._engine()
    assert before.config.prompt is None
    runnable.prompt = PROMPT_TEXT
    after = runnable._engine()
    assert after is not before and after.config.prompt == EXPECTED
    assert after.drafter is specrag.drafter and runnable._engine() is after  # built once


# ----------------------------------------------------------------------------- streaming


@pytest.mark.parametrize(("text", "chunks"), [
    ("Paris is the capital", ["Paris ", "is ", "the ", "capital"]), ("", []),
    ("  two\nlines ", ["  ", "two\n", "lines "]), ("one", ["one"])])
def test_answer_chunks_join_to_the_answer(text, chunks) -> None:
    assert answer_chunks(text) == chunks and "".join(chunks) == text


def test_speculative_rag_stream_yields_stages_then_answer_chunks(specrag) -> None:
    runnable = SpeculativeRAGRunnable(retriever=LCRetriever(adapter_ranked), engine=specrag,
                                      with_details=True)
    full = runnable.invoke(QUESTION)
    chunks = list(runnable.stream(QUESTION))
    assert [next(iter(c)) for c in chunks[:4]] == EVENTS  # one stage per chunk, in order
    assert chunks[1]["specrag_subsets"]["subsets"] == [list(d["doc_indices"])
                                                       for d in full["drafts"]]
    assert chunks[3]["specrag_verified"] == {"scores": full["scores"], "best": full["best"]}
    answers = [c["answer"] for c in chunks[5:]]
    assert answers == (answer_chunks(full["answer"]) or [""])
    total = chunks[0]
    for chunk in chunks[1:]:
        total = total + chunk
    for key in ("answer", "rationale", "best", "drafts", "scores"):
        assert total[key] == full[key], key
    assert [d.id for d in total["documents"]] == [d.id for d in full["documents"]]

    plain = SpeculativeRAGRunnable(retriever=LCRetriever(adapter_ranked), engine=specrag)
    pieces = list(plain.stream(QUESTION))
    assert all(isinstance(p, str) for p in pieces) and "".join(pieces) == full["answer"]


async def test_speculative_rag_astream_and_its_events(specrag) -> None:
    runnable = SpeculativeRAGRunnable(retriever=LCRetriever(adapter_ranked), engine=specrag)
    answer = await runnable.ainvoke(QUESTION)
    assert "".join([c async for c in runnable.astream(QUESTION)]) == answer
    names = [e["name"] async for e in runnable.astream_events(QUESTION, version="v2")
             if e["event"] == "on_custom_event"]
    assert names == EVENTS
    detailed = SpeculativeRAGRunnable(retriever=LCRetriever(adapter_ranked), engine=specrag,
                                      with_details=True)
    chunks = [c async for c in detailed.astream(QUESTION)]
    assert [next(iter(c)) for c in chunks[:4]] == EVENTS
    assert "".join(c["answer"] for c in chunks if "answer" in c) == answer


def test_speculative_rag_stream_error_reaches_the_consumer(specrag) -> None:
    runnable = SpeculativeRAGRunnable(engine=specrag)
    with pytest.raises(ValueError, match="documents: all 1 documents have empty text"):
        list(runnable.stream({"question": QUESTION, "documents": ["   "]}))
    assert runnable.invoke({"question": QUESTION, "documents": [d.text for d in DOCS]})


async def test_llamaindex_speculative_rag_streaming_response(specrag) -> None:
    plain = SpeculativeRAGQueryEngine(LIRetriever(adapter_ranked), engine=specrag).query(QUESTION)
    engine = SpeculativeRAGQueryEngine(LIRetriever(adapter_ranked), engine=specrag, streaming=True)
    response = engine.query(QUESTION)
    assert isinstance(response, StreamingResponse)
    assert [n.node.node_id for n in response.source_nodes] == [
        n.node.node_id for n in plain.source_nodes]
    pieces = list(response.response_gen)
    assert "".join(pieces) == str(plain) and pieces == (answer_chunks(str(plain)) or [""])
    assert response.metadata["scores"] == plain.metadata["scores"]
    assert response.metadata["best"] == plain.metadata["best"]
    streamed = await engine.aquery(QUESTION)
    assert isinstance(streamed, AsyncStreamingResponse)
    assert "".join([t async for t in streamed.async_response_gen()]) == str(plain)
    assert streamed.metadata["scores"] == plain.metadata["scores"]


async def test_ralmspec_query_engine_streams_verified_deltas(ralmspec) -> None:
    plain = RaLMSpecQueryEngine(engine=ralmspec, max_new_tokens=16).query(QUESTION)
    engine = RaLMSpecQueryEngine(engine=ralmspec, max_new_tokens=16, streaming=True)
    response = engine.query(QUESTION)
    assert isinstance(response, StreamingResponse) and response.metadata is None
    deltas = list(response.response_gen)
    assert len(deltas) > 1 and "".join(deltas) == plain.response
    assert response.metadata["token_ids"] == plain.metadata["token_ids"]
    assert response.metadata["doc_ids"] == plain.metadata["doc_ids"]
    assert [n.node.node_id for n in response.source_nodes] == [
        n.node.node_id for n in plain.source_nodes]
    streamed = await engine.aquery(QUESTION)
    assert isinstance(streamed, AsyncStreamingResponse)
    assert "".join([t async for t in streamed.async_response_gen()]) == plain.response
    assert streamed.metadata["doc_ids"] == plain.metadata["doc_ids"]


def test_streaming_must_be_a_bool(specrag) -> None:
    # issue 27: both query engines are pydantic now and refuse it the same way (was TypeError)
    with pytest.raises(ValueError, match="streaming"):
        SpeculativeRAGQueryEngine(LIRetriever(adapter_ranked), engine=specrag, streaming="yes")
    with pytest.raises(ValueError, match="streaming"):
        RaLMSpecQueryEngine(streaming="yes")


def test_the_engine_drafts_with_the_prompt_setting(specrag) -> None:
    """The drafter sees the caller's turns (format line appended, same prefill), not the default."""
    from shared_core.engines.speculative_rag.prompts import DRAFT_FORMAT, draft_prompt

    runnable = SpeculativeRAGRunnable(engine=specrag, prompt=_lc_chat(), with_details=True)
    docs = [d.text for d in DOCS]
    custom = runnable.invoke({"question": QUESTION, "documents": docs})
    default = SpeculativeRAGRunnable(engine=specrag, with_details=True).invoke(
        {"question": QUESTION, "documents": docs})
    lm = specrag.drafter
    rendered = draft_prompt(lm, QUESTION, DOCS[:2], "rationale_first", prompt=CHAT_EXPECTED)
    expected = lm.chat_prompt([
        {"role": "system", "content": "Use only the passages."},
        {"role": "user", "content": "Document [1]: Paris is the capital of France.\n"
                                    "Document [2]: Berlin is the capital of Germany.\n\n"
                                    f"Q: {QUESTION}\n\n{DRAFT_FORMAT}"}]) + "Rationale:"
    assert rendered == lm.encode(expected)
    subsets = [d["doc_indices"] for d in custom["drafts"]]
    assert custom["stats"]["draft_prompt_tokens"] == sum(
        len(draft_prompt(lm, QUESTION, [DOCS[i] for i in s], specrag.config.draft_order,
                         prompt=CHAT_EXPECTED))
        for s in subsets)
    assert custom["stats"]["draft_prompt_tokens"] != default["stats"]["draft_prompt_tokens"]


def test_ralmspec_answers_with_the_prompt_setting(ralmspec) -> None:
    """The default's own text as a prompt gives the same tokens; another prompt changes the
    prompt and stays identical to RaLMSeq under it (both frameworks)."""
    from shared_core.config.rag import DEFAULT_INSTRUCTION

    as_default = DEFAULT_INSTRUCTION + "\n\nPassage: {documents}\n\nQuestion: {question}"
    other = LCPromptTemplate.from_template("Q: {question}\nUse: {documents}")
    default = RaLMSpecRunnable(engine=ralmspec, max_new_tokens=12, with_details=True)
    same = RaLMSpecRunnable(engine=ralmspec, max_new_tokens=12, with_details=True,
                            prompt=as_default)
    assert same.invoke(QUESTION)["token_ids"] == default.invoke(QUESTION)["token_ids"]
    custom = RaLMSpecRunnable(engine=ralmspec, max_new_tokens=12, with_details=True,
                              prompt=other).invoke(QUESTION)
    assert custom["stats"]["prompt_tokens"] != default.invoke(QUESTION)["stats"]["prompt_tokens"]
    baseline = RaLMSpec(ralmspec.lm, adapter_index(), replace(
        ralmspec.config, prompt="Q: {question}\nUse: {documents}")).generate_baseline(QUESTION, 12)
    assert custom["token_ids"] == baseline.token_ids
    engine = RaLMSpecQueryEngine(engine=ralmspec, max_new_tokens=12,
                                 prompt=LIPromptTemplate("Q: {question}\nUse: {documents}"))
    assert engine.query(QUESTION).metadata["token_ids"] == baseline.token_ids
