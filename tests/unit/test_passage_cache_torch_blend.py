"""Passage KV reuse on torch (shared_core.runtime.passage_cache.torch_blend) on tiny random models."""

from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from tiny import measured, tiny_lm

from shared_core.bench.system.blend_measure import Case, measure_blend
from shared_core.runtime.passage_cache.torch_blend import (
    ChunkKV,
    blend_prefill,
    blend_session,
    chunk_kv,
    install,
    rotary_embedding,
    shift_keys,
)
from shared_core.runtime.torch.prefix import attach
from shared_core.runtime.torch.session import KVSession

ATOL = 1e-4  # fp32, a few layers: observed differences are ~1e-6


@pytest.fixture(scope="module")
def lm():
    return tiny_lm(num_layers=4, seed=0)


@pytest.fixture(scope="module")
def ids() -> list[int]:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(3, 300, (70,), generator=generator).tolist()


def _pieces(ids: list[int]) -> tuple[list[int], list[int], list[int]]:
    """head [0, 6), chunk A [6, 26), chunk B [30, 55); the rest is labels and the question."""
    return ids[:6], ids[6:26], ids[30:55]


def _full(lm, ids: list[int]) -> tuple[KVSession, torch.Tensor]:
    session = KVSession(lm)
    return session, session.prefill(ids)


def _close(a: torch.Tensor, b: torch.Tensor, atol: float = ATOL) -> bool:
    return torch.allclose(a.float(), b.float(), atol=atol, rtol=1e-4)


def _caches_close(one, other) -> bool:
    return all(_close(a.keys, b.keys) and _close(a.values, b.values)
               for a, b in zip(one.layers, other.layers, strict=True))


# --------------------------------------------------------------------------- chunk KV and shift


@pytest.mark.parametrize("target", [37, 250])
def test_shift_moves_a_chunk_to_where_it_would_be_read(lm, ids, target):
    """Read alone at [0, n) and at [P, P + n), a chunk has the same pre-RoPE K and the same V
    (attention is relative), so keys rotated by P must equal the keys read at P."""
    at_zero = chunk_kv(lm, [], ids[:20], start=0)
    at_target = chunk_kv(lm, [], ids[:20], start=target)
    moved = shift_keys(at_zero, target, rotary_embedding(lm))
    assert moved.position == at_target.position == target
    assert _close(moved.keys, at_target.keys) and _close(at_zero.values, at_target.values)
    assert not _close(at_zero.keys, at_target.keys)  # the positions do change the keys
    back = shift_keys(moved, -target, rotary_embedding(lm))
    assert back.position == 0 and _close(back.keys, at_zero.keys)


def test_chunk_kv_records_the_head_and_positions(lm, ids):
    head, chunk, _ = _pieces(ids)
    kv = chunk_kv(lm, head, chunk, start=3)
    assert kv.ids == tuple(chunk) and kv.head_ids == tuple(head) and kv.position == 3 + len(head)
    config = lm.model.config
    dim = config.hidden_size // config.num_attention_heads
    assert kv.keys.shape == (4, config.num_key_value_heads, len(chunk), dim)
    assert kv.nbytes == 2 * kv.keys.numel() * 4


def _rope_lm(rope_parameters: dict) -> object:
    from tiny import tiny_llama, tiny_tokenizer
    from transformers import LlamaForCausalLM

    from shared_core.runtime.models import wrap_lm

    config = tiny_llama(num_layers=2).config
    config.rope_parameters = rope_parameters
    torch.manual_seed(1)
    return wrap_lm(LlamaForCausalLM(config).eval(), tiny_tokenizer(), name="tiny-rope")


def test_shift_is_exact_for_linear_rope(ids):
    lm = _rope_lm({"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})
    moved = shift_keys(chunk_kv(lm, [], ids[:16]), 90, rotary_embedding(lm))
    assert _close(moved.keys, chunk_kv(lm, [], ids[:16], start=90).keys)


def _fake_rope(kind: str, dim: int = 16, window: int = 64) -> SimpleNamespace:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    return SimpleNamespace(rope_type=kind, original_inv_freq=inv_freq, original_max_seq_len=window)


def _random_chunk(n: int = 4, dim: int = 16) -> ChunkKV:
    generator = torch.Generator().manual_seed(2)
    kv = torch.randn((2, 2, n, dim), generator=generator)
    return ChunkKV(ids=tuple(range(n)), head_ids=(), position=0, keys=kv, values=kv.clone())


def test_shift_refuses_ropes_it_cannot_move_exactly():
    chunk = _random_chunk()
    with pytest.raises(ValueError, match="rope type 'yarn' is not supported"):
        shift_keys(chunk, 5, _fake_rope("yarn"))
    with pytest.raises(ValueError, match="dynamic RoPE changes its frequencies past 64"):
        shift_keys(chunk, 61, _fake_rope("dynamic"))
    inside = shift_keys(chunk, 59, _fake_rope("dynamic"))
    assert torch.equal(inside.keys, shift_keys(chunk, 59, _fake_rope("default")).keys)
    with pytest.raises(ValueError, match="partial rotary"):
        shift_keys(chunk, 3, _fake_rope("default", dim=8))
    with pytest.raises(ValueError, match="position -2 < 0"):
        shift_keys(chunk, -2, _fake_rope("default"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunk_bytes_round_trip(dtype):
    chunk = _random_chunk()
    chunk = dataclasses.replace(chunk, keys=chunk.keys.to(dtype), values=chunk.values.to(dtype),
                                head_ids=(7, 8), position=5)
    again = ChunkKV.from_bytes(chunk.to_bytes())
    assert (again.ids, again.head_ids, again.position, again.dtype) == (
        chunk.ids, chunk.head_ids, 5, dtype)
    assert torch.equal(again.keys, chunk.keys) and torch.equal(again.values, chunk.values)
    assert chunk.nbytes == 2 * chunk.keys.numel() * chunk.keys.element_size()
    with pytest.raises(ValueError, match="blob is not"):
        ChunkKV.from_bytes(b"\x08" + bytes(20))


def test_chunk_kv_validates_its_shapes():
    kv = torch.zeros((2, 2, 3, 4))
    with pytest.raises(ValueError, match="2 ids needs KV for as many tokens, got 3"):
        ChunkKV(ids=(1, 2), head_ids=(), position=0, keys=kv, values=kv)
    with pytest.raises(ValueError, match="keys and values"):
        ChunkKV(ids=(1, 2, 3), head_ids=(), position=0, keys=kv, values=kv[:1])


# --------------------------------------------------------------------------- blending


@pytest.mark.parametrize("kind", ["prealloc", "dynamic"])
def test_full_recompute_equals_a_full_prefill_and_decodes_on(lm, ids, kind):
    head, a, b = _pieces(ids)
    spans = [(30, chunk_kv(lm, head, b)), (6, chunk_kv(lm, head, a))]  # any order
    full_session, full_logits = _full(lm, ids)
    session, blend = blend_session(lm, ids, spans, recompute_share=1.0, cache=kind)
    assert blend.report == dataclasses.replace(blend.report, reused=0, recomputed=45, read=25)
    assert _close(blend.logits, full_logits) and _caches_close(session.cache, full_session.cache)
    assert session.tokens == ids and len(session) == len(full_session)
    follow = ids[:3]
    assert _close(session.extend(follow), full_session.extend(follow))


def test_pure_reuse_of_chunks_read_in_their_context_equals_a_full_prefill(lm, ids):
    """A chunk read after exactly the tokens before it in the prompt has the full prefill's KV:
    reuse must place it without changing anything."""
    spans = [(6, chunk_kv(lm, ids[:6], ids[6:26])), (30, chunk_kv(lm, ids[:30], ids[30:55]))]
    blend = blend_prefill(lm, ids, spans, recompute_share=0.0)
    assert (blend.report.reused, blend.report.recomputed, blend.report.read) == (45, 0, 25)
    assert blend.report.select_layers == 0
    full_session, full_logits = _full(lm, ids)
    assert _close(blend.logits, full_logits) and _caches_close(blend.cache, full_session.cache)


def test_pure_reuse_keeps_the_moved_chunk_kv(lm, ids):
    head, _, b = _pieces(ids)
    chunk = chunk_kv(lm, head, b)
    blend = blend_prefill(lm, ids, [(30, chunk)], recompute_share=0.0)
    moved = shift_keys(chunk, 30 - chunk.position, rotary_embedding(lm))
    for index, layer in enumerate(blend.cache.layers):
        assert torch.equal(layer.keys[0, :, 30:55], moved.keys[index])
        assert torch.equal(layer.values[0, :, 30:55], moved.values[index])
    _, full_logits = _full(lm, ids)
    assert not _close(blend.logits, full_logits, atol=1e-2)  # out of context: not the full prefill


def test_deviation_selects_the_chunk_read_out_of_context(lm, ids):
    """Chunk A is read after its real prefix (no deviation), chunk B after the head only: a
    share covering B's length must recompute exactly B, which restores the full prefill."""
    head, a, b = _pieces(ids)
    spans = [(6, chunk_kv(lm, head, a)), (30, chunk_kv(lm, head, b))]
    blend = blend_prefill(lm, ids, spans, recompute_share=len(b) / (len(a) + len(b)))
    assert blend.selected == list(range(30, 55))
    assert blend.report.select_layers == 2
    full_session, full_logits = _full(lm, ids)
    assert _close(blend.logits, full_logits) and _caches_close(blend.cache, full_session.cache)


def test_simple_rules_select_their_share(lm, ids):
    head, a, b = _pieces(ids)
    spans = [(6, chunk_kv(lm, head, a)), (30, chunk_kv(lm, head, b))]
    starts = blend_prefill(lm, ids, spans, recompute_share=0.2, select="chunk_start")
    assert starts.selected == [*range(6, 10), *range(30, 35)]
    assert starts.report.recomputed == 9 and starts.report.select_layers == 0
    one = blend_prefill(lm, ids, spans, recompute_share=0.2, select="random")
    two = blend_prefill(lm, ids, spans, recompute_share=0.2, select="random")
    assert one.selected == two.selected and len(one.selected) == 9
    assert all(6 <= p < 26 or 30 <= p < 55 for p in one.selected)


def test_a_prompt_ending_in_a_chunk_recomputes_its_last_token(lm, ids):
    head, a, _ = _pieces(ids)
    blend = blend_prefill(lm, ids[:26], [(6, chunk_kv(lm, head, a))], recompute_share=0.0)
    assert (blend.report.reused, blend.report.recomputed, blend.report.read) == (19, 1, 6)
    assert blend.cache.get_seq_length() == 26 and blend.logits.shape == (lm.vocab_size,)


@pytest.mark.parametrize(("options", "match"), [
    ({"recompute_share": -0.1}, "recompute_share"), ({"recompute_share": 1.5}, "recompute_share"),
    ({"recompute_share": math.nan}, "recompute_share"), ({"select": "oldest"}, "select must"),
    ({"select_layer": 4}, "select_layer"),
])
def test_blend_rejects_bad_options(lm, ids, options, match):
    with pytest.raises(ValueError, match=match):
        blend_prefill(lm, ids, [], **options)


def test_blend_rejects_spans_that_do_not_fit(lm, ids):
    head, a, _ = _pieces(ids)
    chunk = chunk_kv(lm, head, a)
    with pytest.raises(ValueError, match="spans: the chunk placed at 7"):
        blend_prefill(lm, ids, [(7, chunk)])
    with pytest.raises(ValueError, match="spans overlap"):
        blend_prefill(lm, ids + a, [(6, chunk), (20, chunk_kv(lm, head, ids[20:30]))])
    other = chunk_kv(tiny_lm(num_layers=2, seed=0), head, a)
    with pytest.raises(ValueError, match="spans: the chunk at 6 has KV"):
        blend_prefill(lm, ids, [(6, other)])
    with pytest.raises(ValueError, match="prompt_ids must not be empty"):
        blend_prefill(lm, [], [])


def test_sliding_window_models_are_refused(ids):
    lm = tiny_lm(num_layers=2, seed=3)
    lm.model.config.layer_types = ["sliding_attention", "full_attention"]
    with pytest.raises(ValueError, match="only full-attention layers"):
        chunk_kv(lm, [], ids[:5])


def test_install_needs_an_empty_session_of_the_same_kind(lm, ids):
    blend = blend_prefill(lm, ids, [], recompute_share=0.0)
    busy = KVSession(lm)
    busy.prefill(ids[:3])
    with pytest.raises(ValueError, match="session must be empty"):
        install(busy, blend)
    with pytest.raises(ValueError, match="'prealloc' cache, the session uses 'dynamic'"):
        install(KVSession(lm, cache="dynamic"), blend)


def test_blended_kv_never_enters_the_exact_prefix_store(ids):
    lm = tiny_lm(num_layers=2, seed=4)
    store = attach(lm.model, 1 << 20)
    head, a, _ = _pieces(ids)
    session, _ = blend_session(lm, ids, [(6, chunk_kv(lm, head, a))], recompute_share=0.0)
    session.prefill(ids[:4])
    assert len(store) == 0 and session.reused_tokens == 20


def test_measure_blend_reports_every_share(lm, ids):
    head, a, b = _pieces(ids)
    case = Case(head, [a, b], [ids[26:30], ids[55:]])
    assert case.prompt() == (ids, [6, 30])
    report = measure_blend(lm, [case], shares=(0.0, 0.5, 1.0), selects=("deviation", "random"),
                           decode=3)
    row = report["cases"][0]
    assert [(b["select"], b["share"]) for b in row["blends"]] == [
        ("deviation", 0.0), ("deviation", 0.5), ("deviation", 1.0), ("random", 0.5)]
    full = row["blends"][2]
    assert full["top1"] and full["same_tokens"] and full["kl"] < 1e-6
    assert all(measured(b["s"], b["ratio"], b["kl"] + 1e-9) for b in row["blends"])
    assert [s["n"] for s in report["summary"]] == [1, 1, 1, 1]


def test_chunks_stored_at_half_precision_blend_into_a_float32_model(lm, ids):
    head, a, b = _pieces(ids)
    spans = [(6, chunk_kv(lm, head, a)), (30, chunk_kv(lm, head, b))]
    half = [(s, dataclasses.replace(c, keys=c.keys.half(), values=c.values.half()))
            for s, c in spans]
    exact = blend_prefill(lm, ids, spans, recompute_share=0.15)
    rounded = blend_prefill(lm, ids, half, recompute_share=0.15)
    assert rounded.cache.layers[0].keys.dtype == torch.float32
    assert rounded.selected == exact.selected and _close(rounded.logits, exact.logits, atol=5e-2)


@pytest.mark.parametrize("share", [0.3, 1.0])
def test_blend_in_small_forwards_equals_one_forward(lm, ids, share):
    head, a, b = _pieces(ids)
    spans = [(6, chunk_kv(lm, head, a)), (30, chunk_kv(lm, head, b))]
    whole = blend_prefill(lm, ids, spans, recompute_share=share)
    pieces = blend_prefill(lm, ids, spans, recompute_share=share, prefill_chunk=7)
    assert pieces.selected == whole.selected and _close(pieces.logits, whole.logits)
    assert _caches_close(pieces.cache, whole.cache)
    with pytest.raises(ValueError, match="prefill_chunk must be >= 1"):
        blend_prefill(lm, ids, spans, prefill_chunk=0)
