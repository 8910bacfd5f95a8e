"""``SpeculativeLLM``: a LlamaIndex LLM backed by a specrag token engine (adapter only).

Use it wherever LlamaIndex takes an LLM (``index.as_query_engine(llm=SpeculativeLLM())``). The
default engine, ReSpec, drafts from the prompt (which holds the retrieved context) and from any
``documents`` given as a field or per call. Engines are resolved by name through
``shared_core.engines.registry``; ``engine_options`` go to the engine unchanged. Weights load on
first use, once per (model, device, dtype) per process, with one lock per loaded model; the
async methods run generation on worker threads. Chat messages use the model's chat template;
``complete(prompt)`` wraps the prompt as one user turn unless ``formatted=True``. Stop strings
are cut from the returned text. Engine stats are in ``raw`` / ``additional_kwargs``.

Sharing: ``complete`` / ``chat`` hold the model's lock for the whole generation; the streaming
methods take it for one step at a time and never across a ``yield`` (see
``shared_core.frontend.serving``), so a half-read stream never blocks another call. Inputs are validated
before the model is loaded: text blocks only (``ImageBlock`` and other media raise
``NotImplementedError``), ``content=None`` refused, ``max_new_tokens`` (per call also
``max_tokens``) an int >= 1. Each public method checks its call before LlamaIndex's callback
runs: the callback reads ``metadata``, which without a ``context_window`` loads the model (the
async methods load it on a worker thread first, so the event loop never waits for a load).
"""

from __future__ import annotations

import asyncio
from collections.abc import (
    AsyncGenerator,
    AsyncIterator,
    Awaitable,
    Callable,
    Generator,
    Iterator,
    Sequence,
)
from typing import TYPE_CHECKING, Any, TypeVar

from llama_index.core.base.llms.generic_utils import (
    messages_to_prompt as generic_messages_to_prompt,
)
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    LogProb,
    MessageRole,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr, field_validator
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import default_completion_to_prompt
from llama_index.core.prompts import PromptTemplate
from llama_index.core.types import PydanticProgramMode
from pydantic import BaseModel

from llamaindex_specrag.llms.structured import apartial_objects, partial_objects, schema_format
from llamaindex_specrag.llms.tools import (
    chat_dicts,
    prepare_chat_with_tools,
    reply_message,
    tool_message,
    tool_selections,
)
from shared_core.config import DEFAULT_MAX_NEW_TOKENS, check_int
from shared_core.decoding.tool_calls import template_takes_tools
from shared_core.frontend.chat import ChatEvent, ChatSettings, ChatStream, Finished, chat, chat_model
from shared_core.frontend.chat_events import CallReport, FoundCall
from shared_core.frontend.serving import FairLock, iterate_in_thread
from shared_core.runtime.protocol import SessionLM, check_session_lm
from shared_core.util.redact import redact

if TYPE_CHECKING:
    from shared_core.engines.loop import Prompt


T = TypeVar("T")


async def _last(items: AsyncIterator[T]) -> T:
    """The final (complete) response of a stream."""
    empty = True
    async for last in items:  # noqa: B007 - only the final response is returned
        empty = False
    if empty:
        msg = "the response stream ended before its first response"
        raise RuntimeError(msg)
    return last


def _traced(callback: Callable[[], Callable[..., Any]], llm: Any, first: Any,
            kwargs: dict[str, Any], run: Callable[[], T]) -> T:
    """``run()`` inside LlamaIndex's ``callback`` (``llm_completion_callback`` /
    ``llm_chat_callback``: its events and span), reporting ``first`` (the prompt or messages) and
    ``kwargs`` as a decorated method would."""
    def method(_llm: Any, _first: Any, **_kwargs: Any) -> T:
        return run()

    result: T = callback()(method)(llm, first, **kwargs)
    return result


def _atraced(callback: Callable[[], Callable[..., Any]], llm: Any, first: Any,
             kwargs: dict[str, Any], run: Callable[[], Awaitable[T]]) -> Awaitable[T]:
    """:func:`_traced` for a coroutine."""
    async def method(_llm: Any, _first: Any, **_kwargs: Any) -> T:
        return await run()

    result: Awaitable[T] = callback()(method)(llm, first, **kwargs)
    return result


def _raw(report: CallReport) -> dict[str, Any]:
    """A response's ``raw``: the report, and its token counts as ``usage`` too, where
    LlamaIndex's ``TokenCountingHandler`` reads them (as from an OpenAI response)."""
    usage = {"prompt_tokens": report.prompt_tokens, "completion_tokens": report.completion_tokens,
             "total_tokens": report.prompt_tokens + report.completion_tokens}
    return {**report.as_dict(), "usage": usage}


def _logprobs(report: CallReport) -> list[list[LogProb]] | None:
    """LlamaIndex's ``logprobs``: per reply token, its ``top_logprobs`` most likely tokens (as
    LlamaIndex's OpenAI LLM reads them), or the token itself when none were asked for."""
    if report.logprobs is None:
        return None
    return [[LogProb(token=t["token"], logprob=t["logprob"], bytes=t["bytes"] or [])
             for t in (entry["top_logprobs"] or [entry])] for entry in report.logprobs]


def _completion_steps(events: Iterator[ChatEvent]) -> CompletionResponseGen:
    """Each response holds the text so far and its ``delta``; the last one, the report."""
    text = ""
    for event in events:
        if isinstance(event, Finished):
            raw = _raw(event.report)
            yield CompletionResponse(text=event.reply.text, delta=event.rest.text, raw=raw,
                                     additional_kwargs=dict(raw),
                                     logprobs=_logprobs(event.report))
            return
        text += event.text
        yield CompletionResponse(text=text, delta=event.text, raw=None, additional_kwargs={})


def _chat_steps(stream: ChatStream, events: Iterator[ChatEvent]) -> ChatResponseGen:
    """Each response holds the message so far (with tools: content without the calls' text, the
    calls completed so far) and its ``delta``; the last one equals ``chat``'s reply."""
    content = ""
    found: list[FoundCall] = []
    for event in events:
        if isinstance(event, Finished):
            raw = _raw(event.report)
            message = reply_message(event.reply, bool(stream.tools))
            yield ChatResponse(message=message, delta=event.rest.text, raw=raw,
                               additional_kwargs=dict(raw), logprobs=_logprobs(event.report))
            return
        content, found = content + event.text, [*found, *event.calls]
        message = (tool_message(content, found) if stream.tools
                   else ChatMessage(role=MessageRole.ASSISTANT, content=content))
        yield ChatResponse(message=message, delta=event.text, raw=None, additional_kwargs={})


class SpeculativeLLM(ChatSettings, CustomLLM, FunctionCallingLLM):
    """LlamaIndex LLM running a speculative engine on a local model (default: ReSpec, SmolLM2).

    Settings: :class:`~shared_core.frontend.chat_settings.ChatSettings` (the same as
    ``ChatSpeculative``'s) plus ``max_new_tokens`` (the token limit; ``None`` = the default;
    per call ``max_tokens`` is accepted too), ``context_window`` and a preloaded ``lm`` (first
    positional argument).

    A ``FunctionCallingLLM``: ``chat_with_tools`` / ``predict_and_call`` / ``FunctionAgent`` /
    ``structured_predict`` (a forced, grammar-constrained call of the output class's tool).
    ``is_function_calling_model`` is True when the model's chat template renders tools (Qwen2.5)
    and also for templates without (SmolLM2), whose prompts get the same tool format written in.
    Streamed with tools (``stream_chat_with_tools``), text deltas arrive as generated (never a
    call's text); each response carries the calls completed so far in ``additional_kwargs``, and
    the last equals ``chat_with_tools``' reply.
    """

    max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS  # None: the default, as LangChain's max_tokens
    context_window: int | None = Field(default=None, description="None = the model's window")
    _lm: Any = PrivateAttr(default=None)  # a preloaded shared_core LM (else the shared cache)

    @field_validator("context_window", mode="before")
    @classmethod
    def _check_context_window(cls, value: Any) -> Any:
        return check_int(value, "context_window", optional=True)  # None or an int >= 1

    def __init__(self, lm: Any = None, **kwargs: Any) -> None:
        if lm is not None:
            check_session_lm(lm)  # a served model or a name: TypeError naming lm, now
        super().__init__(**kwargs)
        self._lm = lm

    def __reduce__(self) -> tuple[Any, ...]:
        return self.reduce_with(self._lm)

    @classmethod
    def class_name(cls) -> str:
        return "SpeculativeLLM"

    def _model(self, override: str | None = None) -> tuple[Any, FairLock]:
        """The preloaded LM, else the shared cache's (looked up per call, so
        ``serving.release`` frees it)."""
        return chat_model(self, self._lm, override)

    def loaded_model(self) -> SessionLM:
        """The model a call runs on (loaded now if needed): what ``warm_passages(self, ...)``
        warms (:class:`shared_core.runtime.passage_cache.ModelProvider`)."""
        model: SessionLM = self._model()[0]
        return model

    @property
    def metadata(self) -> LLMMetadata:
        window = self.context_window or self._model()[0].max_context
        return LLMMetadata(context_window=window,
                           num_output=self.token_limit(),
                           is_chat_model=True, is_function_calling_model=True,
                           model_name=redact(self.answering_model(self._lm)),
                           system_role=MessageRole.SYSTEM)

    async def _resolved(self) -> None:
        """Load the settings' model now, on a worker thread, if ``metadata`` would load it:
        LlamaIndex's callback reads ``metadata`` (the model's window) on the event loop."""
        if self._lm is None and self.context_window is None:
            await asyncio.to_thread(self._model)

    def template_takes_tools(self) -> bool:
        """True if the model's own chat template renders tools (else the format is written in)."""
        return template_takes_tools(self._model()[0])

    # -- one generation path ----------------------------------------------------------------
    def _chat_call(self, prompt: Prompt, kwargs: dict[str, Any], *, parse_tools: bool = True
                   ) -> ChatStream:
        """The one core call, checked now, before any model work (``kwargs`` is left as given:
        LlamaIndex's callback reports it)."""
        return chat(self, prompt, kwargs, self._lm, parse_tools=parse_tools)

    def _messages(self, prompt: str, formatted: bool) -> Prompt:
        """A completion's prompt: as given when ``formatted``, else formatted by a
        ``completion_to_prompt`` the user set (as LlamaIndex's ``LlamaCPP`` does), else one
        user turn for the model's chat template."""
        if not isinstance(prompt, str):
            msg = f"prompt must be a str, got {type(prompt).__name__}"
            raise TypeError(msg)
        if formatted:
            return prompt
        own = self.completion_to_prompt
        if own is not None and own is not default_completion_to_prompt:
            return own(prompt)
        turns = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*turns, {"role": "user", "content": prompt}]

    def _turns(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> Prompt:
        """A chat's prompt: formatted by a ``messages_to_prompt`` the user set, else (and always
        when the call offers tools or asks for a ``response_format``, which the chat template
        renders) the turns for the model's chat template."""
        own = self.messages_to_prompt
        if (own is not None and own is not generic_messages_to_prompt
                and not kwargs.get("tools") and not kwargs.get("response_format")):
            return own(messages)
        return chat_dicts(messages)

    def _completion(self, prompt: str, formatted: bool, kwargs: dict[str, Any]) -> ChatStream:
        """A completion leaves tool calls in the text."""
        return self._chat_call(self._messages(prompt, formatted), kwargs, parse_tools=False)

    @staticmethod
    def _complete(stream: ChatStream) -> CompletionResponse:
        done = stream.finish()  # the whole generation under the lock
        raw = _raw(done.report)
        return CompletionResponse(text=done.reply.text, raw=raw, additional_kwargs=dict(raw),
                                  logprobs=_logprobs(done.report))

    @staticmethod
    def _stream_complete(stream: ChatStream, *, now: bool = True) -> CompletionResponseGen:
        """The model is resolved now (``now=False``: at the first step, on the thread that takes
        it); the lock is taken per step, never while the caller reads."""
        return _completion_steps(iter(stream.open() if now else stream))

    @staticmethod
    def _chat(stream: ChatStream) -> ChatResponse:
        done = stream.finish()
        raw = _raw(done.report)
        return ChatResponse(message=reply_message(done.reply, bool(stream.tools)), raw=raw,
                            additional_kwargs=dict(raw), logprobs=_logprobs(done.report))

    @staticmethod
    def _stream_chat(stream: ChatStream, *, now: bool = True) -> ChatResponseGen:
        """As :meth:`_stream_complete`, with the reply's tool calls."""
        return _chat_steps(stream, iter(stream.open() if now else stream))

    # -- streamed structured output: JSON under the output class's schema (llms.structured) ---
    def _structured_stream_call(self, output_cls: type[BaseModel], prompt: PromptTemplate,
                                llm_kwargs: dict[str, Any] | None = None, **prompt_args: Any
                                ) -> Generator[Any, None, None]:
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:
            return super()._structured_stream_call(output_cls, prompt, llm_kwargs, **prompt_args)
        responses = self.stream_chat(self._get_messages(prompt, **prompt_args),
                                     **schema_format(output_cls, llm_kwargs))
        return partial_objects(responses, output_cls)

    async def _structured_astream_call(self, output_cls: type[BaseModel], prompt: PromptTemplate,
                                       llm_kwargs: dict[str, Any] | None = None,
                                       **prompt_args: Any) -> AsyncGenerator[Any, None]:
        if self.pydantic_program_mode != PydanticProgramMode.DEFAULT:
            return await super()._structured_astream_call(output_cls, prompt, llm_kwargs,
                                                          **prompt_args)
        responses = await self.astream_chat(self._get_messages(prompt, **prompt_args),
                                            **schema_format(output_cls, llm_kwargs))
        return apartial_objects(responses, output_cls)

    # -- FunctionCallingLLM ---------------------------------------------------------------------
    def _prepare_chat_with_tools(self, tools: Sequence[Any], user_msg: str | ChatMessage | None = None,
                                 chat_history: list[ChatMessage] | None = None,
                                 verbose: bool = False, allow_parallel_tool_calls: bool = False,
                                 tool_required: bool = False, **kwargs: Any) -> dict[str, Any]:
        return prepare_chat_with_tools(tools, user_msg, chat_history, tool_required, kwargs,
                                       parallel=allow_parallel_tool_calls)

    def get_tool_calls_from_response(self, response: ChatResponse,
                                     error_on_no_tool_call: bool = True, **kwargs: Any
                                     ) -> list[Any]:
        return tool_selections(response, error_on_no_tool_call)

    # -- public API: sync, streaming, and async on worker threads ---------------------------
    # each checks its call first, then runs inside LlamaIndex's callback (``_traced``)
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        stream = self._completion(prompt, formatted, kwargs)
        return _traced(llm_completion_callback, self, prompt, kwargs,
                       lambda: self._complete(stream))

    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any
                        ) -> CompletionResponseGen:
        stream = self._completion(prompt, formatted, kwargs)
        return _traced(llm_completion_callback, self, prompt, kwargs,
                       lambda: self._stream_complete(stream))

    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any
                        ) -> CompletionResponse:
        stream = self._completion(prompt, formatted, kwargs)
        await self._resolved()

        async def run() -> CompletionResponse:
            # step by step on a worker thread: a cancelled call stops within one step
            return await _last(iterate_in_thread(self._stream_complete(stream, now=False)))

        return await _atraced(llm_completion_callback, self, prompt, kwargs, run)

    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any
                               ) -> CompletionResponseAsyncGen:
        stream = self._completion(prompt, formatted, kwargs)
        await self._resolved()

        async def run() -> CompletionResponseAsyncGen:
            return iterate_in_thread(self._stream_complete(stream, now=False))

        return await _atraced(llm_completion_callback, self, prompt, kwargs, run)

    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        stream = self._chat_call(self._turns(messages, kwargs), kwargs)
        return _traced(llm_chat_callback, self, messages, kwargs, lambda: self._chat(stream))

    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        stream = self._chat_call(self._turns(messages, kwargs), kwargs)
        return _traced(llm_chat_callback, self, messages, kwargs,
                       lambda: self._stream_chat(stream))

    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        stream = self._chat_call(self._turns(messages, kwargs), kwargs)
        await self._resolved()

        async def run() -> ChatResponse:
            return await _last(iterate_in_thread(self._stream_chat(stream, now=False)))

        return await _atraced(llm_chat_callback, self, messages, kwargs, run)

    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any
                           ) -> ChatResponseAsyncGen:
        stream = self._chat_call(self._turns(messages, kwargs), kwargs)
        await self._resolved()

        async def run() -> ChatResponseAsyncGen:
            return iterate_in_thread(self._stream_chat(stream, now=False))

        return await _atraced(llm_chat_callback, self, messages, kwargs, run)
