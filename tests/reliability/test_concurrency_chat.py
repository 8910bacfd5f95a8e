"""16 callers on one instance = 16 sequential calls (issue 19 rows 1, 4), on the tiny models.

Covers one ``ChatSpeculative`` (ReSpec, autoregressive, RAPID), one ``SpeculativeLLM``, one
``RapidDecoder`` (``generate`` and interleaved streams), one ``ReSpecDecoder`` and the plain
engines, with threads and with ``abatch`` / ``asyncio.gather``. Workers are daemon threads
joined with a deadline, so a deadlock fails the test instead of hanging it. Also: the FIFO lock
itself, and models passed as ``lm=`` are freed after ``del`` (row 18).
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from fakes import HashEmbedder
from llama_index.core.base.llms.types import ChatMessage, MessageRole
from tiny import CORPUS, tiny_lm

from langchain_specrag.chat_models.speculative import ChatSpeculative
from llamaindex_specrag.llms.speculative import SpeculativeLLM
from shared_core.engines.baseline import autoregressive_generate, speculative_generate
from shared_core.engines.rapid import RapidConfig, RapidDecoder
from shared_core.engines.respec import ReSpecDecoder
from shared_core.frontend import serving
from shared_core.runtime import model_cache, model_lock

N = 16
CONTEXT = " ".join(CORPUS[:8])
QUESTIONS = ["Who wrote the report?", "What is the capital of France?", "Who is lazy?",
             "What does a suffix automaton find?"]
PROMPTS = ["0 1 2 3 4 5 6 7", "Paris is the capital of", "The quick brown fox", "hello there"]



def run_threads(fn: Callable[[int], Any], n: int = N, deadline_s: float = 120) -> list[Any]:
    """``fn(i)`` on ``n`` daemon threads started together; results by index, errors re-raised."""
    results: list[Any] = [None] * n
    errors: list[BaseException] = []
    barrier = threading.Barrier(n)

    def work(i: int) -> None:
        try:
            barrier.wait(30)
            results[i] = fn(i)
        except BaseException as e:  # collected and re-raised below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    end = time.perf_counter() + deadline_s
    for t in threads:
        t.join(max(0.0, end - time.perf_counter()))
    assert not any(t.is_alive() for t in threads), f"deadlock: threads alive after {deadline_s} s"
    if errors:
        raise errors[0]
    return results


def rapid_config(**kw: Any) -> RapidConfig:
    return RapidConfig(chunk_tokens=32, min_rag_tokens=64, gamma=4, eta=0.0, **kw)


# ---------------------------------------------------------------------------- adapters


@pytest.mark.parametrize("engine", ["respec", "autoregressive", "rapid"])
def test_chat_16_threads_invoke_and_stream_equal_sequential(tiny_target, engine):
    options: dict[str, Any] = {"use_trigger": False} if engine == "respec" else {}
    if engine == "rapid":
        options = {"embedder": HashEmbedder(), "chunk_tokens": 32, "min_rag_tokens": 64,
                   "eta": 0.0, "gamma": 4}
    chat = ChatSpeculative(lm=tiny_target, model="tiny", engine=engine, max_tokens=12,
                           engine_options=options,
                           documents=[CONTEXT] if engine == "rapid" else None)
    prompts = QUESTIONS if engine == "rapid" else PROMPTS
    sequential = [chat.invoke(p).content for p in prompts]

    def call(i: int) -> str:
        prompt = prompts[i % len(prompts)]
        if i % 2:
            return "".join(str(c.content) for c in chat.stream(prompt))
        return chat.invoke(prompt).content

    assert run_threads(call) == [sequential[i % len(prompts)] for i in range(N)]
    if engine == "rapid":
        (decoder,) = chat._engine_state["rapid_decoders"].values()
        assert not decoder._busy and len(decoder._idle) == decoder.max_idle_slots


async def test_chat_abatch_and_gather_of_16_equal_sequential(tiny_target):
    chat = ChatSpeculative(lm=tiny_target, model="tiny", max_tokens=12,
                           engine_options={"use_trigger": False})
    inputs = [PROMPTS[i % len(PROMPTS)] for i in range(N)]
    sequential = [chat.invoke(p).content for p in inputs]
    batched = await asyncio.wait_for(chat.abatch(inputs), 120)
    assert [m.content for m in batched] == sequential

    async def streamed(prompt: str) -> str:
        return "".join([str(c.content) async for c in chat.astream(prompt)])

    gathered = await asyncio.wait_for(asyncio.gather(*(streamed(p) for p in inputs)), 120)
    assert list(gathered) == sequential
    assert [m.content for m in chat.batch(inputs, config={"max_concurrency": N})] == sequential


def test_llamaindex_16_threads_equal_sequential(tiny_target):
    llm = SpeculativeLLM(lm=tiny_target, model="tiny", max_new_tokens=12,
                         engine_options={"use_trigger": False})
    sequential = [llm.complete(p).text for p in PROMPTS]

    def call(i: int) -> str:
        prompt = PROMPTS[i % len(PROMPTS)]
        if i % 3 == 0:
            return llm.complete(prompt).text
        if i % 3 == 1:
            return list(llm.stream_complete(prompt))[-1].text
        messages = [ChatMessage(role=MessageRole.USER, content=prompt)]
        return list(llm.stream_chat(messages))[-1].message.content

    assert run_threads(call) == [sequential[i % len(PROMPTS)] for i in range(N)]


async def test_llamaindex_gather_of_16_equal_sequential(tiny_target):
    llm = SpeculativeLLM(lm=tiny_target, model="tiny", max_new_tokens=12)
    inputs = [PROMPTS[i % len(PROMPTS)] for i in range(N)]
    sequential = [llm.complete(p).text for p in inputs]
    done = await asyncio.wait_for(asyncio.gather(*(llm.acomplete(p) for p in inputs)), 120)
    assert [r.text for r in done] == sequential


# ---------------------------------------------------------------------------- engines


@pytest.mark.parametrize("variant", ["self", "weak", "shared_kv"])
def test_rapid_decoder_16_threads_equal_sequential(tiny_target, tiny_drafter, variant):
    """Row 4: used to fail 7/8 with 'generator already executing' and stay broken."""
    decoder = RapidDecoder(tiny_target, draft_lm=tiny_drafter if variant == "weak" else None,
                           embedder=HashEmbedder(),
                           config=rapid_config(drafter_kv="target" if variant == "shared_kv"
                                               else "own"))
    methods = ["rapid", "long_context", "rag", "sd"]
    sequential = {(q, m): decoder.generate(CONTEXT, q, 12, method=m).token_ids
                  for q in QUESTIONS for m in methods}

    def call(i: int) -> list[int]:
        key = (QUESTIONS[i % 4], methods[(i // 4) % 4])
        if i % 2:
            stream = decoder.stream(CONTEXT, key[0], 12, method=key[1])
            "".join(stream)
            assert stream.result is not None
            return stream.result.token_ids
        return decoder.generate(CONTEXT, key[0], 12, method=key[1]).token_ids

    expected = [sequential[(QUESTIONS[i % 4], methods[(i // 4) % 4])] for i in range(N)]
    assert run_threads(call) == expected
    assert not decoder._busy
    assert decoder.generate(CONTEXT, QUESTIONS[0], 12).token_ids == sequential[(QUESTIONS[0],
                                                                                 "rapid")]


def test_rapid_eight_interleaved_streams_in_one_thread(tiny_target):
    decoder = RapidDecoder(tiny_target, embedder=HashEmbedder(), config=rapid_config())
    queries = [QUESTIONS[i % 4] for i in range(8)]
    sequential = [decoder.generate(CONTEXT, q, 12).token_ids for q in queries]
    streams = [decoder.stream(CONTEXT, q, 12) for q in queries]
    live = list(range(len(streams)))
    while live:
        for i in list(live):
            try:
                next(streams[i])
            except StopIteration:
                live.remove(i)
    assert [s.result.token_ids for s in streams] == sequential
    assert not decoder._busy and len(decoder._idle) == decoder.max_idle_slots


def test_respec_decoder_16_threads_equal_sequential(tiny_target, tiny_drafter):
    decoders = {"prompt_lookup": ReSpecDecoder(tiny_target),
                "model": ReSpecDecoder(tiny_target, draft_lm=tiny_drafter)}
    docs = [CORPUS[3]]
    reference = {p: autoregressive_generate(tiny_target, p, 16).token_ids for p in PROMPTS}

    def call(i: int) -> list[int]:
        decoder = decoders["model" if i % 2 else "prompt_lookup"]
        return decoder.generate(PROMPTS[i % 4], 16, documents=docs).token_ids

    assert run_threads(call) == [reference[PROMPTS[i % 4]] for i in range(N)]


def test_plain_engines_16_threads_on_one_model(tiny_target, tiny_drafter):
    reference = {p: autoregressive_generate(tiny_target, p, 16).token_ids for p in PROMPTS}

    def call(i: int) -> list[int]:
        prompt = PROMPTS[i % 4]
        if i % 2:
            return speculative_generate(tiny_target, tiny_drafter, prompt, 16, k=3).token_ids
        return autoregressive_generate(tiny_target, prompt, 16).token_ids

    assert run_threads(call) == [reference[PROMPTS[i % 4]] for i in range(N)]


# ---------------------------------------------------------------------------- model lifetime


@pytest.mark.parametrize("engine", ["respec", "rapid"])
def test_models_passed_as_lm_are_freed_after_del(engine):
    """Row 18: ``serving.lock_for`` (and RAPID's decoder cache) no longer pin the model."""
    refs = []
    for seed in range(3):
        lm = tiny_lm(num_layers=1, seed=seed)
        options = ({"embedder": HashEmbedder(), "chunk_tokens": 32, "min_rag_tokens": 64,
                    "eta": 0.0} if engine == "rapid" else {})
        chat = ChatSpeculative(lm=lm, model="tiny", engine=engine, max_tokens=4,
                               engine_options=options,
                               documents=[CONTEXT] if engine == "rapid" else None)
        llm = SpeculativeLLM(lm=lm, model="tiny", max_new_tokens=4)
        chat.invoke("Who wrote the report?")
        list(chat.stream("Who wrote the report?"))
        llm.complete("hello")
        refs.append(weakref.ref(lm))
        del lm, chat, llm
    gc.collect()
    assert [r() for r in refs] == [None, None, None]
    assert all(ref() is not None for ref, _ in model_lock._INSTANCE_LOCKS.values())  # no stale entry


@pytest.mark.parametrize("engine", ["respec", "rapid"])
def test_an_adapter_pins_no_released_model(tiny_model_folder, engine):
    """``serving.release`` frees a model an adapter named even while the adapter lives: its
    kept decoders let go of it (before: the ReSpec decoder kept it, and after the next call two
    copies were alive)."""
    options = ({"embedder": HashEmbedder(), "chunk_tokens": 32, "min_rag_tokens": 64,
                "eta": 0.0} if engine == "rapid" else {})
    chat = ChatSpeculative(model=tiny_model_folder, backend="torch", engine=engine,
                           max_tokens=4, engine_options=options,
                           documents=[CONTEXT] if engine == "rapid" else None)
    chat.invoke("Who wrote the report?")
    first = weakref.ref(serving.loaded_model(tiny_model_folder, backend="torch")[0])
    assert serving.release(tiny_model_folder)
    chat.invoke("Who wrote the report?")  # loads it again, and drops the decoder of the first
    gc.collect()
    assert first() is None
    serving.release(tiny_model_folder)


def test_an_adapter_running_on_a_released_model_it_was_given_keeps_its_decoder(monkeypatch):
    """``lm=`` a model the cache has released (its caller kept it): the adapter still runs on
    it, so its kept decoder stays (dropping it every call would rebuild the decoder each time)."""
    lm = tiny_lm(num_layers=1, seed=5)
    monkeypatch.setitem(model_cache._LOADED, ("tiny-released", None, None, "torch"), lm)
    assert serving.release("tiny-released")
    chat = ChatSpeculative(lm=lm, model="tiny", max_tokens=4)
    chat.invoke("Who wrote the report?")
    decoders = list(chat._engine_state["respec_decoders"].values())
    chat.invoke("Who wrote the report?")
    assert list(chat._engine_state["respec_decoders"].values()) == decoders


def test_settings_naming_a_released_model_build_their_engine_once_more(monkeypatch):
    """An adapter's engine built on a model the cache then released is rebuilt once; when the
    rebuild holds the same released model (the settings name it: a prebuilt engine) the first
    is kept, and later calls build nothing (before: a fresh engine per call, thrown away)."""
    from shared_core.frontend.rag import SettingsCache

    lm = tiny_lm(num_layers=1, seed=5)
    monkeypatch.setitem(model_cache._LOADED, ("tiny-released", None, None, "torch"), lm)
    built: list[SimpleNamespace] = []

    def build() -> SimpleNamespace:
        built.append(SimpleNamespace(lm=lm))
        return built[-1]

    cache: SettingsCache[SimpleNamespace] = SettingsCache()
    first = cache.get(("settings",), build)
    assert serving.release("tiny-released")
    assert [cache.get(("settings",), build) for _ in range(3)] == [first] * 3
    assert len(built) == 2
    assert cache.get(("other settings",), build) is built[-1] and len(built) == 3


def test_rag_engines_look_a_released_model_up_again(tiny_model_folder):
    """A Speculative RAG engine (and so its adapters) holds its drafter until
    ``serving.release`` drops it, then loads it again instead of pinning it."""
    from shared_core.engines.speculative_rag import SpeculativeRAG

    engine = SpeculativeRAG(tiny_model_folder, tiny_model_folder, embedder=HashEmbedder(),
                            backend="torch")
    first = engine.drafter
    assert engine.drafter is first
    assert serving.release(tiny_model_folder)
    assert engine.drafter is not first and engine.verifier is engine.drafter
    serving.release(tiny_model_folder)


def test_lock_for_shares_the_cache_lock_and_release_drops_models(tiny_target, monkeypatch):
    monkeypatch.setitem(model_cache._LOADED, ("tiny-cached", None, None, "torch"), tiny_target)
    assert serving.lock_for(tiny_target) is serving.loaded_model("tiny-cached")[1]
    assert serving.release("tiny-cached") is True
    assert serving.release("tiny-cached") is False
    assert serving.lock_for(tiny_target) is serving.lock_for(tiny_target)
    monkeypatch.setitem(model_cache._LOADED, ("a", None, None, "torch"), object())
    monkeypatch.setitem(model_cache._LOADED, ("b", None, None, "torch"), object())
    before = len(model_cache._LOADED)
    assert serving.release_all() == before and not model_cache._LOADED
