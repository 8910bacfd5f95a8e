"""Steps 3 and 4: verifier scores of all drafts from one runtime call, selection."""

from __future__ import annotations

import random
import re
import string
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from shared_core.config.rag import DraftSelection, SpeculativeRAGConfig
from shared_core.engines.speculative_rag.prompts import REFLECTION
from shared_core.engines.speculative_rag.results import AnswerDraft

if TYPE_CHECKING:
    from shared_core.runtime.protocol import ModelLM


def verifier_rows(lm: ModelLM, question: str, drafts: Sequence[tuple[str, str]]
                  ) -> tuple[list[list[int]], list[tuple[int, int]], list[tuple[int, int]]]:
    """Token rows plus the (start, end) of the self-contain and the "Yes" span in each row."""
    prefix = lm.prompt_ids(f"Question: {question}\n")
    reflect = lm.encode(f"{REFLECTION}\nAnswer:")
    yes = lm.encode(" Yes")
    rows, sc_spans, yes_spans = [], [], []
    for rationale, answer in drafts:
        body = lm.encode(f"Answer: {answer}\nRationale: {rationale}\n")
        row = prefix + body + reflect + yes
        rows.append(row)
        sc_spans.append((len(prefix), len(prefix) + len(body)))
        yes_spans.append((len(row) - len(yes), len(row)))
    return rows, sc_spans, yes_spans


def verify_batch(lm: ModelLM, question: str, drafts: Sequence[tuple[str, str]]
                 ) -> tuple[list[tuple[float, float, int]], int]:
    """(log ρ_SC, log ρ_SR, tokens under ρ_SC) per (rationale, answer) draft, all rows scored
    together (``lm.span_logprobs``: one forward on torch, every row a sequence of one context on
    llama.cpp, one request to a server); also the number of tokens scored."""
    rows, sc_spans, yes_spans = verifier_rows(lm, question, drafts)
    spans = [[sc, yes] for sc, yes in zip(sc_spans, yes_spans, strict=True)]
    sums = lm.span_logprobs(rows, spans)
    return ([(s[0], s[1], end - start) for s, (start, end) in zip(sums, sc_spans, strict=True)],
            sum(len(r) for r in rows))


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def combined_score(draft: AnswerDraft, config: SpeculativeRAGConfig) -> float:
    """log ρ_draft + log ρ_SC + log ρ_SR with the config's switches (missing scores count 0)."""
    def part(logp: float | None, tokens: int) -> float:
        if logp is None:
            return 0.0
        return logp / max(tokens, 1) if config.length_normalize else logp

    return ((part(draft.log_draft, draft.draft_tokens) if config.use_draft_score else 0.0)
            + (part(draft.log_self_contain, draft.self_contain_tokens)
               if config.use_self_contain else 0.0)
            + (part(draft.log_self_reflect, 1) if config.use_self_reflect else 0.0))


def select_best(drafts: Sequence[AnswerDraft], selection: DraftSelection, rng: random.Random) -> int:
    """Index of the selected draft: highest score (first on ties), the best-scored draft of the
    answer most drafts agree on (``"vote"``; empty answers get no votes), or a seeded random one."""
    if selection == "random":
        return rng.randrange(len(drafts))
    if selection == "vote":
        answers = [normalize_answer(d.answer) for d in drafts]
        votes = Counter(a for a in answers if a)
        return max(range(len(drafts)), key=lambda i: (votes[answers[i]], drafts[i].score, -i))
    return max(range(len(drafts)), key=lambda i: (drafts[i].score, -i))
