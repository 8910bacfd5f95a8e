"""KV sessions: rollback helper semantics, extend/tree forwards equal full forwards."""

from __future__ import annotations

import gc
from dataclasses import replace

import pytest
import torch
from transformers.cache_utils import DynamicCache

from shared_core.runtime.torch import static
from shared_core.runtime.torch.session import KVSession, rollback, tree_attention_mask
from shared_core.runtime.torch.static import DEFAULT_STATIC_CAPACITY, StaticKV

KINDS = ["prealloc", "dynamic", "static"]
TEXT = "The quick brown fox jumps over the lazy dog. Paris is the capital of France."


@pytest.fixture(scope="module")
def ids(tiny_target):
    return tiny_target.encode(TEXT)


@pytest.fixture(scope="module")
def full_logits(tiny_target, ids):
    with torch.inference_mode():
        return tiny_target.model(torch.tensor([ids])).logits[0]


def test_transformers_dynamic_cache_crop_semantics():
    """Every transformers 5.x removes |n| tokens for crop(-n), the form rollback uses; crop(n)
    kept the first n before 5.18 (deprecated: the GPU machine's 5.17) and is refused since."""
    import transformers
    from packaging.version import Version

    cache = DynamicCache()
    cache.update(torch.zeros(1, 2, 7, 4), torch.zeros(1, 2, 7, 4), layer_idx=0)
    if Version(transformers.__version__) >= Version("5.18"):
        with pytest.raises(ValueError, match="positive"):
            cache.crop(3)
    cache.crop(-2)
    assert cache.get_seq_length() == 5
    rollback(cache, 1)
    assert cache.get_seq_length() == 1
    with pytest.raises(ValueError, match="cannot roll back"):
        rollback(cache, 4)


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_extend_rollback_match_a_full_forward(tiny_target, ids, full_logits, kind):
    session = KVSession(tiny_target, cache=kind, prefill_chunk=4)
    last = session.prefill(ids[:10])
    torch.testing.assert_close(last, full_logits[9], atol=1e-4, rtol=1e-4)
    session.extend(ids[10:15])
    session.rollback(12)
    assert session.tokens == ids[:12] and session.cache.get_seq_length() == 12
    torch.testing.assert_close(session.extend(ids[12:]), full_logits[12:], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind", KINDS)
def test_tree_forward_equals_branches_and_keep_path(tiny_target, ids, kind):
    prefix, branch_a, branch_b = ids[:8], ids[8:11], [7, 9]
    session = KVSession(tiny_target, cache=kind)
    session.prefill(prefix)
    tree_logits = session.extend_tree(branch_a + branch_b, [-1, 0, 1, -1, 3])

    def branch(tokens: list[int]) -> torch.Tensor:
        s = KVSession(tiny_target, cache=kind)
        s.prefill(prefix)
        return s.extend(tokens)

    torch.testing.assert_close(tree_logits[:3], branch(branch_a), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(tree_logits[3:], branch(branch_b), atol=1e-4, rtol=1e-4)
    session.keep_path([3, 4])  # the second branch: a gather, not a crop
    assert session.tokens == prefix + branch_b
    torch.testing.assert_close(session.extend([5]), branch([*branch_b, 5])[-1:], atol=1e-4,
                               rtol=1e-4)


def test_tree_mask_lets_nodes_see_prefix_and_ancestors_only():
    mask, depth = tree_attention_mask([-1, 0, -1, 2], prefix_len=2, dtype=torch.float32)
    visible = (mask[0, 0] == 0).int().tolist()
    assert visible == [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 1, 0],
                       [1, 1, 0, 0, 1, 1]]
    assert depth.tolist() == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="precede"):
        tree_attention_mask([1, -1], 0, torch.float32)


@pytest.mark.parametrize("kind", KINDS)
def test_fork_is_independent(tiny_target, ids, full_logits, kind):
    session = KVSession(tiny_target, cache=kind)
    session.prefill(ids[:6])
    clone = session.fork()
    clone.extend(ids[6:9])
    assert len(session) == 6 and session.cache.get_seq_length() == 6
    assert len(clone) == 9
    torch.testing.assert_close(session.extend(ids[6:8]), full_logits[6:8], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(clone.extend(ids[9:11]), full_logits[9:11], atol=1e-4, rtol=1e-4)


def test_sync_rolls_back_to_common_prefix(tiny_target, ids):
    session = KVSession(tiny_target)
    session.prefill(ids[:10])
    assert session.sync([*ids[:7], 3, 4]) == [3, 4]
    assert len(session) == 7


def test_window_overflow_is_a_clear_error(tiny_target):
    session = KVSession(tiny_target)
    with pytest.raises(ValueError, match="exceeds the model window"):
        session.prefill([5] * (tiny_target.max_context + 1))


@pytest.mark.parametrize("kind", KINDS)
def test_copy_positions_attends_to_the_kept_tokens_at_their_positions(tiny_target, ids, kind):
    """A session on a subset of another's tokens = the full forward with the rest masked out."""
    n, dropped = 14, [3, 4, 5, 9]
    source = KVSession(tiny_target, cache=kind)
    source.prefill(ids[:n])
    kept = [i for i in range(n) if i not in dropped]
    sparse = KVSession(tiny_target, cache=kind)
    sparse.copy_positions(source, kept)
    assert sparse.tokens == [ids[i] for i in kept] and sparse.position_offset == len(dropped)
    new = ids[n:n + 3]
    got = sparse.extend(new)
    # reference: one forward over ids[:n] + new where the new tokens cannot see `dropped`
    mask = torch.ones(n + 3, n + 3, dtype=torch.bool).tril()
    mask[n:, dropped] = False
    additive = torch.zeros(n + 3, n + 3).masked_fill(~mask, torch.finfo(torch.float32).min)
    with torch.inference_mode():
        reference = tiny_target.model(torch.tensor([ids[:n] + new]),
                                      attention_mask=additive[None, None]).logits[0, n:]
    torch.testing.assert_close(got, reference, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="ascending"):
        sparse.copy_positions(source, [4, 2])
    with pytest.raises(ValueError, match="ascending"):
        sparse.copy_positions(source, [0, n])


# ------------------------------------------------------------------------ cache="static"


def test_static_overflow_names_the_setting_and_leaves_the_session_usable(tiny_target, ids,
                                                                         full_logits):
    lm = replace(tiny_target, static_capacity=16)
    session = KVSession(lm, cache="static")
    session.prefill(ids[:10])
    session.extend(ids[10:16])  # exactly full
    with pytest.raises(ValueError, match="static_capacity"):
        session.extend(ids[16:17])
    with pytest.raises(ValueError, match="static_capacity"):
        KVSession(lm, cache="static").prefill(ids[:17])
    assert session.tokens == ids[:16] and session.cache.get_seq_length() == 16
    session.rollback(12)
    torch.testing.assert_close(session.extend(ids[12:16]), full_logits[12:16], atol=1e-4,
                               rtol=1e-4)
    with pytest.raises(ValueError, match="static_capacity"):
        replace(tiny_target, static_capacity=tiny_target.max_context + 1).open_session(
            cache="static")


def test_static_rollback_moves_one_counter_and_stale_slots_are_not_read(tiny_target, ids,
                                                                        full_logits):
    session = KVSession(tiny_target, cache="static")
    cache = session.cache
    assert isinstance(cache, StaticKV) and cache.capacity == min(tiny_target.max_context,
                                                                 DEFAULT_STATIC_CAPACITY)
    session.prefill(ids[:10])
    session.extend([5, 6, 7, 8])  # written at slots 10..13, then dropped
    session.rollback(10)
    assert int(cache.start) == cache.length == 10
    written = cache.layers[0].keys[:, :, 10:14]
    assert written.abs().sum() > 0  # the stale keys are still there: only the counter moved
    torch.testing.assert_close(session.extend(ids[10:]), full_logits[10:], atol=1e-4, rtol=1e-4)
    assert session.cache is cache  # a static session keeps its buffers


def test_a_failed_static_forward_leaves_counter_and_tokens_agreeing(tiny_target, ids,
                                                                    full_logits):
    session = KVSession(tiny_target, cache="static")
    session.prefill(ids[:8])

    def hook(*_):
        raise RuntimeError("layer 1 failed")

    handle = tiny_target.model.model.layers[1].register_forward_pre_hook(hook)
    try:
        with pytest.raises(RuntimeError, match="layer 1"):
            session.extend(ids[8:11])
    finally:
        handle.remove()
    assert session.tokens == ids[:8] and int(session.cache.start) == session.cache.length == 8
    torch.testing.assert_close(session.extend(ids[8:12]), full_logits[8:12], atol=1e-4,
                               rtol=1e-4)


def test_static_buffers_serve_the_next_session(tiny_target, ids, full_logits):
    first = KVSession(tiny_target, cache="static")
    first.prefill(ids)
    buffer = first.cache.layers[0].keys
    del first
    gc.collect()
    second = KVSession(tiny_target, cache="static")  # the pooled cache, emptied
    assert second.cache.length == 0
    second.prefill(ids[:5])
    assert second.cache.layers[0].keys is buffer  # same address: a captured graph replays
    torch.testing.assert_close(second.extend(ids[5:9]), full_logits[5:9], atol=1e-4, rtol=1e-4)


def test_static_refuses_a_passage_cache(tiny_target, ids, monkeypatch):
    monkeypatch.setattr(tiny_target.model, "passage_cache", object(), raising=False)
    with pytest.raises(ValueError, match="passage cache"):
        KVSession(tiny_target, cache="static").prefill(ids[:4])


def test_the_static_step_traces_to_one_graph_across_steps_and_rollbacks(tiny_target, ids,
                                                                        monkeypatch):
    """What CUDA compiles (fullgraph, static shapes), traced on the CPU with dynamo's eager
    backend: one graph serves every one-token step, before and after rollbacks, and its
    logits equal the growing cache's."""
    from torch._dynamo.utils import counters

    monkeypatch.setattr(static, "COMPILE_DEVICES", frozenset({"cpu"}))
    monkeypatch.setattr(static, "COMPILE_OPTIONS",
                        {"backend": "eager", "fullgraph": True, "dynamic": False})
    static.compiled_step.cache_clear()
    torch._dynamo.reset()
    counters.clear()
    try:
        reference, session = KVSession(tiny_target), KVSession(tiny_target, cache="static")
        reference.prefill(ids[:10])
        session.prefill(ids[:10])
        for i in range(10, len(ids)):
            if i % 4 == 0:  # a rejected draft: two tokens in, rolled back, re-fed one by one
                for s in (reference, session):
                    s.extend([3, 4])
                    s.rollback(i)
            torch.testing.assert_close(session.extend([ids[i]]), reference.extend([ids[i]]),
                                       atol=1e-4, rtol=1e-4)
        # another session, fed at shifted positions (copy_positions): still the same graph
        kept = [i for i in range(len(ids)) if i % 3]
        sparse, sparse_reference = KVSession(tiny_target, cache="static"), KVSession(tiny_target)
        sparse.copy_positions(session, kept)
        sparse_reference.copy_positions(reference, kept)
        for token in (5, 9, 11):
            torch.testing.assert_close(sparse.extend([token]), sparse_reference.extend([token]),
                                       atol=1e-4, rtol=1e-4)
        assert counters["stats"]["unique_graphs"] == 1
    finally:
        static.compiled_step.cache_clear()
        torch._dynamo.reset()


@pytest.mark.parametrize("mode", ["exact", "static"])
def test_a_reply_is_cut_to_what_the_static_cache_holds_not_refused_midway(tiny_target, mode):
    """A prompt plus ``max_new_tokens`` that fits the model's window but not the static cache
    (exact mode's padded forwards included): the token limit is lowered before the call, and
    greedy decoding and speculative decoding end together with ``finish_reason="length"``
    (before: a ValueError naming static_capacity after some tokens had streamed)."""
    from shared_core.drafters.prompt_lookup import PromptLookupDrafter
    from shared_core.engines.baseline import autoregressive_generate, speculative_generate
    from shared_core.runtime.torch.exact import EXACT_WIDTH

    capacity, prompt = 112, list(range(3, 83))  # 80 ids: 32 positions left, fewer if padded
    lm = replace(tiny_target, static_capacity=capacity,
                 exact_width=EXACT_WIDTH if mode == "exact" else None)
    cache = "static" if mode == "static" else "dynamic"
    fits = capacity - len(prompt) - (EXACT_WIDTH - 1 if mode == "exact" else 0)
    plain = autoregressive_generate(lm, prompt, 40, cache=cache)
    spec = speculative_generate(lm, PromptLookupDrafter(), prompt, 40, k=4, cache=cache)
    assert plain.token_ids == spec.token_ids and len(plain.token_ids) == fits
    assert plain.stats.finish_reason == spec.stats.finish_reason == "length"
