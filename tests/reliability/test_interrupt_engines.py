"""Interrupted calls leave every engine consistent (issue 19 row 3), on the tiny in-process models.

A forward hook on a model's first decoder layer raises on the N-th forward of a call, after that
layer has appended its keys/values and before the others do: exactly the state that used to
leave the KV layers at different lengths. N = 1 is the prefill; larger N land in drafting or verification.
Then the same engine object must answer the next call with the reference output. The signal
tests raise ``KeyboardInterrupt`` through the real SIGINT / SIGALRM machinery.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from fakes import HashEmbedder
from interrupts import alarm_interrupt
from tiny import CORPUS

from langchain_specrag.chat_models.speculative import ChatSpeculative
from shared_core.engines.baseline import (
    autoregressive_generate,
    speculative_generate,
    stream_autoregressive,
)
from shared_core.engines.rapid import RapidConfig, RapidDecoder
from shared_core.engines.respec import ReSpecConfig, ReSpecDecoder
from shared_core.runtime.torch.session import KVSession

CONTEXT = " ".join(CORPUS[:8])
QUERY = "Who wrote the report?"
PROMPT = "Paris is the capital of France. Berlin is the capital of"
DOCS = ["Paris is the capital of France. Berlin is the capital of Germany."]
N_NEW = 24
AT_FORWARD = [1, 2, 3, 5, 8, 13]



class Boom(RuntimeError):
    pass


@contextmanager
def fail_on_forward(lm, n: int, error: type[BaseException] | Callable[[], None]) -> Iterator[None]:
    """Raise ``error`` (or call it) when the model's 1st layer ends its ``n``-th forward."""
    calls = 0

    def hook(module: Any, args: Any, output: Any) -> None:
        nonlocal calls
        calls += 1
        if calls == n:
            if isinstance(error, type):
                raise error("injected")
            error()

    handle = lm.model.model.layers[0].register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def assert_consistent(session: KVSession) -> None:
    """Every cache layer holds exactly the session's tokens (an empty session: none, or no
    layers yet)."""
    lengths = {layer.get_seq_length() for layer in session.cache.layers}
    want = {len(session.tokens)} if session.tokens else {0}
    assert lengths == want or not (lengths or session.tokens), (lengths, len(session.tokens))


def rapid_sessions(decoder: RapidDecoder) -> list[KVSession]:
    slots = [*decoder._idle, *decoder._busy]
    return [s for slot in slots
            for s in (slot.target, slot.rag, slot.drafter.session, slot.shared.session)]


def rapid_decoder(tiny_target, draft_lm=None, **config: Any) -> RapidDecoder:
    cfg = RapidConfig(chunk_tokens=32, min_rag_tokens=64, gamma=4, eta=0.0, **config)
    return RapidDecoder(tiny_target, draft_lm=draft_lm, embedder=HashEmbedder(), config=cfg)


@pytest.fixture(scope="module")
def rapid_reference(tiny_target) -> dict[str, list[int]]:
    fresh = rapid_decoder(tiny_target)
    prompt = fresh.prepare(CONTEXT, QUERY, N_NEW)
    return {"long": autoregressive_generate(tiny_target, list(prompt.target_ids), N_NEW).token_ids,
            "rag": autoregressive_generate(tiny_target, list(prompt.rag_ids), N_NEW).token_ids}


# ---------------------------------------------------------------------------- RAPID


@pytest.mark.parametrize("error", [KeyboardInterrupt, Boom])
@pytest.mark.parametrize("at", AT_FORWARD)
@pytest.mark.parametrize("variant", ["self", "weak", "shared_kv"])
def test_rapid_interrupted_then_next_call_equals_reference(tiny_target, tiny_drafter,
                                                            rapid_reference, variant, at, error):
    decoder = (rapid_decoder(tiny_target, tiny_drafter) if variant == "weak"
               else rapid_decoder(tiny_target, drafter_kv="target" if variant == "shared_kv"
                                  else "own"))
    if at > 3:
        decoder.generate(CONTEXT, QUERY, N_NEW)  # warm: the interruption hits a reused prefix
    with fail_on_forward(tiny_target, at, error), pytest.raises(error):
        decoder.generate(CONTEXT, QUERY, N_NEW)
    for session in rapid_sessions(decoder):
        assert_consistent(session)
    for method in ("rapid", "long_context", "sd"):
        assert decoder.generate(CONTEXT, QUERY, N_NEW, method=method).token_ids == \
            rapid_reference["long"]
    assert decoder.generate(CONTEXT, QUERY, N_NEW, method="rag").token_ids == \
        rapid_reference["rag"]


@pytest.mark.parametrize("at", [1, 4])
def test_rapid_interrupted_in_the_drafter_then_exact(tiny_target, tiny_drafter, rapid_reference,
                                                     at):
    decoder = rapid_decoder(tiny_target, tiny_drafter)
    with fail_on_forward(tiny_drafter, at, KeyboardInterrupt), pytest.raises(KeyboardInterrupt):
        decoder.generate(CONTEXT, QUERY, N_NEW)
    for session in rapid_sessions(decoder):
        assert_consistent(session)
    assert decoder.generate(CONTEXT, QUERY, N_NEW).token_ids == rapid_reference["long"]


def test_rapid_interrupted_stream_reports_failure_not_truncation(tiny_target, rapid_reference):
    decoder = rapid_decoder(tiny_target)
    stream = decoder.stream(CONTEXT, QUERY, N_NEW)
    next(stream)
    with fail_on_forward(tiny_target, 1, Boom), pytest.raises(Boom):
        list(stream)
    with pytest.raises(RuntimeError, match="failed earlier"):
        next(stream)
    assert stream.result is None
    assert decoder.generate(CONTEXT, QUERY, N_NEW).token_ids == rapid_reference["long"]
    assert len(decoder._busy) == 0  # the failed generation returned its slot


def test_load_context_interrupted_in_prefill(tiny_target, rapid_reference):
    decoder = rapid_decoder(tiny_target)
    with fail_on_forward(tiny_target, 1, KeyboardInterrupt), pytest.raises(KeyboardInterrupt):
        decoder.load_context(CONTEXT)
    for session in rapid_sessions(decoder):
        assert_consistent(session)
    assert decoder.generate(CONTEXT, QUERY, N_NEW).token_ids == rapid_reference["long"]


def test_chat_rapid_engine_interrupted_then_exact(tiny_target, rapid_reference):
    chat = ChatSpeculative(lm=tiny_target, model="tiny", engine="rapid", max_tokens=N_NEW,
                           documents=[CONTEXT],
                           engine_options={"embedder": HashEmbedder(), "chunk_tokens": 32,
                                           "min_rag_tokens": 64, "eta": 0.0, "gamma": 4})
    reference = chat.invoke(QUERY).content
    for at in (1, 6):
        with fail_on_forward(tiny_target, at, KeyboardInterrupt), \
                pytest.raises(KeyboardInterrupt):
            chat.invoke(QUERY)
        assert not chat._model()[1].locked()
        assert chat.invoke(QUERY).content == reference
    assert chat.invoke(QUERY).response_metadata["speculative_stats"]["new_tokens"] == \
        len(rapid_reference["long"])


# ---------------------------------------------------------------------------- ReSpec, baselines


@pytest.mark.parametrize("error", [KeyboardInterrupt, Boom])
@pytest.mark.parametrize("at", AT_FORWARD)
def test_respec_interrupted_then_next_call_equals_reference(tiny_target, tiny_drafter, at, error):
    reference = autoregressive_generate(tiny_target, PROMPT, N_NEW).token_ids
    decoders = [ReSpecDecoder(tiny_target, ReSpecConfig(use_trigger=False)),
                ReSpecDecoder(tiny_target, draft_lm=tiny_drafter)]
    for decoder in decoders:
        with fail_on_forward(tiny_target, at, error), pytest.raises(error):
            decoder.generate(PROMPT, N_NEW, documents=DOCS)
        assert decoder.generate(PROMPT, N_NEW, documents=DOCS).token_ids == reference


@pytest.mark.parametrize("error", [KeyboardInterrupt, Boom])
@pytest.mark.parametrize("at", AT_FORWARD)
def test_baselines_interrupted_then_next_call_equals_reference(tiny_target, tiny_drafter, at,
                                                               error):
    reference = autoregressive_generate(tiny_target, PROMPT, N_NEW).token_ids
    with fail_on_forward(tiny_target, at, error), pytest.raises(error):
        autoregressive_generate(tiny_target, PROMPT, N_NEW)
    assert autoregressive_generate(tiny_target, PROMPT, N_NEW).token_ids == reference
    with fail_on_forward(tiny_target, at, error), pytest.raises(error):
        speculative_generate(tiny_target, tiny_drafter, PROMPT, N_NEW, k=3)
    assert speculative_generate(tiny_target, tiny_drafter, PROMPT, N_NEW, k=3).token_ids == \
        reference


@pytest.mark.parametrize("cache", ["prealloc", "dynamic"])
@pytest.mark.parametrize("at", [1, 3])
def test_kv_session_heals_an_interrupted_forward(tiny_target, at, cache):
    session = KVSession(tiny_target, cache=cache)
    ids = tiny_target.encode(PROMPT)
    session.prefill(ids[:4])
    with fail_on_forward(tiny_target, at, KeyboardInterrupt), pytest.raises(KeyboardInterrupt):
        session.prefill(ids[4:6])
        session.extend(ids[6:9])
        session.extend(ids[9:10])
    assert_consistent(session)
    assert session.tokens == ids[: len(session.tokens)]
    session.prefill(ids[len(session.tokens) : -1])
    fresh = KVSession(tiny_target)
    fresh.prefill(ids[:-1])
    assert torch.allclose(session.extend([ids[-1]]), fresh.extend([ids[-1]]), atol=1e-5)


# ---------------------------------------------------------------------------- real signals


@pytest.fixture
def default_sigint() -> Iterator[None]:
    """Python's own SIGINT handler (KeyboardInterrupt) for the test. A process started as a
    background job of a non-interactive shell (``make test &``) inherits SIGINT ignored, and
    Python then installs no handler: ``raise_signal(SIGINT)`` would do nothing."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_sigint_during_a_forward_is_a_keyboard_interrupt_and_heals(tiny_target, rapid_reference,
                                                                   default_sigint):
    """SIGINT delivered to this (main) thread in the middle of a forward."""
    assert threading.current_thread() is threading.main_thread()
    decoder = rapid_decoder(tiny_target)
    for at in (1, 7):
        with fail_on_forward(tiny_target, at, lambda: signal.raise_signal(signal.SIGINT)), \
                pytest.raises(KeyboardInterrupt):
            decoder.generate(CONTEXT, QUERY, N_NEW)
        for session in rapid_sessions(decoder):
            assert_consistent(session)
        assert decoder.generate(CONTEXT, QUERY, N_NEW).token_ids == rapid_reference["long"]


@pytest.fixture
def own_target() -> Any:
    """A model of this test's own, built as ``tiny_target`` is (same weights, same outputs), so
    that whatever an interrupt at an arbitrary point could leave behind stays off the session's
    shared model (the model lock is tested against one at every point in test_fair_lock.py)."""
    from tiny import tiny_lm

    return tiny_lm(num_layers=2, seed=0)


@pytest.mark.parametrize("engine", ["rapid", "respec", "autoregressive"])
def test_timer_interrupts_at_arbitrary_points_never_poison_the_engine(own_target,
                                                                      rapid_reference, engine):
    tiny_target = own_target
    decoder = rapid_decoder(tiny_target)
    respec = ReSpecDecoder(tiny_target)
    if engine == "rapid":
        def call() -> list[int]:
            return decoder.generate(CONTEXT, QUERY, N_NEW).token_ids
        reference = rapid_reference["long"]
    elif engine == "respec":
        def call() -> list[int]:
            return respec.generate(PROMPT, N_NEW, documents=DOCS).token_ids
        reference = autoregressive_generate(tiny_target, PROMPT, N_NEW).token_ids
    else:
        def call() -> list[int]:
            return stream_autoregressive(tiny_target, PROMPT, N_NEW).run().token_ids
        reference = autoregressive_generate(tiny_target, PROMPT, N_NEW).token_ids
    interrupted = checked = 0
    for delay in (0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032):
        try:
            with alarm_interrupt(delay):
                call()
        except KeyboardInterrupt:
            interrupted += 1
        if engine == "rapid":  # the one engine here that keeps sessions between calls
            for session in rapid_sessions(decoder):
                assert_consistent(session)
                checked += bool(session.tokens)
        assert call() == reference  # nothing kept (sessions, caches, drafters) was poisoned
    assert interrupted >= 3  # most delays land inside the call
    assert checked > 0 or engine != "rapid"
