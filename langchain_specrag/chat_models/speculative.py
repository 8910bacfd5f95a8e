"""``ChatSpeculative``: a LangChain chat model backed by a specrag token engine (adapter only).

Swap it for any chat model in an existing chain (``retriever | prompt | ChatSpeculative()``):
the default engine, ReSpec, drafts from the prompt (which holds the retrieved context) and from
any ``documents`` passed as a field or per call. Engines are resolved by name through
``shared_core.engines.registry`` (``"respec"``, ``"autoregressive"``, ``"rapid"``, ...);
``engine_options`` go to the engine unchanged. Weights load on first use, once per
(model, device, dtype) per process, with one lock per loaded model. Stop strings are cut from
the returned text (the stop string itself is not included).

Sharing: ``invoke`` holds the model's lock for its whole generation; ``stream`` / ``astream``
take it for one step at a time and never across a ``yield`` (see ``shared_core.serving``), so a
half-read stream never blocks another call, in this thread or another. ``ainvoke`` and
``astream`` run on worker threads that stop within one step when cancelled or abandoned.
Inputs are validated before the model is loaded: text content only (image and other media
parts raise ``NotImplementedError``), known roles, ``max_tokens`` an int >= 1 (0 is refused,
never replaced by a default).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ChatMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from pydantic import ConfigDict, Field, PrivateAttr

from shared_core.chat_adapters import (
    ChatCall,
    ChatSettings,
    call_report,
    prepare_call,
    resolve_model,
)
from shared_core.config import DEFAULT_LM, DEFAULT_MAX_NEW_TOKENS
from shared_core.output import GenerationResult, validate_messages
from shared_core.serving import FairLock, iterate_in_thread

_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool",
          "function": "tool", "developer": "system", "user": "user", "assistant": "assistant"}


def _message_text(index: int, message: BaseMessage) -> str:
    """The text of a message; any non-text content part is refused, never dropped."""
    content = message.content
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if isinstance(part, str):
            parts.append(part)
        elif isinstance(part, dict) and part.get("type") == "text":
            parts.append(str(part.get("text", "")))
        else:
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            msg = (f"message {index} has a {kind!r} content part; ChatSpeculative handles text "
                   "only (images and other media are not supported)")
            raise NotImplementedError(msg)
    return "".join(parts)


def to_chat_messages(messages: Sequence[BaseMessage]) -> list[dict[str, str]]:
    """LangChain messages as validated ``{"role", "content"}`` dicts for the chat template."""
    out = []
    for i, m in enumerate(messages):
        role = m.role if isinstance(m, ChatMessage) else m.type
        out.append({"role": _ROLES.get(role, role), "content": _message_text(i, m)})
    return validate_messages(out)


class ChatSpeculative(ChatSettings, BaseChatModel):
    """Chat model running a speculative engine on a local model (default: ReSpec on SmolLM2).

    Settings: :class:`~shared_core.chat_adapters.ChatSettings` (the same as ``SpeculativeLLM``'s)
    plus ``max_tokens`` (LangChain's name for the token limit; ``None`` = the default),
    ``streaming`` and a preloaded ``lm``.

    Example:
        ``ChatSpeculative(model="smollm2-135m-instruct", max_tokens=128).invoke("Hi")``
    """

    model_config = ConfigDict(populate_by_name=True, arbitrary_types_allowed=True)

    model: str = Field(default=DEFAULT_LM, alias="model_name")
    max_tokens: int | None = DEFAULT_MAX_NEW_TOKENS
    streaming: bool = False
    lm: Any = Field(default=None, exclude=True)  # a preloaded shared_core LM (optional)
    _engine_state: dict[str, Any] = PrivateAttr(default_factory=dict)  # e.g. RAPID's decoders

    @property
    def _llm_type(self) -> str:
        return "specrag-speculative-chat"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {"model": self.model, "engine": self.engine, "temperature": self.temperature,
                "max_tokens": self.max_tokens, "engine_options": self.engine_options}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> Any:
        params = super()._get_ls_params(stop=stop, **kwargs)
        params["ls_provider"] = "specrag"
        params["ls_model_name"] = kwargs.get("model", self.model)
        params["ls_model_type"] = "chat"
        params["ls_temperature"] = kwargs.get("temperature", self.temperature)
        if self.max_tokens is not None:
            params["ls_max_tokens"] = kwargs.get("max_tokens", self.max_tokens)
        if stop or self.stop:
            params["ls_stop"] = stop or self.stop
        return params

    def _model(self, override: str | None = None) -> tuple[Any, FairLock]:
        return resolve_model(self, self.lm, override)

    def _call(self, messages: list[BaseMessage], stop: list[str] | None,
              kwargs: dict[str, Any]) -> ChatCall:
        """Validate one call (before any model work)."""
        return prepare_call(self, to_chat_messages(messages), {**kwargs, "stop": stop},
                            lm=self.lm, engine_state=self._engine_state,
                            limit_name="max_tokens", text_of="page_content")

    def _final_chunk(self, result: GenerationResult, engine: str) -> ChatGenerationChunk:
        report = call_report(result, engine, self.model)
        usage = UsageMetadata(input_tokens=report["prompt_tokens"],
                              output_tokens=report["completion_tokens"],
                              total_tokens=report["prompt_tokens"] + report["completion_tokens"])
        metadata = {"model_name": self.model, "finish_reason": report["finish_reason"],
                    "engine": engine, "speculative_stats": report["speculative_stats"]}
        return ChatGenerationChunk(message=AIMessageChunk(
            content="", usage_metadata=usage, response_metadata=metadata, chunk_position="last"))

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any
                  ) -> ChatResult:
        call = self._call(messages, stop, kwargs)
        result = call.run()
        final = self._final_chunk(result, call.engine).message
        message = AIMessage(content=result.text, usage_metadata=final.usage_metadata,
                            response_metadata=final.response_metadata)
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any
                ) -> Iterator[ChatGenerationChunk]:
        call = self._call(messages, stop, kwargs)
        for delta, result in call.steps():
            if result is not None:
                yield self._final_chunk(result, call.engine)
                return
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=delta))
            if run_manager is not None and delta:
                run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any
                         ) -> ChatResult:
        # step by step on a worker thread: a cancelled call stops within one step
        chunks = [c async for c in iterate_in_thread(self._stream(messages, stop, None,
                                                                   **kwargs))]
        final = chunks[-1].message
        message = AIMessage(content="".join(str(c.message.content) for c in chunks),
                            usage_metadata=final.usage_metadata,
                            response_metadata=final.response_metadata)
        return ChatResult(generations=[ChatGeneration(message=message)])

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any
                       ) -> AsyncIterator[ChatGenerationChunk]:
        async for chunk in iterate_in_thread(self._stream(messages, stop, None, **kwargs)):
            if run_manager is not None and chunk.text:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk
