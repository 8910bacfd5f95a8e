"""RAPID's per-question prompts (target, drafter, RAG baseline), the chat template split and the
stats a prompt contributes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from shared_core.config.tokens import RapidConfig
from shared_core.decoding.decode_stats import RUN_SPECIFIC, DecodeStats
from shared_core.retrieval import DenseRetriever, Document
from shared_core.runtime.protocol import SessionLM

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


@dataclass
class RapidStats(DecodeStats):
    """RAPID's settings and context numbers beside the shared counters."""

    method: str = ""
    eta: float = 0.0
    gamma: int = 0
    drafter_kv: str | None = None
    adaptive_gamma: bool = False
    context_tokens: int = 0
    retrieved_tokens: int = 0
    retrieved_chunks: list[int] = field(default_factory=list)
    truncated: bool = False
    retrieval_s: float = 0.0
    reused_prefix_tokens: int = 0
    draft_prefill_s: float | None = field(default=None, metadata=RUN_SPECIFIC)  # speculative methods only
    plain_rounds: int | None = field(default=None, metadata=RUN_SPECIFIC)

    def describe(self, method: str, eta: float, config: RapidConfig, prompt: RapidPrompt
                 ) -> None:
        """Record the method, its settings and the prompt's context numbers."""
        speculative = method in ("rapid", "sd")
        self.method, self.eta = method, eta if method == "rapid" else 0.0
        self.gamma = config.gamma if speculative else 0
        self.drafter_kv = config.drafter_kv if speculative else None
        self.adaptive_gamma = config.adaptive_gamma and speculative
        self.context_tokens, self.retrieved_tokens = prompt.context_tokens, prompt.retrieved_tokens
        self.retrieved_chunks, self.truncated = list(prompt.retrieved_chunks), prompt.truncated
        self.retrieval_s = round(prompt.retrieval_s, 4)


def chat_parts(lm: SessionLM) -> tuple[str, str]:
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
