"""``SpecragEmbedding``: a LlamaIndex ``BaseEmbedding`` over the embedded, offline
all-MiniLM-L6-v2 (or any sentence-transformers hub id / local folder).

Settings only: the model loads on the first call that has texts, through the process-wide cache
of :mod:`shared_core.retrieval.embedding` (shared with LangChain's ``SpecragEmbeddings``, which
returns the same vectors). Constructing one, or importing this package, does not import torch;
a pickled one carries its settings, not the weights.

Setup (no OpenAI key, no network)::

    from llama_index.core import Settings, VectorStoreIndex
    from llamaindex_specrag import SpecragEmbedding

    Settings.embed_model = SpecragEmbedding()
    index = VectorStoreIndex.from_documents(documents)
"""

from __future__ import annotations

import asyncio
from typing import Any

from llama_index.core.base.embeddings.base import BaseEmbedding, Embedding
from llama_index.core.bridge.pydantic import ConfigDict, Field, model_validator
from pydantic import AliasChoices

from shared_core.retrieval.embedding import (
    EmbeddingConfig,
    check_device,
    check_str,
    check_texts,
    embed,
)
from shared_core.runtime.weights.embedded import check_embedder_name


class SpecragEmbedding(BaseEmbedding):
    """Sentence-transformers embeddings, loaded lazily and shared across copies.

    Args:
        model_name: ``"all-minilm-l6-v2"`` (embedded, offline; default), a sentence-transformers
            hub id or a local folder. Also accepted as ``model``.
        embed_batch_size: texts per forward pass (LlamaIndex also hands texts over in batches of
            this size). Also accepted as ``batch_size``.
        device: ``None`` (best available), ``"cpu"``, ``"cuda:0"``, ``"mps"``.
        normalize: L2-normalise the vectors (so inner product = cosine).
        show_progress: a tqdm bar per batch (LlamaIndex's own ``show_progress`` covers a whole
            ``get_text_embedding_batch`` call).
    """

    # hide_input_in_errors: a ValidationError would echo a URL's credentials
    model_config = ConfigDict(protected_namespaces=("pydantic_model_",),
                              arbitrary_types_allowed=True, extra="forbid",
                              hide_input_in_errors=True)

    model_name: str = Field(default=EmbeddingConfig.model,
                            validation_alias=AliasChoices("model_name", "model"))
    embed_batch_size: int = Field(default=EmbeddingConfig.batch_size, strict=True, gt=0, le=2048,
                                  validation_alias=AliasChoices("embed_batch_size", "batch_size"))
    device: str | None = Field(default=EmbeddingConfig.device)
    normalize: bool = Field(default=EmbeddingConfig.normalize, strict=True)
    show_progress: bool = Field(default=EmbeddingConfig.show_progress, strict=True)

    @model_validator(mode="after")
    def _check_names(self) -> SpecragEmbedding:
        check_embedder_name(self.model_name, "model_name")
        check_device(self.device)
        return self

    @classmethod
    def class_name(cls) -> str:
        return "SpecragEmbedding"

    def _config(self) -> EmbeddingConfig:
        return EmbeddingConfig(model=self.model_name, device=self.device,
                               batch_size=self.embed_batch_size, normalize=self.normalize,
                               show_progress=self.show_progress)

    def get_text_embedding_batch(self, texts: list[str], show_progress: bool = False,
                                 **kwargs: Any) -> list[Embedding]:
        """Checked here so a bare string or a non-string item is named before any batching."""
        return super().get_text_embedding_batch(check_texts(texts), show_progress, **kwargs)

    async def aget_text_embedding_batch(self, texts: list[str], show_progress: bool = False,
                                        **kwargs: Any) -> list[Embedding]:
        return await super().aget_text_embedding_batch(check_texts(texts), show_progress,
                                                       **kwargs)

    def _get_query_embedding(self, query: str) -> Embedding:
        return embed(self._config(), [check_str(query, "query")], "query")[0]

    def _get_text_embedding(self, text: str) -> Embedding:
        return embed(self._config(), [check_str(text)], "document")[0]

    def _get_text_embeddings(self, texts: list[str]) -> list[Embedding]:
        return embed(self._config(), check_texts(texts), "document")

    async def _aget_query_embedding(self, query: str) -> Embedding:
        check_str(query, "query")
        return await asyncio.to_thread(self._get_query_embedding, query)

    async def _aget_text_embedding(self, text: str) -> Embedding:
        check_str(text)
        return await asyncio.to_thread(self._get_text_embedding, text)

    async def _aget_text_embeddings(self, texts: list[str]) -> list[Embedding]:
        texts = check_texts(texts)
        return await asyncio.to_thread(self._get_text_embeddings, texts)
