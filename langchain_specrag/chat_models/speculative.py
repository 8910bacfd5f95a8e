"""``ChatSpeculative``: a LangChain chat model backed by a specrag token engine (adapter only).

Swap it for any chat model in an existing chain (``retriever | prompt | ChatSpeculative()``):
the default engine, ReSpec, drafts from the prompt (which holds the retrieved context) and from
any ``documents`` passed as a field or per call. Engines are resolved by name through
``shared_core.engines.registry`` (``"respec"``, ``"autoregressive"``, ``"rapid"``, ...);
``engine_options`` go to the engine unchanged. Weights load on first use, once per
(model, device, dtype) per process, with one lock per loaded model. Stop strings are cut from
the returned text (the stop string itself is not included).

Sharing: ``invoke`` holds the model's lock for its whole generation; ``stream`` / ``astream``
take it for one step at a time and never across a ``yield`` (see ``shared_core.frontend.serving``), so a
half-read stream never blocks another call, in this thread or another. ``ainvoke`` and
``astream`` run on worker threads that stop within one step when cancelled or abandoned.
Tools: ``bind_tools`` (the model's chat template renders them, or the Hermes/Qwen format is
written into the system turn), replies parsed into ``tool_calls`` / ``invalid_tool_calls``
(under ``tool_choice="auto"`` any call the model opens is grammar-constrained to a bound tool
and its schema); streamed with tools, text arrives as it is generated and each call as a
``tool_call_chunks`` chunk once complete, adding up to what ``invoke`` returns (an invalid
call's raw text arrives JSON-quoted, so that LangChain's re-parsing keeps it invalid);
``with_structured_output`` constrains decoding to the schema (xgrammar). Pickling keeps the
settings only (a preloaded model is reloaded by name through the shared cache on first use).
Inputs are validated before the model is loaded: text content only (image and other media
parts raise ``NotImplementedError``), known roles, ``max_tokens`` an int >= 1 (0 is refused,
never replaced by a default).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any, ClassVar

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import LangSmithParams, LanguageModelInput
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.language_models.model_profile import ModelProfile
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    ToolMessage,
)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.tool import ToolCallChunk
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable
from langchain_core.tools import BaseTool
from pydantic import AliasChoices, ConfigDict, Field, field_validator, model_validator

from langchain_specrag.chat_models.structured import structured_output
from shared_core.config import (
    DEFAULT_LM,
    DEFAULT_MAX_NEW_TOKENS,
    PENALTY_SETTINGS,
    SAMPLING_SETTINGS,
)
from shared_core.decoding.constrained import xgrammar_available
from shared_core.decoding.output import ChatTurns, chat_turns
from shared_core.decoding.tool_calls import check_tool_choice, check_tools
from shared_core.frontend.chat import (
    LOGPROB_SETTINGS,
    CallReport,
    ChatSettings,
    ChatStream,
    Finished,
    FoundCall,
    Reply,
    chat,
    chat_model,
    prompt_length,
)
from shared_core.frontend.serving import FairLock, iterate_in_thread
from shared_core.runtime.protocol import SessionLM, check_session_lm
from shared_core.util.redact import redact, redacted_dump

# the settings a reply depends on (with the documents and a preloaded model: _identifying_params)
_REPLY_SETTINGS = ("model", "engine", "engine_options", *SAMPLING_SETTINGS, *PENALTY_SETTINGS,
                   *LOGPROB_SETTINGS, "max_tokens", "stop", "device", "dtype", "backend", "exact")
_CALL_PARTS = ("tool_use", "tool_call", "function_call")  # provider forms of a tool call
_REASONING_PARTS = ("reasoning", "thinking", "redacted_thinking")  # LangChain v1, Anthropic
# call options LangChain (or code written for ChatOpenAI) passes that change nothing here:
# ``stream`` is BaseChatModel's switch (``invoke(..., stream=True)`` streams through _stream);
# usage is always reported on the last chunk; a local model makes no requests to time out
_LANGCHAIN_CALL_SWITCHES = frozenset({"stream", "stream_usage", "stream_options", "timeout"})
_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool",
          "function": "tool", "developer": "system", "user": "user", "assistant": "assistant"}


def _message_text(index: int, message: BaseMessage) -> str:
    """The text of a message; any other content part is refused, never dropped, except an AI
    message's tool calls (its ``tool_calls`` carry them) and reasoning (another model's
    thoughts, which a chat template does not render)."""
    content = message.content
    if isinstance(content, str):
        return content
    skipped = _CALL_PARTS + _REASONING_PARTS if _is_ai(message) else _CALL_PARTS
    parts = []
    for part in content:
        if isinstance(part, str):
            parts.append(part)
        elif isinstance(part, dict) and part.get("type") == "text":
            parts.append(str(part.get("text", "")))
        elif isinstance(part, dict) and part.get("type") in skipped:
            continue
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            msg = (f"message {index} has a {kind!r} content part; ChatSpeculative handles text "
                   "only (images and other media are not supported)")
            raise NotImplementedError(msg)
    return "".join(parts)


def _role(message: BaseMessage) -> str:
    return message.role if isinstance(message, ChatMessage) else message.type


def _is_ai(message: BaseMessage) -> bool:
    return _ROLES.get(_role(message)) == "assistant"


def _turn(index: int, message: BaseMessage) -> dict[str, Any]:
    role = _role(message)
    turn: dict[str, Any] = {"role": _ROLES.get(role, role), "content": _message_text(index, message)}
    if isinstance(message, AIMessage) and message.tool_calls:
        turn["tool_calls"] = [{"name": c["name"], "arguments": c["args"], "id": c.get("id")}
                              for c in message.tool_calls]
    if isinstance(message, ToolMessage):
        turn["tool_call_id"] = message.tool_call_id
    return turn


def to_chat_messages(messages: Sequence[BaseMessage]) -> ChatTurns:
    """LangChain messages as ``{"role", "content"}`` dicts for the chat template (an AI
    message's tool calls and a tool message's call id kept), checked once: the engines take
    them unchecked."""
    return chat_turns([_turn(i, m) for i, m in enumerate(messages)])


def _check_usage_options(options: dict[str, Any]) -> None:
    """OpenAI's switches for usage on the last chunk, ``stream_usage`` (a bool or None) and
    ``stream_options`` (a dict or None): TypeError naming a malformed one."""
    stream_usage = options.get("stream_usage")
    if stream_usage is not None and not isinstance(stream_usage, bool):
        msg = f"stream_usage must be a bool or None, got {type(stream_usage).__name__}"
        raise TypeError(msg)
    stream_options = options.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        msg = f"stream_options must be a dict or None, got {type(stream_options).__name__}"
        raise TypeError(msg)


def _call_chunk(call: FoundCall, index: int) -> ToolCallChunk:
    """One whole call as a chunk. LangChain re-parses chunk arguments when chunks are added, so
    an invalid call's raw text goes as a JSON string: it stays invalid (never a runnable call)."""
    args = json.dumps(call.arguments, ensure_ascii=False)  # an object, or a string if invalid
    return ToolCallChunk(name=call.name, args=args, id=call.id, index=index,
                         type="tool_call_chunk")


def _reply_fields(reply: Reply) -> dict[str, Any]:
    """The message fields of a reply: content, tool calls, invalid tool calls."""
    return {"content": reply.content,
            "tool_calls": [{"name": c.name, "args": c.arguments, "id": c.id, "type": "tool_call"}
                           for c in reply.tool_calls],
            "invalid_tool_calls": [{"name": c.name, "args": c.arguments, "id": c.id,
                                    "error": c.error, "type": "invalid_tool_call"}
                                   for c in reply.invalid_tool_calls]}


def _report_fields(report: CallReport) -> dict[str, Any]:
    """Usage and metadata of a finished call (a valid tool call, if any, is the finish)."""
    usage = UsageMetadata(input_tokens=report.prompt_tokens,
                          output_tokens=report.completion_tokens,
                          total_tokens=report.prompt_tokens + report.completion_tokens)
    if report.cached_prompt_tokens:  # prompt ids whose KV the runtime kept (llama.cpp)
        usage["input_token_details"] = {"cache_read": report.cached_prompt_tokens}
    metadata = {"model_name": redact(report.model), "finish_reason": report.finish_reason,
                "engine": report.engine, "speculative_stats": report.speculative_stats}
    if report.passage_cache:  # reused / recomputed / read prompt ids (passage_cache)
        metadata["passage_cache"] = report.passage_cache
    if report.logprobs is not None:  # as ChatOpenAI's (a stream's last chunk holds them all)
        metadata["logprobs"] = {"content": report.logprobs, "refusal": None}
    return {"usage_metadata": usage, "response_metadata": metadata}


def _message(done: Finished) -> AIMessage:
    return AIMessage(**_reply_fields(done.reply), **_report_fields(done.report))


def _last_chunk(done: Finished) -> ChatGenerationChunk:
    """The final chunk: usage and metadata (``finish_reason`` "tool_calls" after a valid call,
    as ``invoke`` reports it)."""
    return ChatGenerationChunk(message=AIMessageChunk(content="", **_report_fields(done.report),
                                                      chunk_position="last"))


class ChatSpeculative(ChatSettings, BaseChatModel):
    """Chat model running a speculative engine on a local model (default: ReSpec on SmolLM2).

    Settings: :class:`~shared_core.frontend.chat_settings.ChatSettings` (the same as
    ``SpeculativeLLM``'s) plus ``max_tokens`` (LangChain's name for the token limit; ``None`` =
    the default), ``streaming`` and a preloaded ``lm``. LangChain's standard ``timeout``,
    ``max_retries`` and ``api_key`` are accepted and ignored (a local model makes no requests),
    and so is ``stream_usage`` (a bool: usage is always reported on the last chunk); a
    ``base_url`` other than None is refused (the model answers in this process, not at that
    server); any other unknown setting is a ``TypeError`` naming the closest valid one. Per call,
    ``timeout``, ``stream_usage`` and ``stream_options`` are accepted and ignored the same way.

    Example:
        ``ChatSpeculative(model="smollm2-135m-instruct", max_tokens=128).invoke("Hi")``
    """

    model_config = ConfigDict(populate_by_name=True, arbitrary_types_allowed=True)
    IGNORED_SETTINGS: ClassVar[tuple[str, ...]] = ("timeout", "max_retries", "api_key", "base_url",
                                                   "stream_usage")
    TOKEN_LIMIT: ClassVar[str] = "max_tokens"

    # accepted as model_name too; the field keeps its name for type checkers (dataclass_transform
    # makes an alias the only keyword they accept)
    model: str = Field(default=DEFAULT_LM, validation_alias=AliasChoices("model", "model_name"))
    max_tokens: int | None = DEFAULT_MAX_NEW_TOKENS
    streaming: bool = False
    lm: Any = Field(default=None, exclude=True)  # a preloaded shared_core LM (optional)
    DERIVED: ClassVar[frozenset[str]] = frozenset({"lm", "profile"})  # profile: recomputed

    @field_validator("lm")
    @classmethod
    def _preloaded(cls, lm: object) -> object:
        if lm is not None:
            check_session_lm(lm)  # a served model or a name: TypeError naming lm, now
        return lm

    @model_validator(mode="before")
    @classmethod
    def _checked_stream_usage(cls, data: object) -> object:
        if isinstance(data, dict):
            _check_usage_options(data)  # checked here: IGNORED_SETTINGS drops it unchecked
            if data.get("base_url") is not None:
                msg = (f"base_url={redact(str(data['base_url']))!r}: ChatSpeculative runs its "
                       "model in this process and sends no requests; a served model (vLLM, "
                       "SGLang) drafts or verifies in Speculative RAG (SpeculativeRAGRunnable) "
                       "and generates in RaLMSpec (RaLMSpecRunnable) as RemoteLM(url)")
                raise ValueError(msg)
        return data

    def __reduce__(self) -> tuple[Any, ...]:
        return self.reduce_with(self.lm)

    @property
    def _llm_type(self) -> str:
        return "specrag-speculative-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        """Every setting that changes a reply (LangChain's LLM cache keys on these): the
        decoding settings, where the model runs, a preloaded model's name and a digest of the
        documents."""
        params = {name: getattr(self, name) for name in _REPLY_SETTINGS}
        params["documents"] = (None if self.documents is None else hashlib.sha256(
            "\x00".join(self.documents).encode()).hexdigest())
        if self.lm is not None:
            params["lm"] = f"{getattr(self.lm, 'backend', 'torch')}:{self.lm.name}"
        dumped: dict[str, Any] = redacted_dump(params)
        return dumped

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "specrag"
        params["ls_model_name"] = redact(kwargs.get("model", self.answering_model(self.lm)))
        params["ls_model_type"] = "chat"
        params["ls_temperature"] = kwargs.get("temperature", self.temperature)
        if self.max_tokens is not None:
            params["ls_max_tokens"] = kwargs.get("max_tokens", self.max_tokens)
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    def _model(self, override: str | None = None) -> tuple[Any, FairLock]:
        return chat_model(self, self.lm, override)

    def loaded_model(self) -> SessionLM:
        """The model a call runs on (loaded now if needed): what ``warm_passages(self, ...)``
        warms (:class:`shared_core.runtime.passage_cache.ModelProvider`)."""
        model: SessionLM = self._model()[0]
        return model

    def _resolve_model_profile(self) -> ModelProfile | None:
        """What any model here can do (text in and out, tool calls, structured output with the
        ``constrained`` extra); ``max_input_tokens`` (SummarizationMiddleware's fraction
        triggers) only for a preloaded ``lm``: a named model is not loaded to learn it."""
        profile = ModelProfile(text_inputs=True, text_outputs=True, image_inputs=False,
                               tool_calling=True, tool_choice=True, tool_call_streaming=True,
                               structured_output=xgrammar_available(), temperature=True)
        if self.lm is not None:
            profile["max_input_tokens"] = int(self.lm.max_context)
        return profile

    # -- token counts (trim_messages, token budgets): the model's own tokenizer and template ----
    def get_token_ids(self, text: str) -> list[int]:
        """``text``'s ids under the model's tokenizer (the model loads on first use), or under
        LangChain's ``custom_get_token_ids`` when one is set."""
        if self.custom_get_token_ids is not None:
            return self.custom_get_token_ids(text)
        return list(self._model()[0].encode(text))

    def get_num_tokens_from_messages(self, messages: list[BaseMessage],
                                     tools: Sequence[Any] | None = None) -> int:
        """The tokens the model reads ``messages`` as, rendered by its chat template, with
        ``tools`` (any form ``bind_tools`` takes) shown as a call shows them (LangChain's own
        estimate when ``custom_get_token_ids`` is set)."""
        from langchain_core.utils.function_calling import convert_to_openai_tool

        if self.custom_get_token_ids is not None:
            return super().get_num_tokens_from_messages(messages, tools)

        shown = [convert_to_openai_tool(t) for t in tools or ()]
        return prompt_length(self._model()[0], to_chat_messages(messages), shown)

    def _chat(self, messages: list[BaseMessage], stop: list[str] | None,
              kwargs: dict[str, Any]) -> ChatStream:
        """The one core call, checked now (before any model work), without the switches that
        change nothing here (``_LANGCHAIN_CALL_SWITCHES``)."""
        _check_usage_options(kwargs)
        options = {k: v for k, v in kwargs.items() if k not in _LANGCHAIN_CALL_SWITCHES}
        return chat(self, to_chat_messages(messages), {**options, "stop": stop}, self.lm)

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any
                  ) -> ChatResult:
        done = self._chat(messages, stop, kwargs).finish()
        return ChatResult(generations=[ChatGeneration(message=_message(done))])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any
                ) -> Iterator[ChatGenerationChunk]:
        """Text deltas as they come; with tools, each call as a ``tool_call_chunks`` chunk once
        complete (its text never in the content), so the chunks add up to ``invoke``'s message."""
        stream = self._chat(messages, stop, kwargs)
        index = 0
        for event in stream:
            # without tools every step is a chunk; with tools, only content and calls are
            last = event if isinstance(event, Finished) else None
            delta = event.rest if isinstance(event, Finished) else event
            if delta.text or not (last or stream.tools):
                chunk = ChatGenerationChunk(message=AIMessageChunk(content=delta.text))
                if run_manager is not None and delta.text:
                    run_manager.on_llm_new_token(delta.text, chunk=chunk)
                yield chunk
            for call in delta.calls:
                yield ChatGenerationChunk(message=AIMessageChunk(content="", tool_call_chunks=[
                    _call_chunk(call, index)]))
                index += 1
            if last is not None:
                yield _last_chunk(last)

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any
                         ) -> ChatResult:
        # step by step on a worker thread, the model loaded and its lock awaited there too: a
        # cancelled call stops within one step, a busy model never blocks the event loop
        stream = self._chat(messages, stop, kwargs)
        done = None
        async for done in iterate_in_thread(iter(stream)):  # noqa: B007 - the last is Finished
            pass
        assert isinstance(done, Finished)
        return ChatResult(generations=[ChatGeneration(message=_message(done))])

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any
                       ) -> AsyncIterator[ChatGenerationChunk]:
        async for chunk in iterate_in_thread(self._stream(messages, stop, None, **kwargs)):
            if run_manager is not None and chunk.text:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    # -- tools and structured output -------------------------------------------------------------
    def bind_tools(self, tools: Sequence[dict[str, Any] | type | Callable[..., Any] | BaseTool], *,
                   tool_choice: str | dict[str, Any] | bool | None = None, **kwargs: Any
                   ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (any form ``convert_to_openai_tool`` takes). ``tool_choice``: ``"auto"``
        (default), ``"none"``, ``"any"`` / ``"required"`` / ``True`` or a tool's name; a forced
        call is prefilled and (with ``specrag[constrained]``) grammar-constrained.
        ``strict=True`` asks for calls whose arguments match their schema: with
        ``specrag[constrained]`` every call is grammar-constrained (else ImportError).
        ``parallel_tool_calls=False`` keeps a reply's first call only."""
        from langchain_core.utils.function_calling import convert_to_openai_tool

        if kwargs.pop("strict", None) and not xgrammar_available():
            msg = "strict=True needs constrained decoding: pip install 'specrag[constrained]'"
            raise ImportError(msg)
        formatted = check_tools([convert_to_openai_tool(t) for t in tools])
        check_tool_choice(tool_choice, formatted)
        return super().bind(tools=formatted, tool_choice=tool_choice, **kwargs)

    def with_structured_output(self, schema: dict[str, Any] | type, *,
                               method: str = "json_schema", include_raw: bool = False,
                               **kwargs: Any) -> Runnable[LanguageModelInput, Any]:
        """Output parsed into ``schema`` (pydantic class, TypedDict or JSON-schema dict).

        ``method``: ``"json_schema"`` (decoding constrained to the schema), ``"json_mode"``
        (constrained to any JSON object; say in the prompt what it should hold) or
        ``"function_calling"`` (a forced call of a tool named after the schema).
        ``include_raw=True`` returns ``{"raw", "parsed", "parsing_error"}``.
        """
        return structured_output(self, schema, method=method, include_raw=include_raw, **kwargs)
