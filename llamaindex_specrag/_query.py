"""Query and prompt checks shared by the LlamaIndex query engines and retriever (private)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Coroutine, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

from llama_index.core.base.llms.types import ChatMessage
from llama_index.core.callbacks import CallbackManager, CBEventType, EventPayload
from llama_index.core.prompts.base import BasePromptTemplate, ChatPromptTemplate, PromptTemplate
from llama_index.core.schema import BaseNode, NodeWithScore, QueryBundle, TextNode

from shared_core.config import check_text
from shared_core.config.rag import PROMPT_ROLES, PromptMessages, check_prompt
from shared_core.frontend.rag import PROMPT_SENTINELS, check_prompt_variables, rendered_prompt
from shared_core.frontend.rag_settings import refuses_call_kwargs

if TYPE_CHECKING:
    from shared_core.retrieval.base import Document


def global_callback_manager() -> CallbackManager:
    """``Settings.callback_manager``: a query engine's default, as ``RetrieverQueryEngine``'s."""
    from llama_index.core import Settings

    return Settings.callback_manager


def query_text(query: object) -> str:
    """The question of a ``query``/``retrieve`` argument: a non-empty string or QueryBundle."""
    text = query.query_str if isinstance(query, QueryBundle) else query
    if not isinstance(text, str):
        msg = f"query must be a question string or a QueryBundle, got {type(query).__name__}"
        raise TypeError(msg)
    return check_text(text, "query")


def source_nodes(documents: Iterable[Document], score: Callable[[Document], float | None] | None
                 ) -> list[NodeWithScore]:
    """Our documents as LlamaIndex nodes: the node a document came from as it was, else a node
    with its id, text and metadata; ``score`` of each, or ``None`` when ``score`` is None."""
    return [NodeWithScore(node=as_node(d), score=None if score is None else score(d))
            for d in documents]


def as_node(document: Document, extra: dict[str, object] | None = None) -> BaseNode:
    """The LlamaIndex node ``document`` came from (unchanged), else a ``TextNode`` of it whose
    ``extra`` metadata (a rank) is kept out of the text the LLM and the embedder read."""
    if isinstance(document.source, BaseNode):
        return document.source
    hidden = list(extra or {})
    return TextNode(text=document.text, id_=document.id, metadata={**document.metadata,
                                                                    **(extra or {})},
                    excluded_llm_metadata_keys=hidden, excluded_embed_metadata_keys=hidden)


def prompt_messages(prompt: object) -> PromptMessages | None:
    """The engine form of a ``prompt`` setting: None, a format string / (role, text) pairs, or a
    LlamaIndex ``PromptTemplate`` / ``ChatPromptTemplate`` over ``question`` and ``documents``."""
    if not isinstance(prompt, BasePromptTemplate):
        return check_prompt(prompt)
    check_prompt_variables(set(prompt.template_vars) - set(prompt.kwargs))
    pairs = []
    for message in prompt.format_messages(None, **PROMPT_SENTINELS):  # no LLM: plain text
        role = getattr(message.role, "value", message.role)
        if role not in PROMPT_ROLES:
            msg = f"prompt messages must be system, user or assistant messages, got {role!r}"
            raise ValueError(msg)
        pairs.append((role, message.content or ""))
    return rendered_prompt(pairs)


R = TypeVar("R")


@contextlib.contextmanager
def _query_event(engine: Any, query_bundle: QueryBundle) -> Iterator[Any]:
    """A ``CBEventType.QUERY`` event of ``engine``'s callback manager, its query string in."""
    with engine.callback_manager.event(
            CBEventType.QUERY, payload={EventPayload.QUERY_STR: query_bundle.query_str}) as event:
        yield event


def query_event(method: Callable[[Any, QueryBundle], R]) -> Callable[[Any, QueryBundle], R]:
    """A query engine's ``_query`` inside a ``CBEventType.QUERY`` event (query string in,
    response out), as LlamaIndex's own query engines emit it for the older callback handlers
    (``LlamaDebugHandler``, token counters)."""

    @functools.wraps(method)
    def wrapped(self: Any, query_bundle: QueryBundle) -> R:
        with _query_event(self, query_bundle) as event:
            response = method(self, query_bundle)
            event.on_end(payload={EventPayload.RESPONSE: response})
            return response

    return wrapped


def aquery_event(method: Callable[[Any, QueryBundle], Coroutine[Any, Any, R]]
                 ) -> Callable[[Any, QueryBundle], Coroutine[Any, Any, R]]:
    """:func:`query_event` for ``_aquery``."""

    @functools.wraps(method)
    async def wrapped(self: Any, query_bundle: QueryBundle) -> R:
        with _query_event(self, query_bundle) as event:
            response = await method(self, query_bundle)
            event.on_end(payload={EventPayload.RESPONSE: response})
            return response

    return wrapped


class CheckedQuery:
    """Mixin for the RAG query engines: the query (and any keyword argument, refused naming the
    closest setting) is checked before LlamaIndex starts its events; the ``prompt`` setting may
    be a LlamaIndex template (:func:`prompt_messages`)."""

    _prompt_of = staticmethod(prompt_messages)
    if TYPE_CHECKING:  # the settings' field (declared here it would become a pydantic field)
        prompt: object

    def _get_prompts(self) -> dict[str, BasePromptTemplate]:
        """LlamaIndex's prompt mixin: the ``prompt`` setting as a template (a format string as a
        ``PromptTemplate``, (role, text) pairs as a ``ChatPromptTemplate``); nothing while the
        engine's built-in prompt is used (``prompt=None``)."""
        prompt = self.prompt
        if prompt is None or isinstance(prompt, BasePromptTemplate):
            return {} if prompt is None else {"prompt": prompt}
        if isinstance(prompt, str):
            return {"prompt": PromptTemplate(prompt)}
        messages = [ChatMessage(role=role, content=text) for role, text in check_prompt(prompt) or ()]
        return {"prompt": ChatPromptTemplate(message_templates=messages)}

    def _update_prompts(self, prompts_dict: dict[str, BasePromptTemplate]) -> None:
        """``update_prompts({"prompt": template})`` sets the ``prompt`` setting (checked as at
        construction: ValueError naming ``prompt``); the engine is rebuilt on its next call."""
        if "prompt" in prompts_dict:
            self._prompt_of(prompts_dict["prompt"])
            self.prompt = prompts_dict["prompt"]

    @refuses_call_kwargs
    def query(self, str_or_query_bundle: str | QueryBundle) -> Any:
        query_text(str_or_query_bundle)
        return super().query(str_or_query_bundle)  # type: ignore[misc]

    @refuses_call_kwargs
    async def aquery(self, str_or_query_bundle: str | QueryBundle) -> Any:
        query_text(str_or_query_bundle)
        return await super().aquery(str_or_query_bundle)  # type: ignore[misc]
