"""Query and prompt checks shared by the LlamaIndex query engines and retriever (private)."""

from __future__ import annotations

from typing import Any

from llama_index.core.prompts.base import BasePromptTemplate
from llama_index.core.schema import QueryBundle

from shared_core.config import check_text
from shared_core.rag_adapters import PROMPT_SENTINELS, check_prompt_variables, rendered_prompt
from shared_core.rag_config import PROMPT_ROLES, PromptMessages, check_prompt


def query_text(query: Any) -> str:
    """The question of a ``query``/``retrieve`` argument: a non-empty string or QueryBundle."""
    text = query.query_str if isinstance(query, QueryBundle) else query
    if not isinstance(text, str):
        msg = f"query must be a question string or a QueryBundle, got {type(query).__name__}"
        raise TypeError(msg)
    return check_text(text, "query")


def prompt_messages(prompt: Any) -> PromptMessages | None:
    """The engine form of a ``prompt`` setting: None, a format string / (role, text) pairs, or a
    LlamaIndex ``PromptTemplate`` / ``ChatPromptTemplate`` over ``question`` and ``documents``."""
    if not isinstance(prompt, BasePromptTemplate):
        return check_prompt(prompt)
    check_prompt_variables(set(prompt.template_vars) - set(prompt.kwargs))
    pairs = []
    for message in prompt.format_messages(**PROMPT_SENTINELS):
        role = getattr(message.role, "value", message.role)
        if role not in PROMPT_ROLES:
            msg = f"prompt messages must be system, user or assistant messages, got {role!r}"
            raise ValueError(msg)
        pairs.append((role, message.content or ""))
    return rendered_prompt(pairs)


class CheckedQuery:
    """Mixin for query engines: the query is checked before LlamaIndex starts its events."""

    def query(self, str_or_query_bundle: str | QueryBundle) -> Any:
        query_text(str_or_query_bundle)
        return super().query(str_or_query_bundle)  # type: ignore[misc]

    async def aquery(self, str_or_query_bundle: str | QueryBundle) -> Any:
        query_text(str_or_query_bundle)
        return await super().aquery(str_or_query_bundle)  # type: ignore[misc]
