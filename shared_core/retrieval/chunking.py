"""Token-aware chunking with the model's own Hugging Face tokenizer.

Chunks are consecutive windows of ``chunk_tokens`` tokens (the last one may be shorter), in
document order, as RAPID splits its long context. With a fast tokenizer every chunk is an exact
slice of the original text and, without overlap, the chunks tile it: ``"".join(chunks) == text``.

We count tokens directly instead of reusing langchain-text-splitters'
``RecursiveCharacterTextSplitter.from_huggingface_tokenizer``: that splitter re-tokenizes
every merged piece (slow on 5k-token contexts), strips whitespace (chunks are no longer exact
slices, so token offsets would have to be reconstructed) and may emit chunks above
``chunk_size`` when a piece has no separator.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from shared_core.config import DEFAULT_CHUNK_TOKENS
from shared_core.retrieval._common import check_int
from shared_core.retrieval.base import Document

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Span:
    text: str
    token_start: int
    token_end: int
    char_start: int | None
    char_end: int | None


def _check_sizes(chunk_tokens: int, overlap: int) -> None:
    check_int(chunk_tokens, "chunk_tokens")
    check_int(overlap, "overlap", 0)
    if overlap >= chunk_tokens:
        msg = f"overlap must be an integer in [0, chunk_tokens={chunk_tokens}), got {overlap!r}"
        raise ValueError(msg)


def _check_tokenizer(tokenizer: object) -> None:
    if not callable(getattr(tokenizer, "encode", None)):
        msg = f"tokenizer must be a Hugging Face tokenizer (e.g. lm.tokenizer), got {tokenizer!r}"
        raise TypeError(msg)


def _windows(n_tokens: int, chunk_tokens: int, overlap: int) -> list[tuple[int, int]]:
    """Token ranges [start, end) of consecutive windows; the last one ends at ``n_tokens``."""
    stride = chunk_tokens - overlap
    windows: list[tuple[int, int]] = []
    start = 0
    while start < n_tokens:
        end = min(start + chunk_tokens, n_tokens)
        windows.append((start, end))
        if end == n_tokens:
            break
        start += stride
    return windows


def _spans(text: str, tokenizer: PreTrainedTokenizerBase, chunk_tokens: int, overlap: int) -> list[_Span]:
    if not isinstance(text, str):
        msg = f"text must be a str, got {type(text).__name__}"
        raise TypeError(msg)
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
        offsets = [start for start, _ in enc["offset_mapping"]]
        n = len(offsets)
        spans = []
        for a, b in _windows(n, chunk_tokens, overlap):
            # Slice from this window's first token to the next window's first token so that
            # whitespace between tokens is kept and, without overlap, chunks tile the text.
            char_start = 0 if a == 0 else offsets[a]
            char_end = len(text) if b == n else offsets[b]
            spans.append(_Span(text[char_start:char_end], a, b, char_start, char_end))
        return spans
    # Slow (pure-Python) tokenizers give no offsets: decode each window instead.
    ids = tokenizer.encode(text, add_special_tokens=False)
    return [_Span(tokenizer.decode(ids[a:b]), a, b, None, None)
            for a, b in _windows(len(ids), chunk_tokens, overlap)]


def chunk_text(text: str, tokenizer: PreTrainedTokenizerBase,
               chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
               overlap: int = 0) -> list[str]:
    """Split ``text`` into consecutive windows of ``chunk_tokens`` tokens, in document order.

    Args:
        text: the text to split; an empty text gives no chunks.
        tokenizer: the model's Hugging Face tokenizer (e.g. ``lm.tokenizer``); special tokens are
            not counted.
        chunk_tokens: tokens per chunk (the last chunk may be shorter).
        overlap: tokens shared by consecutive chunks, ``0 <= overlap < chunk_tokens``.
    """
    _check_sizes(chunk_tokens, overlap)
    _check_tokenizer(tokenizer)
    return [span.text for span in _spans(text, tokenizer, chunk_tokens, overlap)]


def chunk_documents(docs: Iterable[Document], tokenizer: PreTrainedTokenizerBase,
                    chunk_tokens: int = DEFAULT_CHUNK_TOKENS, overlap: int = 0) -> list[Document]:
    """Chunk every document with :func:`chunk_text`, keeping document order and chunk order.

    Chunk ids are ``"{doc.id}#{i}"``. Each chunk keeps its parent's metadata plus
    ``parent_id``, ``chunk_index``, ``token_start`` / ``token_end`` (token offsets in the
    parent, end exclusive) and ``char_start`` / ``char_end`` (``None`` for slow tokenizers).
    Documents with empty text give no chunks.
    """
    _check_sizes(chunk_tokens, overlap)
    _check_tokenizer(tokenizer)
    if isinstance(docs, (str, Document)):
        msg = f"docs must be a list of Document, got {type(docs).__name__}; wrap it in a list"
        raise TypeError(msg)
    chunks: list[Document] = []
    for doc in docs:
        if not isinstance(doc, Document):
            msg = f"docs must hold Document objects, got {type(doc).__name__}"
            raise TypeError(msg)
        for i, span in enumerate(_spans(doc.text, tokenizer, chunk_tokens, overlap)):
            metadata = {**doc.metadata, "parent_id": doc.id, "chunk_index": i,
                        "token_start": span.token_start, "token_end": span.token_end,
                        "char_start": span.char_start, "char_end": span.char_end}
            chunks.append(Document(id=f"{doc.id}#{i}", text=span.text, metadata=metadata))
    logger.debug("chunked documents into %d chunks of <= %d tokens", len(chunks), chunk_tokens)
    return chunks
