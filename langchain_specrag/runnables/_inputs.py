"""What the RAG runnables accept (private): a prompt's output as the question, a prompt template
as the ``prompt`` setting."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

from langchain_core.messages import BaseMessage, HumanMessage
from langchain_core.prompt_values import PromptValue, StringPromptValue
from langchain_core.prompts import BasePromptTemplate
from langchain_core.runnables import Runnable
from langchain_core.tools import BaseTool
from pydantic import BaseModel

from shared_core.config.rag import PromptMessages, check_prompt
from shared_core.frontend.rag import (
    PROMPT_SENTINELS,
    check_prompt_variables,
    question_input,
    rendered_prompt,
)
from shared_core.retrieval.frameworks import DocumentList

_ROLES = {"human": "user", "system": "system", "ai": "assistant"}
# what the RAG runnables take (as_question_input): a question, a dict with one, a prompt's output
RAGInput = str | Mapping[str, object] | PromptValue | Sequence[BaseMessage]


def _last_human(messages: Sequence[object]) -> str:
    humans = [m for m in messages if isinstance(m, HumanMessage)]
    if not humans:
        msg = "input messages must include a human message: its text is taken as the question"
        raise ValueError(msg)
    return humans[-1].text


def as_question_input(value: object) -> tuple[str, DocumentList | None]:
    """(question, documents or None) of a runnable's input, checked before any model work.

    Accepted: a question string; a ``{"question", "documents"?}`` dict; a prompt's output (a
    ``StringPromptValue``'s text is the question; a ``ChatPromptValue`` or a list of messages
    gives its last human message).
    """
    if isinstance(value, StringPromptValue):
        value = value.to_string()
    elif isinstance(value, PromptValue):
        value = _last_human(value.to_messages())
    elif (isinstance(value, (list, tuple)) and value
          and all(isinstance(m, BaseMessage) for m in value)):
        value = _last_human(value)
    elif not isinstance(value, (str, dict)):
        msg = ("input must be a question string, a dict with a 'question' key, a prompt value or "
               f"a list of messages, got {type(value).__name__}")
        raise TypeError(msg)
    return question_input(value)


def prompt_messages(prompt: object) -> PromptMessages | None:
    """The engine form of a ``prompt`` setting: None, a format string / (role, text) pairs, or a
    LangChain ``PromptTemplate`` / ``ChatPromptTemplate`` over ``question`` and ``documents``."""
    if not isinstance(prompt, BasePromptTemplate):
        return check_prompt(prompt)
    check_prompt_variables(prompt.input_variables)
    value = prompt.invoke(dict(PROMPT_SENTINELS))
    if isinstance(value, StringPromptValue):
        return rendered_prompt([("user", value.to_string())])
    pairs = []
    for message in value.to_messages():
        if message.type not in _ROLES:
            msg = f"prompt messages must be system, human or ai messages, got {message.type!r}"
            raise ValueError(msg)
        pairs.append((_ROLES[message.type], message.text))
    return rendered_prompt(pairs)


class LangChainPrompt:
    """Mixin of the LangChain RAG runnables: their ``prompt`` setting may be a LangChain
    template (:func:`prompt_messages`), converted by the shared settings base; ``as_tool``
    takes a question."""

    _prompt_of = staticmethod(prompt_messages)

    def as_tool(self, args_schema: type[BaseModel] | None = None, *, name: str | None = None,
                description: str | None = None, arg_types: dict[str, type] | None = None
                ) -> BaseTool:
        """The runnable as an agent's tool, called with ``{"question": str}`` unless
        ``args_schema`` or ``arg_types`` say otherwise (its input type is a union, from which
        LangChain cannot infer a schema)."""
        if args_schema is None and arg_types is None:
            arg_types = {"question": str}
        return Runnable.as_tool(cast("Runnable[Any, Any]", self), args_schema, name=name,
                                description=description, arg_types=arg_types)
