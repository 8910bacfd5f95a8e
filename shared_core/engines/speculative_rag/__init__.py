"""Speculative RAG (Wang et al. 2024, arXiv 2407.08223): drafts from a small model, one verifier pass.

The pipeline for one question, with the paper's symbols:

1. **Multi-perspective sampling.** The retrieved documents are embedded with an
   instruction-aware embedding (the question is prepended as an instruction, which is how a plain
   sentence embedder such as MiniLM can be made question-aware), clustered with K-means into
   ``k = docs_per_draft`` clusters, and ``m = num_drafts`` distinct subsets are built, each taking
   one document from every cluster (least-used documents first, seeded ties).
2. **Drafting.** The drafter writes a rationale β and an answer α for every subset; the m drafts
   are generated as ONE left-padded batch with a per-row stop (the end of the ``Answer:`` line).
   ρ_draft = P_drafter(β, α | Q, subset), the drafter's probability of its own greedy output.
3. **Verification.** The verifier (any causal LM; its tokenizer may differ from the drafter's)
   scores every draft in ONE right-padded forward over the sequences
   ``Question: Q / Answer: α / Rationale: β / R / Yes``:
   ρ_SC = P(α, β | Q) (self-containment) and ρ_SR = P("Yes" | Q, α, β, R) (self-reflection, R =
   "Do you think the rationale supports the answer, yes or no?"). Only the two scored spans go
   through the LM head. The question prefix is a handful of tokens, so it is recomputed per row
   rather than shared through a KV cache (no measurable gain at this size).
4. **Selection.** score = log ρ_draft + log ρ_SC + log ρ_SR (the product in log space, not
   length-normalised, as in the paper); the best draft's answer is returned with every draft,
   its subset and its three scores. Switches turn each score off or select at random (ablation).
   Two options go beyond the paper (both off by default): ``length_normalize`` divides log ρ_draft
   and log ρ_SC by their token counts (a sum of log-probabilities favours short, evasive drafts),
   and ``selection="vote"`` returns the answer that most drafts agree on (self-consistency, Wang
   et al. 2023; normalised as SQuAD does), ties broken by the score.

:meth:`SpeculativeRAG.stages` runs the round as typed events (:mod:`.events`: documents
retrieved, subsets sampled, drafts written, drafts verified, then ``Answered`` with the result),
each model's lock held within one stage; :meth:`SpeculativeRAG.answer` reads it to the end (its
``on_event(name, data)`` hook sees each stage). :meth:`SpeculativeRAG.standard_rag` is the
paper's "Standard RAG" baseline: one model, every retrieved document in its prompt, the same
answer parsing.

**Draft order and parsing.** Drafts are answer-first by default (``draft_order="answer_first"``,
:func:`parse_answer_first`): the prompt prefills ``Answer:``, so every draft has its answer line,
and a draft reads ``Answer: … Rationale: …``; the answer is its first line, cut at a
``Rationale:`` marker on that line, and it is clean only when that marker is there. The paper's
order, ``draft_order="rationale_first"``, reached an ``Answer:`` line in 1% of SmolLM2-135M
drafts and half of Qwen2.5-0.5B's (the default's numbers: ``SpeculativeRAGConfig.draft_order``);
it is the format of the shipped LoRA drafter (``TUNED_DRAFT_ORDER``). Its drafts should read
``Rationale: … Answer: …``, and :func:`parse_draft` falls back in a fixed order, each result
recording whether it needed to (counted in ``stats.parse_fallbacks``): (a) an ``Answer:`` marker
with text after it is the normal case; (b) a marker followed by an empty line takes the next
non-empty line; (c) with no marker the first sentence of the text is the answer and the whole
text is the rationale.
"""

from __future__ import annotations

from shared_core.config.rag import EMBED_INSTRUCTION, SpeculativeRAGConfig, SubsetStrategy

# One module per step; every public name is re-exported here (the package's API).
from shared_core.engines.speculative_rag.engine import EventHook, SpeculativeRAG
from shared_core.engines.speculative_rag.events import (
    Answered,
    DocumentsRetrieved,
    DraftsVerified,
    DraftsWritten,
    SpeculativeRAGEvent,
    StageEvent,
    SubsetsSampled,
)
from shared_core.engines.speculative_rag.generation import force_answer_lines, generate_batch
from shared_core.engines.speculative_rag.inputs import check_inputs, check_model_name, usable_documents
from shared_core.engines.speculative_rag.prompts import (
    DRAFT_INSTRUCTION,
    DRAFT_INSTRUCTION_ANSWER_FIRST,
    RAG_INSTRUCTION,
    REFLECTION,
    draft_prompt,
    parse_answer_first,
    parse_draft,
    rag_prompt,
    render_prompt,
)
from shared_core.engines.speculative_rag.results import (
    AnswerDraft,
    RAGStats,
    SpeculativeRAGResult,
    SpeculativeRAGStats,
    StandardRAGResult,
    StandardRAGStats,
)
from shared_core.engines.speculative_rag.scoring import (
    combined_score,
    normalize_answer,
    select_best,
    verifier_rows,
    verify_batch,
)
from shared_core.engines.speculative_rag.standard import standard_rag
from shared_core.engines.speculative_rag.subsets import (
    MAX_ENUMERATED_SUBSETS,
    embed_for_question,
    kmeans_labels,
    one_per_cluster_subsets,
    same_cluster_subsets,
)
from shared_core.retrieval.frameworks import (
    check_document_list,
    check_retriever,
    retrieve,
    to_documents,
)

# a second public name of AnswerDraft, for imports that use it (a token drafter's proposal is
# shared_core.drafters.base.Draft)
Draft = AnswerDraft

__all__ = [
    "DRAFT_INSTRUCTION",
    "DRAFT_INSTRUCTION_ANSWER_FIRST",
    "EMBED_INSTRUCTION",
    "MAX_ENUMERATED_SUBSETS",
    "RAG_INSTRUCTION",
    "REFLECTION",
    "AnswerDraft",
    "Answered",
    "DocumentsRetrieved",
    "Draft",
    "DraftsVerified",
    "DraftsWritten",
    "EventHook",
    "RAGStats",
    "SpeculativeRAG",
    "SpeculativeRAGConfig",
    "SpeculativeRAGEvent",
    "SpeculativeRAGResult",
    "SpeculativeRAGStats",
    "StageEvent",
    "StandardRAGResult",
    "StandardRAGStats",
    "SubsetStrategy",
    "SubsetsSampled",
    "check_document_list",
    "check_inputs",
    "check_model_name",
    "check_retriever",
    "combined_score",
    "draft_prompt",
    "embed_for_question",
    "force_answer_lines",
    "generate_batch",
    "kmeans_labels",
    "normalize_answer",
    "one_per_cluster_subsets",
    "parse_answer_first",
    "parse_draft",
    "rag_prompt",
    "render_prompt",
    "retrieve",
    "same_cluster_subsets",
    "select_best",
    "standard_rag",
    "to_documents",
    "usable_documents",
    "verifier_rows",
    "verify_batch",
]
