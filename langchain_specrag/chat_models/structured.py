"""``ChatSpeculative.with_structured_output``: the model bound to a response format (or a forced
tool call) piped into LangChain's own output parsers."""

from __future__ import annotations

from operator import itemgetter
from typing import Any

from langchain_core.exceptions import OutputParserException
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import BaseMessage
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import (
    JsonOutputKeyToolsParser,
    PydanticToolsParser,
)
from langchain_core.outputs import ChatGeneration, Generation
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass

from shared_core.decoding.constrained import check_json_schema
from shared_core.frontend.chat import check_response_format

METHODS = ("json_schema", "json_mode", "function_calling")
# keywords that describe a schema without constraining a value
_ANNOTATIONS = frozenset({"title", "description", "$schema", "$id", "$comment", "default",
                          "examples", "$defs", "definitions", "deprecated", "readOnly",
                          "writeOnly"})


def _unwrapped(schema: Any) -> Any:
    """The JSON schema inside OpenAI's response-format wrappers (``{"type": "json_schema",
    "json_schema": {...}}`` and ``{"name", "schema"[, "strict"]}``), titled with its name;
    anything else as it is."""
    if isinstance(schema, dict) and schema.get("type") == "json_schema" and isinstance(
            schema.get("json_schema"), dict):
        schema = schema["json_schema"]
    if isinstance(schema, dict) and isinstance(schema.get("schema"), dict) and set(schema) <= {
            "name", "schema", "strict", "description"}:
        inner, name = schema["schema"], schema.get("name")
        return {**inner, "title": name} if name else inner
    return schema


def _json_schema(schema: Any) -> dict[str, Any]:
    """``schema`` as the JSON schema decoding is constrained to; a schema that LangChain's
    conversion leaves constraining nothing (e.g. a top-level ``anyOf``) is refused."""
    if isinstance(schema, dict) and schema.get("type") != "function":  # not an OpenAI tool
        check_json_schema(schema, "schema")  # LangChain's conversion fails unclearly
    converted = convert_to_json_schema(schema)
    if not set(converted) - _ANNOTATIONS:
        name = converted.get("title") or type(schema).__name__
        msg = (f"schema {name!r} constrains nothing once converted ({converted!r:.120}): give "
               "an object schema with 'type' / 'properties'")
        raise ValueError(msg)
    return converted


class _Complete:
    """A parser mixin: a reply the token limit cut off is an ``OutputParserException`` naming
    ``max_tokens`` (as ChatOpenAI refuses a ``finish_reason="length"`` parse), not a partial
    object or ``None``; with ``include_raw`` it is the ``parsing_error``. Streamed partial
    objects are still parsed as they grow."""

    def parse_result(self, result: list[Generation], *, partial: bool = False) -> Any:
        if not partial and result and isinstance(result[0], ChatGeneration):
            message = result[0].message
            if message.response_metadata.get("finish_reason") == "length":
                used = (getattr(message, "usage_metadata", None) or {}).get("output_tokens")
                msg = (f"the reply reached max_tokens ({used} tokens) before the structured "
                       "output was complete; raise max_tokens")
                raise OutputParserException(msg, llm_output=message.text)
        return super().parse_result(result, partial=partial)  # type: ignore[misc]


class _Pydantic(_Complete, PydanticOutputParser):  # type: ignore[type-arg]
    pass


class _Json(_Complete, JsonOutputParser):
    pass


class _PydanticTools(_Complete, PydanticToolsParser):
    pass


class _JsonKeyTools(_Complete, JsonOutputKeyToolsParser):
    pass


def _bound(model: BaseChatModel, schema: Any, method: str, kwargs: dict[str, Any]
           ) -> tuple[Runnable[LanguageModelInput, BaseMessage], Runnable[BaseMessage, Any]]:
    """The model with the format bound, and the parser of its reply."""
    pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
    trace = ({"ls_structured_output_format": {"kwargs": {"method": method}, "schema": schema}}
             if schema is not None else {})
    if method == "function_calling":
        name = convert_to_openai_tool(schema)["function"]["name"]
        bound = model.bind_tools([schema], tool_choice=name, **trace, **kwargs)
        tools_parser = (_PydanticTools(tools=[schema], first_tool_only=True) if pydantic
                        else _JsonKeyTools(key_name=name, first_tool_only=True))
        return bound, tools_parser
    if method == "json_schema":
        fmt = {"type": "json_schema", "schema": _json_schema(schema)}
        check_response_format(fmt)  # refused now, not when the chain is invoked
    else:
        fmt = {"type": "json_object"}
    bound = model.bind(response_format=fmt, **trace, **kwargs)
    parser = _Pydantic(pydantic_object=schema) if pydantic else _Json()
    return bound, parser


def structured_output(model: BaseChatModel, schema: Any, *, method: str = "json_schema",
                      include_raw: bool = False, **kwargs: Any
                      ) -> Runnable[LanguageModelInput, Any]:
    """See :meth:`ChatSpeculative.with_structured_output`."""
    if method not in METHODS:
        msg = f"method={method!r} is not one of {list(METHODS)}"
        raise ValueError(msg)
    if schema is None and method != "json_mode":
        msg = f"schema is required for method={method!r} (only json_mode takes none)"
        raise ValueError(msg)
    if not isinstance(include_raw, bool):
        msg = f"include_raw must be a bool, got {type(include_raw).__name__}"
        raise TypeError(msg)
    kwargs.pop("strict", None)  # decoding is always constrained to the schema
    bound, parser = _bound(model, _unwrapped(schema), method, kwargs)
    if not include_raw:
        return bound | parser
    parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser,
                                        parsing_error=lambda _: None)
    failed = RunnablePassthrough.assign(parsed=lambda _: None)
    return RunnableMap(raw=bound) | parsed.with_fallbacks([failed], exception_key="parsing_error")
