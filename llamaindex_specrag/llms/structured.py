"""Streamed structured output for ``SpeculativeLLM``: the reply decoded under the output class's
JSON schema (a grammar every engine applies), parsed into partial objects as the JSON grows.

LlamaIndex's default program streams a tool call instead; an unforced call may not come (a small
model answers in prose: every partial object empty), and a call's arguments only arrive once its
closing tag does, so nothing partial could be shown either way.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterator
from typing import Any, cast

from llama_index.core.base.llms.types import ChatResponse
from llama_index.core.program.utils import process_streaming_objects
from pydantic import BaseModel, ValidationError

from llamaindex_specrag.llms.tools import CUT_OFF, cut_off


def schema_format(output_cls: type[BaseModel], llm_kwargs: dict[str, Any] | None
                  ) -> dict[str, Any]:
    """The chat call's keywords: the caller's, and the output class's JSON schema as the reply's
    ``response_format``."""
    return {**(llm_kwargs or {}), "response_format": {
        "type": "json_schema", "schema": output_cls.model_json_schema()}}


class _Partials:
    """The objects a streamed structured reply gives: a partial object per response (fields
    filled as they complete), then the whole reply validated as ``output_cls``."""

    def __init__(self, output_cls: type[BaseModel]):
        self._output_cls = output_cls
        self._current: BaseModel | None = None
        self._last: ChatResponse | None = None

    def add(self, response: ChatResponse) -> BaseModel:
        self._last = response
        cur = None if self._current is None else [self._current]
        # one object, never a list: parallel calls are not asked for
        current = cast(BaseModel, process_streaming_objects(response, self._output_cls,
                                                            cur_objects=cur))
        self._current = current
        return current

    def whole(self) -> list[BaseModel]:
        """The validated object, once a response came (none for an empty stream)."""
        if self._last is None:
            return []
        try:
            return [self._output_cls.model_validate_json(self._last.message.content or "")]
        except ValidationError as e:
            if cut_off(self._last):
                raise ValueError(CUT_OFF.format("JSON object")) from e
            raise


def partial_objects(responses: Iterator[ChatResponse], output_cls: type[BaseModel]
                    ) -> Generator[BaseModel, None, None]:
    """The objects of a streamed reply (:class:`_Partials`)."""
    partials = _Partials(output_cls)
    for response in responses:
        yield partials.add(response)
    yield from partials.whole()


async def apartial_objects(responses: AsyncIterator[ChatResponse], output_cls: type[BaseModel]
                           ) -> AsyncGenerator[BaseModel, None]:
    """:func:`partial_objects` of an async stream."""
    partials = _Partials(output_cls)
    async for response in responses:
        yield partials.add(response)
    for whole in partials.whole():
        yield whole
