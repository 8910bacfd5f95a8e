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

:meth:`SpeculativeRAG.standard_rag` is the paper's "Standard RAG" baseline: one model, every
retrieved document in its prompt, the same answer parsing.

**Parsing.** A draft should read ``Rationale: … Answer: …``. A 135M model sometimes slips, so
:func:`parse_draft` falls back in a fixed order, and each result records whether it needed to
(counted in ``stats.parse_fallbacks``): (a) an ``Answer:`` marker with text after it is the normal
case; (b) a marker followed by an empty line takes the next non-empty line; (c) with no marker the
first sentence of the text is the answer and the whole text is the rationale.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import re
import string
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from shared_core.config import DEFAULT_EMBEDDER, DEFAULT_LM, DEFAULT_VERIFIER, check_int
from shared_core.rag_config import EMBED_INSTRUCTION as EMBED_INSTRUCTION  # re-exported
from shared_core.rag_config import DraftOrder, Selection, SpeculativeRAGConfig
from shared_core.rag_config import SubsetStrategy as SubsetStrategy  # re-exported
from shared_core.retrieval.base import Document

if TYPE_CHECKING:
    import numpy as np
    import torch

    from shared_core.models import LM

logger = logging.getLogger(__name__)

EventHook = Callable[[str, dict[str, Any]], None]

# No "<placeholder>" formats: a 135M drafter copied "<short answer>" verbatim into 1 draft in 4
DRAFT_INSTRUCTION = (
    "Answer the question using the documents. First write a one-sentence rationale based on the "
    "documents after 'Rationale:', then a short answer of a few words after 'Answer:'."
)
# answer_first drafts (draft_order="answer_first"): the answer line cannot go missing
DRAFT_INSTRUCTION_ANSWER_FIRST = (
    "Answer the question using the documents. First write a short answer of a few words after "
    "'Answer:', then a one-sentence rationale based on the documents after 'Rationale:'."
)
RAG_INSTRUCTION = "Answer the question using the documents. Give a short answer of a few words."
REFLECTION = "Do you think the rationale supports the answer, yes or no?"
MAX_ENUMERATED_SUBSETS = 4096  # enumerate all one-per-cluster subsets up to this many
_LM_HEAD_CHUNK = 64  # positions per LM-head call when scoring spans (bounds memory)


@dataclass
class SpeculativeRAGStats:
    """Counters and stage timings of one answer (plain numbers only)."""

    num_documents: int = 0
    num_drafts: int = 0
    docs_per_draft: int = 0
    cluster_sizes: list[int] = field(default_factory=list)
    relaxed_subsets: int = 0  # subsets that could not take one document per cluster
    skipped_documents: int = 0  # documents without text, left out of every subset
    answer_continuations: int = 0  # drafts that needed a forced "Answer:" step
    parse_fallbacks: int = 0
    draft_prompt_tokens: int = 0
    draft_new_tokens: int = 0
    verify_tokens: int = 0
    retrieve_s: float = 0.0
    sample_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Draft:
    """One drafted (rationale, answer) with its subset and log-scores (``None`` = not computed)."""

    answer: str
    rationale: str
    raw: str
    doc_ids: tuple[str, ...]
    doc_indices: tuple[int, ...]
    parsed: bool
    log_draft: float
    log_self_contain: float | None = None
    log_self_reflect: float | None = None
    score: float = 0.0
    draft_tokens: int = 0  # tokens under log ρ_draft
    self_contain_tokens: int = 0  # verifier tokens under log ρ_SC

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class SpeculativeRAGResult:
    """The selected answer, every draft and the documents (no tensors)."""

    text: str
    rationale: str
    best: int
    drafts: tuple[Draft, ...]
    documents: tuple[Document, ...]
    stats: SpeculativeRAGStats

    @property
    def answer(self) -> str:
        return self.text


@dataclass
class StandardRAGStats:
    num_documents: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0
    parse_fallbacks: int = 0
    retrieve_s: float = 0.0
    generate_s: float = 0.0
    total_s: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class StandardRAGResult:
    text: str
    raw: str
    documents: tuple[Document, ...]
    stats: StandardRAGStats

    @property
    def answer(self) -> str:
        return self.text


# --------------------------------------------------------------------------- inputs


def to_documents(items: Sequence[Any]) -> list[Document]:
    """Convert strings, our Documents/Hits, LangChain Documents or LlamaIndex nodes to Documents."""
    check_document_list(items)
    docs: list[Document] = []
    for i, item in enumerate(items):
        if isinstance(item, Document):
            docs.append(item)
        elif isinstance(item, str):
            docs.append(Document(id=f"doc-{i}", text=item))
        elif hasattr(item, "document") and isinstance(item.document, Document):  # our Hit
            docs.append(item.document)
        elif hasattr(item, "page_content"):  # LangChain Document
            doc_id = getattr(item, "id", None) or f"doc-{i}"
            docs.append(Document(id=str(doc_id), text=item.page_content,
                                 metadata=dict(item.metadata or {})))
        elif hasattr(item, "node") and hasattr(item.node, "get_content"):  # LlamaIndex NodeWithScore
            meta = dict(item.node.metadata or {})
            meta["score"] = item.score
            docs.append(Document(id=item.node.node_id, text=item.node.get_content(), metadata=meta))
        elif hasattr(item, "get_content"):  # LlamaIndex node
            docs.append(Document(id=item.node_id, text=item.get_content(),
                                 metadata=dict(item.metadata or {})))
        else:
            msg = f"documents[{i}] has unsupported type {type(item).__name__}"
            raise TypeError(msg)
    return docs


def check_retriever(retriever: Any) -> None:
    if not any(callable(getattr(retriever, m, None)) for m in ("search", "invoke", "retrieve")):
        msg = f"retriever of type {type(retriever).__name__} has no search/invoke/retrieve method"
        raise TypeError(msg)


def retrieve(retriever: Any, question: str, k: int) -> list[Document]:
    """Top-k documents from our Retriever, a LangChain retriever or a LlamaIndex retriever."""
    check_retriever(retriever)
    check_int(k, "k")
    name = type(retriever).__name__
    if callable(getattr(retriever, "search", None)):
        rows = retriever.search([question], k)
        if isinstance(rows, (str, dict)) or not isinstance(rows, Sequence) or len(rows) != 1:
            msg = (f"retriever {name}.search returned {type(rows).__name__} for 1 query; "
                   "expected list[list[Hit]] with one row")
            raise TypeError(msg)
        return _converted(rows[0], name)
    if callable(getattr(retriever, "invoke", None)):
        return _converted(retriever.invoke(question), name)[:k]
    return _converted(retriever.retrieve(question), name)[:k]


def _converted(items: Any, name: str) -> list[Document]:
    try:
        return to_documents(items)
    except TypeError as e:
        msg = f"retriever {name} returned an unusable result: {e}"
        raise TypeError(msg) from None


def check_document_list(documents: Any) -> None:
    """``documents`` is a list/tuple of items, not one string, one document or a mapping."""
    if isinstance(documents, (str, bytes, dict, Document)) or not isinstance(documents, Sequence):
        msg = (f"documents must be a list of documents (strings, Documents, LangChain Documents "
               f"or LlamaIndex nodes), got {type(documents).__name__}")
        raise TypeError(msg)


def drop_blank(docs: Sequence[Document]) -> tuple[list[Document], int]:
    """Documents with text (a blank one would let a draft answer from nothing), and how many
    were left out; ValueError when none has text."""
    kept = [d for d in docs if d.text.strip()]
    if docs and not kept:
        msg = (f"documents: all {len(docs)} documents have empty text; there is nothing to "
               "answer from")
        raise ValueError(msg)
    if len(kept) < len(docs):
        logger.warning("left out %d documents with empty text", len(docs) - len(kept))
    return kept, len(docs) - len(kept)


def check_inputs(question: Any, documents: Sequence[Any] | None, config: SpeculativeRAGConfig,
                 *, need_subsets: bool = True) -> str:
    """Validate before any model work; return the stripped question."""
    if not isinstance(question, str):
        msg = f"question must be a str, got {type(question).__name__}"
        raise TypeError(msg)
    if not question.strip():
        msg = "question must be a non-empty string"
        raise ValueError(msg)
    if documents is not None:
        check_document_list(documents)
    if documents is not None and len(documents) == 0:
        msg = "documents is empty: pass at least one document or a retriever that returns some"
        raise ValueError(msg)
    if need_subsets and documents is not None:
        needed = config.num_drafts * config.docs_per_draft
        if needed > len(documents):
            msg = (f"num_drafts * docs_per_draft = {config.num_drafts} * {config.docs_per_draft} = "
                   f"{needed} exceeds the {len(documents)} documents; lower num_drafts or "
                   "docs_per_draft, or pass more documents (retrieve_k)")
            raise ValueError(msg)
    return question.strip()


# --------------------------------------------------------------------------- 1. subsets


def embed_for_question(embedder: Any, question: str, docs: Sequence[Document],
                       instruction: str) -> np.ndarray:
    """Instruction-aware document embeddings: the question is the instruction prefix."""
    import numpy as np

    prefix = instruction.format(question=question)
    vectors = embedder.encode([prefix + d.text for d in docs], normalize_embeddings=True,
                              show_progress_bar=False)
    return np.ascontiguousarray(vectors, dtype=np.float32)


def kmeans_labels(vectors: np.ndarray, k: int, seed: int, iters: int = 25) -> list[int]:
    """K-means cluster ids (faiss, seeded; a single cluster needs no clustering)."""
    if k == 1:
        return [0] * len(vectors)
    import faiss

    km = faiss.Kmeans(vectors.shape[1], k, niter=iters, seed=seed, nredo=3, verbose=False,
                      min_points_per_centroid=1, spherical=True)
    km.train(vectors)
    _, labels = km.index.search(vectors, 1)
    return [int(x) for x in labels[:, 0]]


def _pick_least_used(candidates: list[tuple[int, ...]], m: int) -> list[tuple[int, ...]]:
    """Greedily take m candidates, each time the one whose documents were used least so far;
    ties go to the better-ranked documents (lower indices: documents arrive in retrieval order),
    so the retriever's top document is never the one left out of every draft."""
    uses: dict[int, int] = {}
    chosen: list[tuple[int, ...]] = []
    pool = list(candidates)
    while pool and len(chosen) < m:
        best = min(range(len(pool)),
                   key=lambda i: (sum(uses.get(d, 0) for d in pool[i]), sorted(pool[i])))
        subset = pool.pop(best)
        chosen.append(subset)
        for d in subset:
            uses[d] = uses.get(d, 0) + 1
    return chosen


def _random_subsets(n: int, k: int, m: int, rng: random.Random,
                    exclude: set[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """Up to m distinct sorted k-subsets of range(n), none in ``exclude``."""
    total = math.comb(n, k)
    out: list[tuple[int, ...]] = []
    seen = set(exclude)
    if total <= MAX_ENUMERATED_SUBSETS:
        pool = [c for c in itertools.combinations(range(n), k) if c not in seen]
        rng.shuffle(pool)
        return _pick_least_used(pool, m)
    while len(out) < m:
        subset = tuple(sorted(rng.sample(range(n), k)))
        if subset not in seen:
            seen.add(subset)
            out.append(subset)
    return out


def one_per_cluster_subsets(labels: Sequence[int], k: int, m: int,
                            rng: random.Random) -> tuple[list[tuple[int, ...]], int]:
    """m distinct subsets, each one document per cluster; returns (subsets, relaxed count).

    When the clusters allow fewer than m distinct one-per-cluster subsets (e.g. a cluster of one
    document), the rest are distinct random subsets, counted as relaxed.
    """
    clusters = [[i for i, c in enumerate(labels) if c == cid] for cid in sorted(set(labels))]
    n_combos = math.prod(len(c) for c in clusters)
    if len(clusters) < k:
        n_combos = 0
    if 0 < n_combos <= MAX_ENUMERATED_SUBSETS:
        pool = [tuple(sorted(c)) for c in itertools.product(*clusters)]
    elif n_combos:
        pool = list({tuple(sorted(rng.choice(c) for c in clusters))
                     for _ in range(MAX_ENUMERATED_SUBSETS)})
    else:
        pool = []
    rng.shuffle(pool)
    subsets = _pick_least_used(pool, m)
    relaxed = m - len(subsets)
    if relaxed:
        subsets += _random_subsets(len(labels), k, relaxed, rng, set(subsets))
    return subsets, relaxed


def same_cluster_subsets(labels: Sequence[int], k: int, m: int,
                         rng: random.Random) -> tuple[list[tuple[int, ...]], int]:
    """Ablation: every subset drawn from inside a single cluster (the opposite of diversity)."""
    clusters = [[i for i, c in enumerate(labels) if c == cid] for cid in sorted(set(labels))]
    pool = [tuple(sorted(s)) for c in clusters if len(c) >= k
            for s in itertools.combinations(c, k)]
    rng.shuffle(pool)
    subsets = _pick_least_used(pool, m)
    relaxed = m - len(subsets)
    if relaxed:
        subsets += _random_subsets(len(labels), k, relaxed, rng, set(subsets))
    return subsets, relaxed


# --------------------------------------------------------------------------- parsing

_ANSWER_MARK = re.compile(r"\banswer\s*(?:is)?\s*[:：]", re.IGNORECASE)
_RATIONALE_MARK = re.compile(r"^\s*rationale\s*[:：]\s*", re.IGNORECASE)
_ANSWER_LINE_DONE = re.compile(r"\banswer\s*(?:is)?\s*[:：][^\n]*\S[^\n]*\n", re.IGNORECASE)
# answer-first drafts end with their one rationale sentence (a newline or a sentence end)
_RATIONALE_DONE = re.compile(r"\brationale\s*[:：]\s*\S[^\n]*?(?:\n|[.!?]$)", re.IGNORECASE)


def _clean_answer(text: str) -> str:
    text = re.sub(r"^\s*(?:the\s+)?answer\s+is\s*[:：]?", "", text, flags=re.IGNORECASE)
    text = text.strip().strip("\"'“”*").strip()
    return text.rstrip(".").strip()


def _first_sentence(text: str) -> str:
    line = next((ln for ln in text.splitlines() if ln.strip()), "")
    return re.split(r"(?<=[.!?])\s", line.strip(), maxsplit=1)[0]


def parse_answer_first(text: str) -> tuple[str, str, bool]:
    """(rationale, answer, parsed_cleanly) from ``Answer: … Rationale: …`` (answer-first drafts).

    The answer is the first non-empty line after ``Answer:`` (always present: it is prefilled);
    the rationale follows a ``Rationale:`` marker, else it is the rest of the text (not clean).
    """
    body = _ANSWER_MARK.sub("", text, count=1)
    lines = [ln for ln in body.splitlines() if ln.strip()]
    answer = _clean_answer(lines[0]) if lines else ""
    rest = "\n".join(lines[1:])
    marked = re.search(r"\brationale\s*[:：]", rest, re.IGNORECASE)
    if marked is not None:
        return rest[marked.end():].strip(), answer, bool(answer)
    return rest.strip(), answer, False


def parse_draft(text: str) -> tuple[str, str, bool]:
    """(rationale, answer, parsed_cleanly) from ``Rationale: … Answer: …`` (fallbacks: module doc)."""
    match = _ANSWER_MARK.search(text)
    if match is not None:
        rationale = _RATIONALE_MARK.sub("", text[:match.start()]).strip()
        after = text[match.end():]
        lines = [ln for ln in after.splitlines()]
        if lines and lines[0].strip():
            return rationale, _clean_answer(lines[0]), True
        rest = next((ln for ln in lines if ln.strip()), "")
        return rationale, _clean_answer(rest or rationale), False
    rationale = _RATIONALE_MARK.sub("", text).strip()
    return rationale, _clean_answer(_first_sentence(rationale)), False


# --------------------------------------------------------------------------- prompts


def _format_docs(docs: Sequence[Document]) -> str:
    return "\n".join(f"Document [{i + 1}]: {' '.join(d.text.split())}" for i, d in enumerate(docs))


def render_prompt(lm: LM, body: str, prefill: str) -> list[int]:
    """Token ids of ``body`` as a user turn (chat models) or plain text (base models) + prefill."""
    if lm.has_chat_template:
        text = lm.chat_prompt([{"role": "user", "content": body}]) + prefill
        return lm.encode(text, add_special_tokens=False)
    return lm.prompt_ids(f"{body}\n\n{prefill}")


def draft_prompt(lm: LM, question: str, docs: Sequence[Document],
                 order: DraftOrder = "rationale_first") -> list[int]:
    instruction, prefill = ((DRAFT_INSTRUCTION, "Rationale:") if order == "rationale_first"
                            else (DRAFT_INSTRUCTION_ANSWER_FIRST, "Answer:"))
    return render_prompt(lm, f"{_format_docs(docs)}\n\nQuestion: {question}\n\n{instruction}",
                         prefill)


def rag_prompt(lm: LM, question: str, docs: Sequence[Document]) -> list[int]:
    return render_prompt(lm, f"{RAG_INSTRUCTION}\n\n{_format_docs(docs)}\n\nQuestion: {question}",
                         "Answer:")


def _check_length(lm: LM, ids: Sequence[int], budget: int, what: str) -> None:
    if len(ids) + budget > lm.max_context:
        msg = (f"{what} has {len(ids)} tokens + {budget} new tokens, more than {lm.name}'s "
               f"{lm.max_context}-token window; pass fewer or shorter documents")
        raise ValueError(msg)


# --------------------------------------------------------------------------- 2. drafting


def _left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
        mask[i, width - len(row):] = 1
    return ids, mask


def _stop_criteria(lm: LM, prompt_len: int, prefill: str, done_pattern: re.Pattern[str] | None,
                   lengths: list[int]) -> Any:
    """Per-row stop: EOS, or ``done_pattern`` found in the text (e.g. a completed ``Answer: …``
    line); records each row's length."""
    import torch
    from transformers import StoppingCriteria

    eos = set(lm.eos_token_ids)

    class _Stop(StoppingCriteria):
        def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
            new = input_ids[:, prompt_len:]
            done = []
            for row in range(new.shape[0]):
                if lengths[row] < 0:
                    hit_eos = int(new[row, -1]) in eos
                    text = prefill + lm.tokenizer.decode(new[row], skip_special_tokens=True)
                    line_done = done_pattern is not None and done_pattern.search(text)
                    if hit_eos or line_done:
                        lengths[row] = new.shape[1]
                done.append(lengths[row] >= 0)
            return torch.tensor(done, dtype=torch.bool, device=input_ids.device)

    return _Stop()


def generate_batch(lm: LM, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
                   prefill: str = "", stop_on_answer_line: bool = True,
                   answer_first: bool = False
                   ) -> list[tuple[list[int], list[float]]]:
    """Greedy-generate all rows in ONE left-padded batch; per row (new ids, log P of each).

    Log-probabilities come from the model's raw (unprocessed) distribution, for the row's own
    tokens up to and including its stop token.
    """
    import torch

    pad_id = lm.tokenizer.pad_token_id
    pad_id = pad_id if pad_id is not None else next(iter(lm.eos_token_ids), 0)
    ids, mask = _left_pad(prompts, pad_id)
    lengths = [-1] * len(prompts)
    pattern = (_RATIONALE_DONE if answer_first else _ANSWER_LINE_DONE) if stop_on_answer_line else None
    stop = _stop_criteria(lm, ids.shape[1], prefill, pattern, lengths)
    with torch.inference_mode():
        out = lm.model.generate(
            input_ids=ids.to(lm.device), attention_mask=mask.to(lm.device),
            max_new_tokens=max_new_tokens, do_sample=False, temperature=None, top_p=None,
            top_k=None, pad_token_id=pad_id, stopping_criteria=[stop], output_logits=True,
            return_dict_in_generate=True)
        new = out.sequences[:, ids.shape[1]:]  # [B, T]
        logits = torch.stack(out.logits, dim=1).float()  # [B, T, V]
        logp = torch.log_softmax(logits, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
    results = []
    for row in range(len(prompts)):
        n = lengths[row] if lengths[row] >= 0 else new.shape[1]
        results.append((new[row, :n].tolist(), logp[row, :n].tolist()))
    return results


# --------------------------------------------------------------------------- 3. verification


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
    import torch

    rows, sc_spans, yes_spans = verifier_rows(lm, question, drafts)
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
        spans = [[sc, yes] for sc, yes in zip(sc_spans, yes_spans, strict=True)]
        sums = _span_logprobs(lm, hidden, ids.to(lm.device), spans)
    return ([(s[0], s[1], end - start) for s, (start, end) in zip(sums, sc_spans, strict=True)],
            int(mask.sum()))


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


def combined_score(draft: Draft, config: SpeculativeRAGConfig) -> float:
    """log ρ_draft + log ρ_SC + log ρ_SR with the config's switches (missing scores count 0)."""
    def part(logp: float | None, tokens: int) -> float:
        if logp is None:
            return 0.0
        return logp / max(tokens, 1) if config.length_normalize else logp

    return ((part(draft.log_draft, draft.draft_tokens) if config.use_draft_score else 0.0)
            + (part(draft.log_self_contain, draft.self_contain_tokens)
               if config.use_self_contain else 0.0)
            + (part(draft.log_self_reflect, 1) if config.use_self_reflect else 0.0))


def select_best(drafts: Sequence[Draft], selection: Selection, rng: random.Random) -> int:
    """Index of the selected draft: highest score (first on ties), the best-scored draft of the
    answer most drafts agree on (``"vote"``; empty answers get no votes), or a seeded random one."""
    if selection == "random":
        return rng.randrange(len(drafts))
    if selection == "vote":
        answers = [normalize_answer(d.answer) for d in drafts]
        votes = Counter(a for a in answers if a)
        return max(range(len(drafts)), key=lambda i: (votes[answers[i]], drafts[i].score, -i))
    return max(range(len(drafts)), key=lambda i: (drafts[i].score, -i))


# --------------------------------------------------------------------------- engine


def _load(model: LM | str, dtype: str | None) -> LM:
    if not isinstance(model, str):
        return model
    if model.endswith("+specrag"):
        from shared_core.drafters.lora import load_tuned_drafter

        return load_tuned_drafter(model, dtype)
    from shared_core.model_cache import cached_lm

    return cached_lm(model, dtype=dtype)  # one copy per process, shared with other engines


def check_model_name(name: Any, param: str) -> None:
    """Reject unknown aliases before loading anything."""
    if not isinstance(name, str):
        return
    from shared_core.models import EMBEDDED_LMS

    base = name.removesuffix("+specrag")
    if name.endswith("+specrag"):
        from shared_core.drafters.lora import ADAPTERS

        if name not in ADAPTERS:
            msg = f"{param}={name!r}: no tuned adapter; known: {', '.join(sorted(ADAPTERS))}"
            raise ValueError(msg)
    if base in EMBEDDED_LMS or "/" in base or base.startswith((".", "~")):
        return
    known = ", ".join(sorted(EMBEDDED_LMS))
    msg = (f"{param}={name!r} is not a known model alias; use one of {known}, a Hugging Face id "
           "(org/name), a local folder or an LM object")
    raise ValueError(msg)


# Plain values that can be neither a model name nor a model object (models are duck-typed
# and touched lazily, so only these are refused up front).
_NOT_MODELS = (bool, int, float, complex, bytes, list, tuple, dict, set)


def _check_model_arg(model: Any, param: str, *, optional: bool) -> None:
    if model is None and not optional:
        msg = f"{param} must be a model name or an LM, got None"
        raise TypeError(msg)
    if isinstance(model, _NOT_MODELS):
        msg = (f"{param} must be a model name or an LM{' or None' if optional else ''}, "
               f"got {type(model).__name__}")
        raise TypeError(msg)


class SpeculativeRAG:
    """Speculative RAG: parallel drafts from a small drafter, one batched verifier pass.

    Args:
        drafter: an :class:`~shared_core.models.LM` or a name for :func:`load_lm` (default the
            embedded SmolLM2-135M-Instruct; ``"smollm2-135m-instruct+specrag"`` adds the shipped
            LoRA adapter tuned as a RAG drafter).
        verifier: an LM or a name (default the embedded Gemma-3-270M base model); ``None`` is
            allowed when the config needs no verifier (drafter-only or random selection).
        embedder: a sentence-transformers model or alias for instruction-aware clustering.
        retriever: optional default retriever (ours, LangChain or LlamaIndex).
        config: :class:`SpeculativeRAGConfig`.
        dtype: dtype for models given by name (``None``: the device default, fp32 on CPU).
            ``"bfloat16"`` roughly halves latency on CPUs with AMX/AVX-512-BF16, because drafting
            and verification are mostly prompt processing (measured in the benchmark).

    Models load lazily on first use; names are validated immediately.
    """

    def __init__(self, drafter: LM | str = DEFAULT_LM, verifier: LM | str | None = DEFAULT_VERIFIER,
                 *, embedder: Any = DEFAULT_EMBEDDER,
                 retriever: Any = None, config: SpeculativeRAGConfig | None = None,
                 dtype: str | None = None) -> None:
        _check_model_arg(drafter, "drafter", optional=False)
        _check_model_arg(verifier, "verifier", optional=True)
        check_model_name(drafter, "drafter")
        check_model_name(verifier, "verifier")
        _check_model_arg(embedder, "embedder", optional=False)
        if retriever is not None:
            check_retriever(retriever)
        if config is not None and not isinstance(config, SpeculativeRAGConfig):
            msg = f"config must be a SpeculativeRAGConfig or None, got {type(config).__name__}"
            raise TypeError(msg)
        if dtype is not None and not isinstance(dtype, str):
            msg = f"dtype must be None or a dtype name such as 'bfloat16', got {dtype!r}"
            raise TypeError(msg)
        if dtype is not None:
            from shared_core.device import resolve_device, resolve_dtype

            resolve_dtype(dtype, resolve_device("cpu"))  # a bad dtype fails before any loading
        self.dtype = dtype
        self.config = config or SpeculativeRAGConfig()
        self.retriever = retriever
        self._drafter_src, self._verifier_src, self._embedder_src = drafter, verifier, embedder
        self._models: dict[str, Any] = {}
        self._lock = threading.RLock()

    def with_config(self, config: SpeculativeRAGConfig) -> SpeculativeRAG:
        """A new engine with another config that shares this one's (loaded) models and lock."""
        if not isinstance(config, SpeculativeRAGConfig):
            msg = f"config must be a SpeculativeRAGConfig, got {type(config).__name__}"
            raise TypeError(msg)
        other = SpeculativeRAG.__new__(SpeculativeRAG)
        other.__dict__.update(self.__dict__)
        other.config = config
        return other

    # -- lazily loaded models
    def _get(self, role: str) -> Any:
        with self._lock:
            if role not in self._models:
                src = {"drafter": self._drafter_src, "verifier": self._verifier_src,
                       "embedder": self._embedder_src}[role]
                if src is None:
                    msg = f"{role} is None but this configuration needs it"
                    raise ValueError(msg)
                if role == "embedder":
                    from shared_core.models import load_embedder

                    self._models[role] = load_embedder(src) if isinstance(src, str) else src
                else:
                    self._models[role] = _load(src, self.dtype)
            return self._models[role]

    @property
    def drafter(self) -> LM:
        return self._get("drafter")

    @property
    def verifier(self) -> LM:
        return self._get("verifier")

    @property
    def embedder(self) -> Any:
        return self._get("embedder")

    def _documents(self, question: str, documents: Sequence[Any] | None, retriever: Any,
                   k: int) -> tuple[list[Document], int, float]:
        """(documents with text, how many blank ones were left out, retrieval seconds)."""
        start = time.perf_counter()
        if documents is None:
            source = retriever if retriever is not None else self.retriever
            if source is None:
                msg = "documents is None and no retriever was given: pass documents or retriever"
                raise ValueError(msg)
            documents = retrieve(source, question, k)
            if not documents:
                msg = "documents is empty: the retriever returned no documents"
                raise ValueError(msg)
        docs, skipped = drop_blank(to_documents(documents))
        return docs, skipped, time.perf_counter() - start

    def _check_call(self, question: Any, documents: Sequence[Any] | None, retriever: Any,
                    need_subsets: bool) -> str:
        """Everything checkable before the lock and any model work; the stripped question."""
        question = check_inputs(question, documents, self.config, need_subsets=False)
        if retriever is not None:
            check_retriever(retriever)
        if documents is not None:
            docs, _ = drop_blank(to_documents(documents))
            check_inputs(question, docs, self.config, need_subsets=need_subsets)
        return question

    # -- 1. multi-perspective sampling
    def sample_subsets(self, question: str, docs: Sequence[Document],
                       stats: SpeculativeRAGStats | None = None) -> list[tuple[int, ...]]:
        """m distinct document-index subsets of size k per ``config.subset_strategy``."""
        cfg = self.config
        rng = random.Random(f"{cfg.seed}:{question}")
        if cfg.subset_strategy == "random":
            subsets, relaxed, labels = _random_subsets(len(docs), cfg.docs_per_draft,
                                                       cfg.num_drafts, rng, set()), 0, []
        else:
            vectors = embed_for_question(self.embedder, question, docs, cfg.embed_instruction)
            labels = kmeans_labels(vectors, cfg.docs_per_draft, cfg.seed, cfg.kmeans_iters)
            build = one_per_cluster_subsets if cfg.subset_strategy == "cluster" else same_cluster_subsets
            subsets, relaxed = build(labels, cfg.docs_per_draft, cfg.num_drafts, rng)
        if stats is not None:
            stats.relaxed_subsets = relaxed
            stats.cluster_sizes = sorted((labels.count(c) for c in set(labels)), reverse=True)
        return subsets

    # -- 2. drafting
    def draft(self, question: str, docs: Sequence[Document], subsets: Sequence[tuple[int, ...]],
              stats: SpeculativeRAGStats) -> list[Draft]:
        """Batched drafting of (rationale, answer) for every subset in one generate.

        A small drafter often stops after its rationale. With ``force_answer_line`` those rows
        are continued with a forced ``\nAnswer:`` (one more batched generate over just those
        rows; ρ_draft then covers the drafter's own tokens, not the forced marker or the dropped
        EOS). Off by default: on SmolLM2-135M it doubled drafting time and the forced answers
        mostly restated the rationale, so parse fallback (c) is used instead.
        """
        lm, cfg = self.drafter, self.config
        answer_first = cfg.draft_order == "answer_first"
        prefill, parse = ("Answer:", parse_answer_first) if answer_first else ("Rationale:", parse_draft)
        prompts = [draft_prompt(lm, question, [docs[i] for i in s], cfg.draft_order) for s in subsets]
        for p in prompts:
            _check_length(lm, p, cfg.max_draft_tokens + cfg.max_answer_tokens, "a draft prompt")
        rows = generate_batch(lm, prompts, cfg.max_draft_tokens, prefill=prefill,
                              answer_first=answer_first)
        texts = [prefill + lm.decode(ids) for ids, _ in rows]
        todo = [i for i, t in enumerate(texts) if not parse(t)[2]]
        if todo and cfg.force_answer_line and not answer_first:
            rows, texts = self._force_answers(prompts, rows, texts, todo)
            stats.answer_continuations = len(todo)
        drafts = []
        for subset, (ids, logps), raw in zip(subsets, rows, texts, strict=True):
            rationale, answer, ok = parse(raw)
            stats.parse_fallbacks += not ok
            stats.draft_new_tokens += len(ids)
            drafts.append(Draft(answer=answer, rationale=rationale, raw=raw,
                                doc_ids=tuple(docs[i].id for i in subset), doc_indices=subset,
                                parsed=ok, log_draft=sum(logps), draft_tokens=len(logps)))
        stats.draft_prompt_tokens = sum(len(p) for p in prompts)
        return drafts

    def _force_answers(self, prompts: list[list[int]], rows: list[tuple[list[int], list[float]]],
                       texts: list[str], todo: list[int]
                       ) -> tuple[list[tuple[list[int], list[float]]], list[str]]:
        lm = self.drafter
        marker = lm.encode("\nAnswer:")
        rows, texts = list(rows), list(texts)
        kept = {}
        for i in todo:
            ids, logps = rows[i]
            while ids and ids[-1] in lm.eos_token_ids:  # the drafter stopped: drop its EOS
                ids, logps = ids[:-1], logps[:-1]
            kept[i] = (ids, logps)
        extra = generate_batch(lm, [prompts[i] + kept[i][0] + marker for i in todo],
                               self.config.max_answer_tokens, prefill="Answer:")
        for i, (ans_ids, ans_logps) in zip(todo, extra, strict=True):
            ids, logps = kept[i]
            rows[i] = (ids + ans_ids, logps + ans_logps)
            texts[i] = "Rationale:" + lm.decode(ids).rstrip() + "\nAnswer:" + lm.decode(ans_ids)
        return rows, texts

    # -- 3. verification + 4. selection
    def score(self, question: str, drafts: Sequence[Draft], stats: SpeculativeRAGStats
              ) -> list[Draft]:
        cfg = self.config
        verified: list[tuple[float | None, float | None, int]] = [(None, None, 0)] * len(drafts)
        if cfg.needs_verifier:
            pairs = [(d.rationale, d.answer) for d in drafts]
            scores, stats.verify_tokens = verify_batch(self.verifier, question, pairs)
            verified = list(scores)
        out = []
        for d, (sc, sr, sc_tokens) in zip(drafts, verified, strict=True):
            scored = replace(d, log_self_contain=sc, log_self_reflect=sr,
                             self_contain_tokens=sc_tokens)
            out.append(replace(scored, score=combined_score(scored, cfg)))
        return out

    def answer(self, question: str, documents: Sequence[Any] | None = None, *,
               retriever: Any = None, on_event: EventHook | None = None) -> SpeculativeRAGResult:
        """Answer ``question`` from ``documents`` (or the top ``retrieve_k`` of a retriever)."""
        if on_event is not None and not callable(on_event):
            msg = f"on_event must be a callable or None, got {type(on_event).__name__}"
            raise TypeError(msg)
        cfg, emit = self.config, on_event or (lambda _name, _data: None)
        question = self._check_call(question, documents, retriever, need_subsets=True)
        start = time.perf_counter()
        with self._lock:
            docs, skipped, retrieve_s = self._documents(question, documents, retriever,
                                                        cfg.retrieve_k)
            check_inputs(question, docs, cfg)
            stats = SpeculativeRAGStats(num_documents=len(docs), num_drafts=cfg.num_drafts,
                                        docs_per_draft=cfg.docs_per_draft, retrieve_s=retrieve_s,
                                        skipped_documents=skipped)
            emit("specrag_retrieved", {"num_documents": len(docs)})
            t = time.perf_counter()
            subsets = self.sample_subsets(question, docs, stats)
            stats.sample_s = time.perf_counter() - t
            emit("specrag_subsets", {"subsets": [list(s) for s in subsets]})
            t = time.perf_counter()
            drafts = self.draft(question, docs, subsets, stats)
            stats.draft_s = time.perf_counter() - t
            emit("specrag_drafted", {"answers": [d.answer for d in drafts]})
            t = time.perf_counter()
            drafts = self.score(question, drafts, stats)
            stats.verify_s = time.perf_counter() - t
        best = select_best(drafts, cfg.selection, random.Random(f"{cfg.seed}:select:{question}"))
        emit("specrag_verified", {"scores": [d.score for d in drafts], "best": best})
        stats.total_s = time.perf_counter() - start
        return SpeculativeRAGResult(text=drafts[best].answer, rationale=drafts[best].rationale,
                                    best=best, drafts=tuple(drafts), documents=tuple(docs),
                                    stats=stats)

    __call__ = answer

    def standard_rag(self, question: str, documents: Sequence[Any] | None = None, *,
                     model: Literal["drafter", "verifier"] = "verifier",
                     retriever: Any = None) -> StandardRAGResult:
        """The paper's Standard RAG: one model, all documents in one prompt, same parsing."""
        if model not in ("drafter", "verifier"):
            msg = f"model must be 'drafter' or 'verifier', got {model!r}"
            raise ValueError(msg)
        question = self._check_call(question, documents, retriever, need_subsets=False)
        start = time.perf_counter()
        with self._lock:
            docs, _, retrieve_s = self._documents(question, documents, retriever,
                                                  self.config.retrieve_k)
            result = standard_rag(self._get(model), question, docs,
                                  self.config.max_answer_tokens)
        result.stats.retrieve_s = retrieve_s
        result.stats.total_s = time.perf_counter() - start
        return result


def standard_rag(lm: LM, question: str, documents: Sequence[Any],
                 max_new_tokens: int = SpeculativeRAGConfig.max_answer_tokens) -> StandardRAGResult:
    """Standard RAG with one model: every document in the prompt, answer parsed as drafts are."""
    question = check_inputs(question, documents, SpeculativeRAGConfig(), need_subsets=False)
    check_int(max_new_tokens, "max_new_tokens")
    docs, _ = drop_blank(to_documents(documents))
    prompt = rag_prompt(lm, question, docs)
    _check_length(lm, prompt, max_new_tokens, "the standard-RAG prompt")
    start = time.perf_counter()
    [(ids, _)] = generate_batch(lm, [prompt], max_new_tokens, prefill="Answer:")
    raw = "Answer:" + lm.decode(ids)
    _, answer, ok = parse_draft(raw)
    stats = StandardRAGStats(num_documents=len(docs), prompt_tokens=len(prompt),
                             new_tokens=len(ids), parse_fallbacks=int(not ok),
                             generate_s=time.perf_counter() - start)
    return StandardRAGResult(text=answer, raw=raw, documents=tuple(docs), stats=stats)
