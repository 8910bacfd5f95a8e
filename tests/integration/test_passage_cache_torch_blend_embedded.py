"""Passage KV reuse on the embedded SmolLM2-135M-Instruct (real weights, fp32 on CPU)."""

from __future__ import annotations

import pytest
import torch

from shared_core.bench.system.blend_measure import Case
from shared_core.runtime.passage_cache.torch_blend import (
    blend_prefill,
    blend_session,
    chunk_kv,
    rotary_embedding,
    shift_keys,
)
from shared_core.runtime.torch.session import KVSession

pytestmark = pytest.mark.integration

PASSAGES = [
    "The Iron Bridge over the Severn is 840 meters long and opened to traffic in 1968 after six "
    "years of work.",
    "Marta Kovac designed the Iron Bridge; she later led the city's harbor authority until 1990.",
    "The harbor of Port Alder was built in 1712 and enlarged twice, in 1850 and in 1931.",
]
QUESTION = "Who designed the bridge that opened in 1968?"


@pytest.fixture(scope="module")
def rag(smollm):
    """A standard RAG prompt as pieces and every passage's KV read alone after its head."""
    pre, post = (smollm.chat_prompt([{"role": "user", "content": "\x00"}]) + "Answer:").split("\x00")
    head = smollm.encode(f"{pre}Answer the question using the documents.\n\nDocument [1]:")
    chunks = [smollm.encode(" " + p) for p in PASSAGES]
    between = [smollm.encode("\nDocument [2]:"), smollm.encode("\nDocument [3]:"),
               smollm.encode(f"\n\nQuestion: {QUESTION}{post}")]
    ids, starts = Case(head, chunks, between).prompt()
    spans = [(s, chunk_kv(smollm, head, c)) for s, c in zip(starts, chunks, strict=True)]
    session = KVSession(smollm)
    logits = session.prefill(ids)
    return ids, spans, session, logits


def _kl(reference: torch.Tensor, other: torch.Tensor) -> float:
    p, q = torch.log_softmax(reference, -1), torch.log_softmax(other, -1)
    return float((p.exp() * (p - q)).sum())


def test_smollm_keys_shift_to_where_they_would_be_read(smollm, rag):
    _, spans, _, _ = rag
    chunk = list(spans[0][1].ids)
    moved = shift_keys(chunk_kv(smollm, [], chunk), 200, rotary_embedding(smollm))
    direct = chunk_kv(smollm, [], chunk, start=200)
    assert torch.allclose(moved.keys, direct.keys, atol=1e-3, rtol=1e-4)


def test_smollm_full_recompute_equals_a_full_prefill(smollm, rag):
    ids, spans, full, logits = rag
    session, blend = blend_session(smollm, ids, spans, recompute_share=1.0)
    assert torch.allclose(blend.logits, logits, atol=1e-3, rtol=1e-4)
    for mine, theirs in zip(session.cache.layers, full.cache.layers, strict=True):
        assert torch.allclose(mine.keys, theirs.keys, atol=1e-3, rtol=1e-4)
        assert torch.allclose(mine.values, theirs.values, atol=1e-3, rtol=1e-4)
    greedy = [int(logits.argmax())]
    for _ in range(3):
        greedy.append(int(session.extend([greedy[-1]])[-1].argmax()))
    reference = full.fork()
    expected = [int(logits.argmax())]
    for _ in range(3):
        expected.append(int(reference.extend([expected[-1]])[-1].argmax()))
    assert greedy == expected


def test_smollm_recomputing_by_deviation_restores_the_first_token(smollm, rag):
    """Pure reuse misses the cross-attention between passages and changes the first answer
    token of this prompt; recomputing 30 % of the reused tokens chosen by KV deviation brings
    the full prefill's token back and more than halves KL(full || blend)."""
    ids, spans, _, logits = rag
    pure = blend_prefill(smollm, ids, spans, recompute_share=0.0)
    blended = blend_prefill(smollm, ids, spans, recompute_share=0.3)
    assert int(pure.logits.argmax()) != int(logits.argmax())
    assert int(blended.logits.argmax()) == int(logits.argmax())
    assert _kl(logits, blended.logits) < 0.5 * _kl(logits, pure.logits)
    assert blended.report.recomputed == round(0.3 * (blended.report.reused
                                                     + blended.report.recomputed))
