"""Streamed structured output for ``SpeculativeLLM``: the reply decoded under the output class's
JSON schema (a grammar every engine applies), parsed into partial objects as the JSON grows.

LlamaIndex's default program streams a tool call instead; an unforced call may not come (a small
model answers in prose: every partial object empty), and a call's arguments only arrive once its
closing tag does, so nothing partial could be shown either way.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterator
from typing import Any

from llama_index.core.base.llms.types import ChatResponse
from llama_index.core.program.utils import process_streaming_objects
from pydantic import BaseModel


def schema_format(output_cls: type[BaseModel], llm_kwargs: dict[str, Any] | None
                  ) -> dict[str, Any]:
    """The chat call's keywords: the caller's, and the output class's JSON schema as the reply's
    ``response_format``."""
    return {**(llm_kwargs or {}), "response_format": {
        "type": "json_schema", "schema": output_cls.model_json_schema()}}


def partial_objects(responses: Iterator[ChatResponse], output_cls: type[BaseModel]
                    ) -> Generator[BaseModel, None, None]:
    """A partial object per streamed response (fields filled as they complete), then the whole
    reply validated as ``output_cls``."""
    current: Any = None
    last = None
    for response in responses:
        last = response
        current = process_streaming_objects(response, output_cls, cur_objects=_listed(current))
        yield current
    if last is not None:
        yield output_cls.model_validate_json(last.message.content or "")


async def apartial_objects(responses: AsyncIterator[ChatResponse], output_cls: type[BaseModel]
                           ) -> AsyncGenerator[BaseModel, None]:
    """:func:`partial_objects` of an async stream."""
    current: Any = None
    last = None
    async for response in responses:
        last = response
        current = process_streaming_objects(response, output_cls, cur_objects=_listed(current))
        yield current
    if last is not None:
        yield output_cls.model_validate_json(last.message.content or "")


def _listed(current: Any) -> list[Any] | None:
    return None if current is None else [current]
