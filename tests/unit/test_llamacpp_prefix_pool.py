"""The idle-context pool of prefix reuse (issue 29): which context serves a prompt, and which one
goes when the pool is full. Plain objects stand for contexts: only their remembered ids matter."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from shared_core.runtime.llamacpp.prefix import IdleContexts


def ctx(*ids: int) -> SimpleNamespace:
    return SimpleNamespace(tokens=list(ids))


def test_the_longest_common_prefix_wins_and_the_last_id_is_always_decoded():
    pool = IdleContexts(3)
    short, long, other = ctx(1, 2), ctx(1, 2, 3, 4), ctx(9, 9, 9)
    for slot in (short, long, other):
        assert pool.put(slot) is None
    assert pool.take([1, 2, 3, 4]) == (long, 3)  # all 4 are cached; the last one is decoded
    assert pool.take([1, 2, 5]) == (short, 2)
    assert len(pool) == 1


def test_ties_go_to_the_most_recent_and_no_match_takes_the_least_recent():
    pool = IdleContexts(3)
    old, new, unrelated = ctx(1, 2, 7), ctx(1, 2, 8), ctx(5)
    for slot in (old, new, unrelated):
        pool.put(slot)
    assert pool.take([1, 2, 3]) == (new, 2)
    assert pool.take([4, 4]) == (old, 0)  # nothing shared: the least recently released
    assert pool.take([]) == (unrelated, 0)
    assert pool.take([1]) == (None, 0)


def test_a_full_pool_drops_the_least_recently_released():
    pool = IdleContexts(2)
    first, second, third = ctx(1), ctx(2), ctx(3)
    assert pool.put(first) is None
    assert pool.put(second) is None
    assert pool.put(third) is first
    assert list(pool) == [second, third]
    assert IdleContexts(0).put(first) is first  # no idle contexts kept at all


def test_unknown_contents_are_never_matched():
    pool = IdleContexts(2)
    unknown = SimpleNamespace(tokens=None)
    pool.put(unknown)
    assert pool.take([1, 2, 3]) == (unknown, 0)


@pytest.mark.parametrize(("keep", "error"), [(-1, ValueError), (1.5, TypeError),
                                             (True, TypeError)])
def test_the_budget_is_checked(keep, error):
    with pytest.raises(error, match="idle_contexts"):
        IdleContexts(keep)


def test_load_lm_prefix_cache_maps_to_the_settings():
    from shared_core.runtime.llamacpp.lm import LlamaCppSettings, prefix_cache_settings

    assert prefix_cache_settings(None) == {}
    assert prefix_cache_settings(False) == prefix_cache_settings(0) == {"prefix_cache": False}
    assert prefix_cache_settings(True) == {"prefix_cache": True}
    assert LlamaCppSettings(**prefix_cache_settings(5)).idle_contexts == 5
    with pytest.raises(TypeError, match="prefix_cache must be True or False"):
        LlamaCppSettings(prefix_cache="yes")


@pytest.mark.parametrize(("value", "error"), [(-1, ValueError), (1.5, TypeError), ("on", TypeError)])
def test_load_lm_refuses_a_bad_prefix_cache_before_any_model_work(monkeypatch, value, error):
    from shared_core.runtime import models

    def refuse(*args, **kwargs):
        raise AssertionError("the model source was resolved")

    monkeypatch.setattr(models, "resolve_lm_source", refuse)
    with pytest.raises(error, match="prefix_cache must be True, False or an int >= 0"):
        models.load_lm("smollm2-135m-instruct", backend="llama.cpp", prefix_cache=value)
