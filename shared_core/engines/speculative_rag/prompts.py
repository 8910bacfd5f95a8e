"""Speculative RAG prompts (drafting, standard RAG, reflection) and draft parsing.

A draft should read ``Rationale: … Answer: …``; the parsing fallbacks are described in the
package docstring (:mod:`shared_core.engines.speculative_rag`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from shared_core.config.rag import DraftOrder, PromptMessages, format_prompt
from shared_core.retrieval.base import Document
from shared_core.runtime.lm import window_text

if TYPE_CHECKING:

    from shared_core.runtime.protocol import ModelLM


# No "<placeholder>" formats: a 135M drafter copied "<short answer>" verbatim into 1 draft in 4.
# The format lines are also appended to a caller's ``prompt`` (the draft parser needs them).
DRAFT_FORMAT = ("First write a one-sentence rationale based on the documents after 'Rationale:', "
                "then a short answer of a few words after 'Answer:'.")
DRAFT_INSTRUCTION = f"Answer the question using the documents. {DRAFT_FORMAT}"
# answer_first drafts (draft_order="answer_first"): the answer line cannot go missing
DRAFT_FORMAT_ANSWER_FIRST = ("First write a short answer of a few words after 'Answer:', then a "
                             "one-sentence rationale based on the documents after 'Rationale:'.")
DRAFT_INSTRUCTION_ANSWER_FIRST = f"Answer the question using the documents. {DRAFT_FORMAT_ANSWER_FIRST}"
RAG_INSTRUCTION = "Answer the question using the documents. Give a short answer of a few words."
REFLECTION = "Do you think the rationale supports the answer, yes or no?"


_ANSWER_MARK = re.compile(r"\banswer\s*(?:is)?\s*[:：]", re.IGNORECASE)
_RATIONALE_MARK = re.compile(r"^\s*rationale\s*[:：]\s*", re.IGNORECASE)
ANSWER_LINE_DONE = re.compile(r"\banswer\s*(?:is)?\s*[:：][^\n]*\S[^\n]*\n", re.IGNORECASE)
# answer-first drafts end with their one rationale sentence (a newline or a sentence end)
RATIONALE_DONE = re.compile(r"\brationale\s*[:：]\s*\S[^\n]*?(?:\n|[.!?]$)", re.IGNORECASE)


def _clean_answer(text: str) -> str:
    text = re.sub(r"^\s*(?:the\s+)?answer\s+is\s*[:：]?", "", text, flags=re.IGNORECASE)
    text = text.strip().strip("\"'“”*").strip()
    return text.rstrip(".").strip()


def _first_sentence(text: str) -> str:
    line = next((ln for ln in text.splitlines() if ln.strip()), "")
    return re.split(r"(?<=[.!?])\s", line.strip(), maxsplit=1)[0]


def parse_answer_first(text: str) -> tuple[str, str, bool]:
    """(rationale, answer, parsed_cleanly) from ``Answer: … Rationale: …`` (answer-first drafts).

    The answer is the first non-empty line after ``Answer:`` (always present: it is prefilled),
    up to a ``Rationale:`` marker on the same line (Qwen2.5-0.5B writes both on one line in about
    one draft in four); the rationale follows the marker, else it is the rest of the text (not
    clean).
    """
    body = _ANSWER_MARK.sub("", text, count=1)
    marked = re.search(r"\brationale\s*[:：]", body, re.IGNORECASE)
    head = body if marked is None else body[:marked.start()]
    lines = [ln for ln in head.splitlines() if ln.strip()]
    answer = _clean_answer(lines[0]) if lines else ""
    if marked is not None:
        return body[marked.end():].strip(), answer, bool(answer)
    return "\n".join(lines[1:]).strip(), answer, False


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


def passage_texts(docs: Sequence[Document]) -> list[str]:
    """The documents' texts as the prompts show them (whitespace collapsed): what a passage
    cache is told to look for (:func:`shared_core.runtime.passage_cache.register_passages`)."""
    return [" ".join(d.text.split()) for d in docs]


def _format_docs(docs: Sequence[Document]) -> str:
    return "\n".join(f"Document [{i + 1}]: {text}" for i, text in enumerate(passage_texts(docs)))


def render_prompt(lm: ModelLM, body: str, prefill: str) -> list[int]:
    """Token ids of ``body`` as a user turn (chat models) or plain text (base models) + prefill."""
    if lm.has_chat_template:
        text = lm.chat_prompt([{"role": "user", "content": body}]) + prefill
        return lm.encode(text, add_special_tokens=False)
    return lm.prompt_ids(f"{body}\n\n{prefill}")


def draft_prompt(lm: ModelLM, question: str, docs: Sequence[Document], order: DraftOrder,
                 prompt: PromptMessages | None = None) -> list[int]:
    """A draft prompt; a caller's ``prompt`` (see ``config.rag.check_prompt``) replaces the
    default body, and the order's format line is appended to its last user turn."""
    if prompt is not None:
        return render_messages(lm, format_prompt(prompt, question, _format_docs(docs)),
                               DRAFT_FORMAT if order == "rationale_first"
                               else DRAFT_FORMAT_ANSWER_FIRST,
                               "Rationale:" if order == "rationale_first" else "Answer:")
    instruction, prefill = ((DRAFT_INSTRUCTION, "Rationale:") if order == "rationale_first"
                            else (DRAFT_INSTRUCTION_ANSWER_FIRST, "Answer:"))
    return render_prompt(lm, f"{_format_docs(docs)}\n\nQuestion: {question}\n\n{instruction}",
                         prefill)


def render_messages(lm: ModelLM, messages: list[dict[str, str]], format_line: str, prefill: str
                    ) -> list[int]:
    """Token ids of chat ``messages`` + ``format_line`` (closing the last user turn, or a turn of
    its own) + prefill; a base model gets the turns' text joined by blank lines."""
    if messages[-1]["role"] == "user":
        messages = [*messages[:-1], {**messages[-1],
                                     "content": f"{messages[-1]['content']}\n\n{format_line}"}]
    else:
        messages = [*messages, {"role": "user", "content": format_line}]
    if lm.has_chat_template:
        text = lm.chat_prompt(messages) + prefill
        return lm.encode(text, add_special_tokens=False)
    return lm.prompt_ids("\n\n".join([*(m["content"] for m in messages), prefill]))


def rag_prompt(lm: ModelLM, question: str, docs: Sequence[Document]) -> list[int]:
    return render_prompt(lm, f"{RAG_INSTRUCTION}\n\n{_format_docs(docs)}\n\nQuestion: {question}",
                         "Answer:")


def check_length(lm: ModelLM, ids: Sequence[int], budget: int, what: str, question: str,
                 docs: Sequence[Document]) -> None:
    """ValueError when ``ids`` + ``budget`` new tokens overflow the window, blaming the input
    that does: the question when it alone leaves no room, else the documents."""
    if len(ids) + budget <= lm.max_context:
        return
    asked = len(lm.encode(question))
    read = sum(len(lm.encode(d.text)) for d in docs)
    fix = ("shorten the question: without any document the prompt would still not fit"
           if len(ids) - read + budget > lm.max_context else "pass fewer or shorter documents")
    msg = (f"{what} has {len(ids)} tokens (the question {asked}, its {len(docs)} documents "
           f"{read}, the instructions the rest) + {budget} new tokens, more than "
           f"{window_text(lm)}; {fix}")
    raise ValueError(msg)
