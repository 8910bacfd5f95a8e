"""Steps 3 and 4: verifier scores from ONE forward (LM head on the scored spans only), selection."""

from __future__ import annotations

import random
import re
import string
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING

from shared_core.engines.speculative_rag.prompts import REFLECTION
from shared_core.engines.speculative_rag.results import AnswerDraft
from shared_core.rag_config import DraftSelection, SpeculativeRAGConfig

if TYPE_CHECKING:
    import torch

    from shared_core.models import LM


_LM_HEAD_CHUNK = 64  # positions per LM-head call when scoring spans (bounds memory)


def verifier_rows(lm: LM, question: str, drafts: Sequence[tuple[str, str]]
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


def _span_logprobs(lm: LM, hidden: torch.Tensor, ids: torch.Tensor,
                   spans: Sequence[Sequence[tuple[int, int]]]) -> list[list[float]]:
    """Sum of log P(token) over each span, running the LM head only on the needed positions."""
    import torch

    rows, cols, owners = [], [], []
    for r, row_spans in enumerate(spans):
        for s, (start, end) in enumerate(row_spans):
            for t in range(max(start, 1), end):  # position t-1 predicts token t
                rows.append(r)
                cols.append(t)
                owners.append((r, s))
    rows_t, cols_t = torch.tensor(rows), torch.tensor(cols)
    h = hidden[rows_t, cols_t - 1]  # [N, H]
    targets = ids[rows_t, cols_t]  # [N]
    head = lm.model.get_output_embeddings()
    softcap = getattr(lm.model.config, "final_logit_softcapping", None)
    logp = torch.empty(len(rows))
    for i in range(0, len(rows), _LM_HEAD_CHUNK):
        logits = head(h[i:i + _LM_HEAD_CHUNK]).float()  # [c, V]
        if softcap:
            logits = torch.tanh(logits / softcap) * softcap
        lse = torch.logsumexp(logits, dim=-1)
        chosen = logits.gather(-1, targets[i:i + _LM_HEAD_CHUNK, None].to(logits.device))[:, 0]
        logp[i:i + _LM_HEAD_CHUNK] = (chosen - lse).cpu()
    sums = [[0.0] * len(s) for s in spans]
    for value, (r, s) in zip(logp.tolist(), owners, strict=True):
        sums[r][s] += value
    return sums


def verify_batch(lm: LM, question: str, drafts: Sequence[tuple[str, str]]
                 ) -> tuple[list[tuple[float, float, int]], int]:
    """(log ρ_SC, log ρ_SR, tokens under ρ_SC) per (rationale, answer) draft from ONE forward;
    also the number of tokens scored."""
    rows, sc_spans, yes_spans = verifier_rows(lm, question, drafts)
    if getattr(lm, "served", False):  # a RemoteLM: ONE scoring request, no generation
        lm.require("batched_scoring", by="Speculative RAG's verifier")
        scored = lm.score_rows(rows)
        sums = [[sum(lp[t] for t in range(max(start, 1), end)) for start, end in (sc, yes)]
                for lp, sc, yes in zip(scored, sc_spans, yes_spans, strict=True)]
        return ([(s[0], s[1], end - start) for s, (start, end) in zip(sums, sc_spans, strict=True)],
                sum(len(r) for r in rows))
    spans = [[sc, yes] for sc, yes in zip(sc_spans, yes_spans, strict=True)]
    by_spans = getattr(lm, "span_logprobs", None)
    if by_spans is not None:  # llama.cpp: every row a sequence, logits only where scored
        sums = by_spans(rows, spans)
        return ([(s[0], s[1], end - start) for s, (start, end) in zip(sums, sc_spans, strict=True)],
                sum(len(r) for r in rows))
    import torch

    width = max(len(r) for r in rows)
    pad_id = lm.tokenizer.pad_token_id or 0
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):  # right padding: real tokens keep their natural positions
        ids[i, :len(row)] = torch.tensor(row)
        mask[i, :len(row)] = 1
    with torch.inference_mode():
        hidden = lm.model.get_decoder()(input_ids=ids.to(lm.device),
                                        attention_mask=mask.to(lm.device)).last_hidden_state
        sums = _span_logprobs(lm, hidden, ids.to(lm.device), spans)
    return ([(s[0], s[1], end - start) for s, (start, end) in zip(sums, sc_spans, strict=True)],
            int(mask.sum()))


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
