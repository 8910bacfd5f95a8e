"""The xgrammar LogitsMask on its own: step-by-step greedy over masked logits equals transformers
``generate`` with xgrammar's own logits processor, and drafted rows are masked exactly as the
rows of committed tokens (committed state unchanged)."""

from __future__ import annotations

import json

import pytest
import torch

from shared_core.decoding.constrained import Constraint, compile_constraint, grammar_mask

xgr = pytest.importorskip("xgrammar")
from xgrammar.contrib.hf import LogitsProcessor  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
          "required": ["name", "n"]}
PROMPT = "user: hello there\nassistant:"


def _logits(lm, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return lm.model(torch.tensor([ids])).logits[0].float()


def masked_greedy(lm, constraint: Constraint, prompt_ids: list[int], steps: int) -> list[int]:
    mask, out = grammar_mask(lm, constraint), []
    for _ in range(steps):
        row = mask.mask(_logits(lm, prompt_ids + out)[-1:], [])
        token = int(row[0].argmax())
        mask.commit([token])
        out.append(token)
        if token in lm.eos_token_ids:
            break
    return out


@pytest.mark.parametrize("constraint", [Constraint("json_schema", SCHEMA), Constraint("json"),
                                        Constraint("json_schema", SCHEMA, suffix="}")])
def test_step_by_step_equals_transformers_generate(tiny_target, constraint):
    ids = tiny_target.encode(PROMPT)
    ours = masked_greedy(tiny_target, constraint, ids, 24)
    processor = LogitsProcessor(compile_constraint(tiny_target, constraint))
    with torch.inference_mode():
        ref = tiny_target.model.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                                         logits_processor=[processor])[0, len(ids):].tolist()
    eos = tiny_target.tokenizer.eos_token_id
    assert ours == ref[: len(ours)] and (len(ours) == len(ref) or ours[-1] == eos)


def test_drafted_rows_are_masked_as_committed_rows(tiny_target):
    constraint = Constraint("json_schema", SCHEMA)
    ids = tiny_target.encode(PROMPT)
    tokens = masked_greedy(tiny_target, constraint, ids, 16)
    assert len(tokens) >= 9
    mask = grammar_mask(tiny_target, constraint)
    mask.commit(tokens[:3])
    drafted = tokens[3:9]
    logits = _logits(tiny_target, ids + tokens[:9])[len(ids) + 2:]
    multi = mask.mask(logits, drafted)
    first_again = mask.mask(logits[:1], [])  # the committed state did not move
    assert torch.equal(first_again[0], multi[0])
    step = grammar_mask(tiny_target, constraint)
    step.commit(tokens[:3])
    for i, token in enumerate(drafted):
        assert torch.equal(step.mask(logits[i:i + 1], [])[0], multi[i])
        step.commit([token])


def test_rows_after_a_rejected_draft_stay_unmasked(tiny_target):
    mask = grammar_mask(tiny_target, Constraint("json_schema", SCHEMA))
    not_json = tiny_target.encode("hello")[0]
    logits = torch.randn(3, tiny_target.vocab_size)
    out = mask.mask(logits, [not_json, not_json])
    assert torch.isinf(out[0]).any() and out[0, not_json] == float("-inf")
    assert torch.equal(out[1:], logits[1:])
    with pytest.raises(RuntimeError, match="grammar forbids"):
        mask.commit([not_json])


def test_bad_arguments_are_named(tiny_target):
    with pytest.raises(ValueError, match="kind"):
        Constraint("yaml")
    with pytest.raises(TypeError, match="schema"):
        Constraint("json_schema", json.dumps(SCHEMA))
    mask = grammar_mask(tiny_target, Constraint("json"))
    with pytest.raises(ValueError, match="len\\(drafted\\)"):
        mask.mask(torch.zeros(1, tiny_target.vocab_size), [1, 2])
