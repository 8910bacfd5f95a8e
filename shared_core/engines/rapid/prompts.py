"""RAPID's per-question prompts (target, drafter, RAG baseline), the chat template split and the
stats a prompt contributes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shared_core.models import LM
from shared_core.retrieval import DenseRetriever, Document
from shared_core.token_config import RapidConfig

METHODS = ("rapid", "sd", "long_context", "rag")
_SENTINEL = "\x00RAPID-CONTENT\x00"


@dataclass(frozen=True)
class RapidPrompt:
    """Token ids of one question: the target's full-context prompt and the drafter's RAG one."""

    target_ids: tuple[int, ...]  # [full context; query] in the target's chat format
    draft_ids: tuple[int, ...]  # [retrieved context; query] in the drafter's chat format
    rag_ids: tuple[int, ...]  # [retrieved context; query] in the target's chat format
    context_tokens: int  # tokens of the (possibly truncated) long context
    retrieved_tokens: int  # tokens of the retrieved context the drafter sees
    retrieved_chunks: tuple[int, ...]  # chunk indices, document order
    truncated: bool
    retrieval_s: float
    shared_positions: tuple[int, ...] | None  # positions the shared drafter sees ("target" only)


@dataclass(frozen=True)
class EncodedContext:
    ids: list[int]  # the context alone
    prefix_ids: list[int]  # target prompt up to the end of the context template
    token_starts: list[int] | None  # char offset of each prefix token (None: slow tokenizer)
    context_char: int  # char offset of the context inside the prefix text


@dataclass
class IndexedContext:
    chunks: list[Document]
    retriever: DenseRetriever
    n_tokens: int


def prompt_stats(method: str, eta: float, config: RapidConfig, prompt: RapidPrompt
                  ) -> dict[str, Any]:
    speculative = method in ("rapid", "sd")
    return {"method": method, "eta": eta if method == "rapid" else 0.0,
            "gamma": config.gamma if speculative else 0,
            "drafter_kv": config.drafter_kv if speculative else None,
            "adaptive_gamma": config.adaptive_gamma and speculative,
            "context_tokens": prompt.context_tokens, "retrieved_tokens": prompt.retrieved_tokens,
            "retrieved_chunks": list(prompt.retrieved_chunks), "truncated": prompt.truncated,
            "retrieval_s": round(prompt.retrieval_s, 4)}


def chat_parts(lm: LM) -> tuple[str, str]:
    """The chat template around one user message: (text before it, text after it)."""
    rendered = lm.chat_prompt([{"role": "user", "content": _SENTINEL}])
    head, _, tail = rendered.partition(_SENTINEL)
    return head, tail


def join_chunks(chunks: Sequence[Document]) -> str:
    """Concatenate chunks (exact slices); adjacent ones join seamlessly, gaps get a blank line."""
    parts: list[str] = []
    previous = None
    for chunk in chunks:
        index = chunk.metadata["chunk_index"]
        if previous is not None and index != previous + 1:
            parts.append("\n\n")
        parts.append(chunk.text)
        previous = index
    return "".join(parts)
