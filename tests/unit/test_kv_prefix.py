"""Prefix reuse across calls on torch (kv_prefix): reuse, exactness, budget, clear, failures."""

from __future__ import annotations

import threading

import pytest
import torch
from tiny import CORPUS, tiny_lm

from shared_core.engines.baseline import autoregressive_generate, speculative_generate
from shared_core.engines.respec import respec_generate
from shared_core.runtime.lm import clear_prefix_cache
from shared_core.runtime.torch.prefix import EXACT_CHUNK, MIB, PrefixStore, attach, store_for
from shared_core.runtime.torch.session import KVSession

SYSTEM = " ".join(CORPUS[:8])
QUESTIONS = ("Who wrote the report?", "What is the capital of France?", "Count to twenty.")
N_NEW = 24


def chat(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


@pytest.fixture(scope="module")
def lm():
    return tiny_lm(num_layers=2, seed=0)


@pytest.fixture(params=["prealloc", "dynamic", "static"])
def kind(request) -> str:
    return request.param


def common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def test_a_second_prompt_reuses_the_shared_prefix(lm, kind):
    store = attach(lm.model, 64 * MIB)
    first = autoregressive_generate(lm, chat(QUESTIONS[0]), N_NEW, cache=kind)
    second = autoregressive_generate(lm, chat(QUESTIONS[1]), N_NEW, cache=kind)
    assert first.stats.cached_prompt_tokens == 0
    a, b = lm.prompt_ids(chat(QUESTIONS[0])), lm.prompt_ids(chat(QUESTIONS[1]))
    assert second.stats.cached_prompt_tokens == common(a[:-1], b[:-1]) > 0
    assert len(store) == 2 and 0 < store.nbytes <= store.budget


def test_the_whole_prompt_is_never_reused(lm):
    attach(lm.model, 64 * MIB)
    ids = lm.prompt_ids(chat(QUESTIONS[0]))
    KVSession(lm).prefill(ids)
    again = KVSession(lm)
    assert again.prefill(ids) is not None  # logits of the last id: it was fed again
    assert again.reused_tokens == len(ids) - 1


@pytest.mark.parametrize("engine", ["autoregressive", "speculative", "respec"])
def test_exact_outputs_equal_outputs_without_the_cache(lm, kind, engine):
    def run(question: str) -> list[int]:
        prompt = chat(question)
        if engine == "autoregressive":
            return autoregressive_generate(lm, prompt, N_NEW, cache=kind).token_ids
        if engine == "speculative":
            return speculative_generate(lm, lm, prompt, N_NEW, k=3, cache=kind).token_ids
        return respec_generate(lm, prompt, N_NEW, documents=[SYSTEM], cache=kind).token_ids

    attach(lm.model, 0, exact=True)
    cold = [run(q) for q in QUESTIONS]
    store = attach(lm.model, 64 * MIB, exact=True)
    warm = [run(q) for q in QUESTIONS]
    assert warm == cold
    assert len(store) > 0


def test_exact_logits_are_bit_equal_and_approximate_ones_close(lm, kind):
    ids = lm.encode(SYSTEM)

    def logits(cached: bool, exact: bool) -> tuple[torch.Tensor, torch.Tensor, int]:
        attach(lm.model, 64 * MIB if cached else 0, exact=exact)
        if cached:
            KVSession(lm, cache=kind).prefill([*ids[:150], 7, 8, 9])
        session = KVSession(lm, cache=kind)
        return session.prefill(ids), session.extend(ids[:4]), session.reused_tokens

    cold_last, cold_rows, _ = logits(cached=False, exact=True)
    warm_last, warm_rows, reused = logits(cached=True, exact=True)
    assert reused == 150 // EXACT_CHUNK * EXACT_CHUNK
    assert torch.equal(cold_last, warm_last) and torch.equal(cold_rows, warm_rows)
    cold_last, _, _ = logits(cached=False, exact=False)
    warm_last, _, reused = logits(cached=True, exact=False)
    assert reused == 150
    torch.testing.assert_close(warm_last, cold_last)  # the last bits may differ (docs/backends.md)


def test_the_stored_entry_is_never_written_by_a_session(lm, kind):
    store = attach(lm.model, 64 * MIB)
    ids = lm.encode(SYSTEM)
    KVSession(lm, cache=kind).prefill(ids[:100])
    layers, length = store.lookup(ids, _version(lm))
    before = [(k.clone(), v.clone()) for k, v in layers]
    session = KVSession(lm, cache=kind)
    session.prefill(ids)
    session.rollback(50)
    session.extend(ids[:20])
    assert length == 100
    assert all(torch.equal(k, k0) and torch.equal(v, v0)
               for (k, v), (k0, v0) in zip(layers, before, strict=True))


def _version(lm) -> int:
    from shared_core.runtime.torch.prefix import weights_version

    return weights_version(lm.model)


def test_eviction_keeps_the_budget_least_recently_used_first(lm):
    ids = lm.encode(SYSTEM)
    per_entry = _entry_bytes(lm, 60)
    store = attach(lm.model, 2 * per_entry + per_entry // 2)  # room for two entries
    prompts = [[100 + i, *ids[:59]] for i in range(3)]
    KVSession(lm).prefill(prompts[0])
    KVSession(lm).prefill(prompts[1])
    assert KVSession(lm).prefill(prompts[0] + [5]) is not None  # touches entry 0
    KVSession(lm).prefill(prompts[2])  # evicts entry 1, the least recently used
    assert store.nbytes <= store.budget and len(store) == 2
    assert _reused(lm, prompts[0]) == 60
    assert _reused(lm, prompts[1]) == 0


def _entry_bytes(lm, tokens: int) -> int:
    store = attach(lm.model, 64 * MIB)
    KVSession(lm).prefill(lm.encode(SYSTEM)[:tokens])
    return store.nbytes


def _reused(lm, ids: list[int]) -> int:
    session = KVSession(lm)
    session.prefill([*ids, 1])
    return session.reused_tokens


def test_an_entry_larger_than_the_budget_is_not_kept(lm):
    store = attach(lm.model, 1024)
    KVSession(lm).prefill(lm.encode(SYSTEM))
    assert len(store) == 0 and store.nbytes == 0


def test_clear_prefix_cache_empties_the_store(lm):
    store = attach(lm.model, 64 * MIB)
    ids = lm.encode(SYSTEM)
    KVSession(lm).prefill(ids)
    clear_prefix_cache(lm)
    assert len(store) == 0 and store.nbytes == 0
    assert _reused(lm, ids) == 0


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_prefill_that_raises_stores_nothing(lm, monkeypatch, error):
    store = attach(lm.model, 64 * MIB)
    session = KVSession(lm, prefill_chunk=32)
    real, calls = session._forward, []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise error("interrupted")
        return real(*args, **kwargs)

    monkeypatch.setattr(session, "_forward", failing)
    with pytest.raises(error):
        session.prefill(lm.encode(SYSTEM))
    monkeypatch.undo()
    assert len(session) == 64 and len(store) == 0
    session.prefill([1, 2, 3])  # the session goes on, but never vouches for its prefix again
    assert len(store) == 0


def test_a_session_that_decoded_is_not_stored(lm):
    store = attach(lm.model, 64 * MIB)
    session = KVSession(lm)
    session.extend([1, 2, 3])
    session.prefill([4, 5, 6])
    assert len(store) == 0


def test_changed_weights_drop_what_was_stored(lm):
    model = tiny_lm(num_layers=1, seed=3)
    store = attach(model.model, 64 * MIB)
    ids = model.encode(SYSTEM)
    KVSession(model).prefill(ids)
    with torch.no_grad():
        model.model.lm_head.weight.mul_(1.0)  # an in-place write bumps the version
    assert _reused(model, ids) == 0
    assert len(store) == 1  # what the session read since


def test_concurrent_sessions_share_the_store_safely(lm):
    store = attach(lm.model, 64 * MIB, exact=True)
    prompts = [lm.prompt_ids(chat(q)) for q in QUESTIONS]
    cold = [KVSession(lm).prefill(ids) for ids in prompts]
    results: dict[int, torch.Tensor] = {}

    def work(i: int) -> None:
        results[i] = KVSession(lm).prefill(prompts[i % len(prompts)])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(results[i], cold[i % len(prompts)]) for i in range(6))
    assert store.nbytes <= store.budget


@pytest.mark.parametrize(("budget", "error"), [(-1, ValueError), (1.5, TypeError),
                                               ("big", TypeError), (None, TypeError)])
def test_a_bad_budget_names_the_setting(budget, error):
    with pytest.raises(error, match="prefix cache budget"):
        PrefixStore(budget)


def test_load_lm_takes_the_budget_on_torch(tiny_model_folder):
    from shared_core.runtime import models

    def budget(value: bool | int) -> int:
        return store_for(models.load_lm(tiny_model_folder, backend="torch", prefix_cache=value).model).budget

    assert budget(3) == 3 * MIB and budget(False) == budget(0) == 0
    store = store_for(models.load_lm(tiny_model_folder, backend="torch", exact=True).model)
    assert store.exact and 0 < store.budget <= 256 * MIB
    with pytest.raises(TypeError, match="prefix_cache must be True, False or an int"):
        models.load_lm(tiny_model_folder, backend="torch", prefix_cache="on")
    with pytest.raises(ValueError, match=r"n_ctx is a llama\.cpp setting"):
        models.load_lm(tiny_model_folder, backend="torch", n_ctx=512)
