"""Text embeddings for the framework adapters: one lazily loaded sentence-transformers model per
``(model, device)`` in a process.

LangChain's ``SpecragEmbeddings`` and LlamaIndex's ``SpecragEmbedding`` are settings only; both
call :func:`embed`, so they return the same vectors for the same text and settings, and a copy
(or an unpickled one) reuses the loaded model instead of loading it again. Torch and
sentence-transformers are imported on the first call that has texts to embed, not at import.

Setup::

    from shared_core.retrieval.embedding import EmbeddingConfig, embed

    config = EmbeddingConfig()  # the embedded, offline all-MiniLM-L6-v2
    vectors = embed(config, ["Paris is the capital of France."], kind="document")

Queries and documents are encoded with the model's own ``"query"`` / ``"document"`` prompt when
its sentence-transformers config defines one (e5/bge-style models), else as they are. Texts
longer than the model's window (256 word pieces for MiniLM) are truncated by the model. A text's
vector can differ in the last float bits with the batch it is encoded in (padding, matrix
shapes); a query is always encoded alone.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from shared_core.config import DEFAULT_EMBEDDER, check_bool, check_str_list
from shared_core.retrieval._common import check_int
from shared_core.runtime.model_cache import cached_embedder
from shared_core.runtime.weights.embedded import check_embedder_name

Kind = Literal["query", "document"]
_DEVICE = re.compile(r"cpu|cuda(:\d+)?|mps")


def check_device(device: object, name: str = "device") -> str | None:
    """``None`` (best available) or ``cpu`` / ``cuda`` / ``cuda:N`` / ``mps``, without torch."""
    if device is None:
        return None
    if not isinstance(device, str):
        msg = f"{name} must be a str such as 'cpu' or 'cuda:0', or None, got {type(device).__name__}"
        raise TypeError(msg)
    if not _DEVICE.fullmatch(device):
        msg = f"{name}={device!r} is not a device (use 'cpu', 'cuda', 'cuda:1', 'mps' or None)"
        raise ValueError(msg)
    return device


def check_str(text: object, name: str = "text") -> str:
    """``text`` if it is a str, blank or empty included (a TypeError otherwise): anything can be
    embedded. Question and query text, which must not be blank, is
    :func:`shared_core.config.check_text`'s."""
    if not isinstance(text, str):
        msg = f"{name} must be a str, got {type(text).__name__} {text!r:.80}"
        raise TypeError(msg)
    return text


def check_texts(texts: object, name: str = "texts") -> list[str]:
    """A list (or other sequence) of strings; a bare string is refused, an empty list is fine."""
    return check_str_list(texts, name)


@dataclass(frozen=True)
class EmbeddingConfig:
    """Settings of an embedding component (the defaults the adapters read).

    Args:
        model: embedded alias (``"all-minilm-l6-v2"``, offline), a sentence-transformers hub id
            or a local sentence-transformers folder.
        device: ``None`` for the best available device, else ``"cpu"``, ``"cuda:0"``, ...
        batch_size: texts per forward pass.
        normalize: L2-normalise the vectors (inner product = cosine).
        show_progress: a tqdm bar per call (off by default in library calls).
    """

    model: str = DEFAULT_EMBEDDER
    device: str | None = None
    batch_size: int = 32
    normalize: bool = True
    show_progress: bool = False

    def __post_init__(self) -> None:
        check_embedder_name(self.model, "model")
        check_device(self.device)
        check_int(self.batch_size, "batch_size")
        check_bool(self.normalize, "normalize")
        check_bool(self.show_progress, "show_progress")


def embed(config: EmbeddingConfig, texts: Sequence[str], kind: Kind = "document"
          ) -> list[list[float]]:
    """One vector (a list of floats) per text, loading the model on first use."""
    if kind not in ("query", "document"):
        msg = f"kind must be 'query' or 'document', got {kind!r}"
        raise ValueError(msg)
    texts = check_texts(texts)
    if not texts:
        return []
    model = cached_embedder(config.model, config.device)
    prompt_name = kind if kind in (getattr(model, "prompts", None) or {}) else None
    vectors = model.encode(texts, prompt_name=prompt_name, batch_size=config.batch_size,
                           normalize_embeddings=config.normalize, convert_to_numpy=True,
                           show_progress_bar=config.show_progress)
    rows: list[list[float]] = np.asarray(vectors, dtype=np.float32).tolist()
    return rows
