"""``SpecragEmbeddings``: LangChain ``Embeddings`` over the embedded, offline all-MiniLM-L6-v2 (or
any sentence-transformers hub id / local folder).

Settings only: the model loads on the first call that has texts, through the process-wide cache
of :mod:`shared_core.retrieval.embedding` (shared with LlamaIndex's ``SpecragEmbedding``, which
returns the same vectors). Constructing one, or importing this package, does not import torch;
a pickled one carries its settings, not the weights.

Setup::

    from langchain_core.vectorstores import InMemoryVectorStore
    from langchain_specrag import SpecragEmbeddings

    store = InMemoryVectorStore.from_texts(texts, SpecragEmbeddings())
"""

from __future__ import annotations

from langchain_core.embeddings import Embeddings
from langchain_core.runnables.config import run_in_executor
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator

from shared_core.retrieval.embedding import (
    EmbeddingConfig,
    check_device,
    check_str,
    check_texts,
    embed,
)
from shared_core.runtime.weights.embedded import check_embedder_name


class SpecragEmbeddings(BaseModel, Embeddings):
    """Sentence-transformers embeddings, loaded lazily and shared across copies.

    Args:
        model: ``"all-minilm-l6-v2"`` (embedded, offline; default), a sentence-transformers hub
            id or a local folder. Also accepted as ``model_name``.
        device: ``None`` (best available), ``"cpu"``, ``"cuda:0"``, ``"mps"``.
        batch_size: texts per forward pass.
        normalize: L2-normalise the vectors (so inner product = cosine).
        show_progress: a tqdm bar per ``embed_documents`` call.
    """

    # hide_input_in_errors: a ValidationError would echo a URL's credentials
    model_config = ConfigDict(populate_by_name=True, extra="forbid", protected_namespaces=(),
                              hide_input_in_errors=True)

    model: str = Field(default=EmbeddingConfig.model,
                       validation_alias=AliasChoices("model", "model_name"))
    device: str | None = Field(default=EmbeddingConfig.device)
    batch_size: int = Field(default=EmbeddingConfig.batch_size, strict=True, ge=1)
    normalize: bool = Field(default=EmbeddingConfig.normalize, strict=True)
    show_progress: bool = Field(default=EmbeddingConfig.show_progress, strict=True)

    @model_validator(mode="after")
    def _check_names(self) -> SpecragEmbeddings:
        check_embedder_name(self.model, "model")
        check_device(self.device)
        return self

    def _config(self) -> EmbeddingConfig:
        return EmbeddingConfig(model=self.model, device=self.device, batch_size=self.batch_size,
                               normalize=self.normalize, show_progress=self.show_progress)

    def embed_documents(self, texts: list[str]) -> list[list[float]]:
        """One vector per text (``[]`` for no texts, without loading the model)."""
        return embed(self._config(), check_texts(texts), "document")

    def embed_query(self, text: str) -> list[float]:
        return embed(self._config(), [check_str(text)], "query")[0]

    async def aembed_documents(self, texts: list[str]) -> list[list[float]]:
        texts = check_texts(texts)
        return await run_in_executor(None, self.embed_documents, texts)

    async def aembed_query(self, text: str) -> list[float]:
        check_str(text)
        return await run_in_executor(None, self.embed_query, text)
