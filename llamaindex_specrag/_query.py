"""Query checks shared by the LlamaIndex query engines and retriever (private)."""

from __future__ import annotations

from typing import Any

from llama_index.core.schema import QueryBundle

from shared_core.config import check_text


def query_text(query: Any) -> str:
    """The question of a ``query``/``retrieve`` argument: a non-empty string or QueryBundle."""
    text = query.query_str if isinstance(query, QueryBundle) else query
    if not isinstance(text, str):
        msg = f"query must be a question string or a QueryBundle, got {type(query).__name__}"
        raise TypeError(msg)
    return check_text(text, "query")


class CheckedQuery:
    """Mixin for query engines: the query is checked before LlamaIndex starts its events."""

    def query(self, str_or_query_bundle: str | QueryBundle) -> Any:
        query_text(str_or_query_bundle)
        return super().query(str_or_query_bundle)  # type: ignore[misc]

    async def aquery(self, str_or_query_bundle: str | QueryBundle) -> Any:
        query_text(str_or_query_bundle)
        return await super().aquery(str_or_query_bundle)  # type: ignore[misc]
