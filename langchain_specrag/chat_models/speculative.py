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

from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ChatMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from pydantic import ConfigDict, Field, PrivateAttr, ValidationInfo, field_validator

from shared_core.config import GenerationConfig
from shared_core.engines.registry import check_engine, stream_engine
from shared_core.output import (
    GenerationResult,
    check_generation_field,
    generation_config,
    validate_messages,
)
from shared_core.serving import FairLock, iterate_in_thread, loaded_model, lock_for, step_locked

_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool",
          "function": "tool", "developer": "system", "user": "user", "assistant": "assistant"}
_DEFAULT_MAX_TOKENS = GenerationConfig().max_new_tokens


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


def _document_texts(documents: Sequence[Any] | None) -> list[str] | None:
    if documents is None:
        return None
    return [getattr(d, "page_content", d) for d in documents]


class ChatSpeculative(BaseChatModel):
    """Chat model running a speculative engine on a local model (default: ReSpec on SmolLM2).

    Example:
        ``ChatSpeculative(model="smollm2-135m-instruct", max_tokens=128).invoke("Hi")``
    """

    model_config = ConfigDict(populate_by_name=True, arbitrary_types_allowed=True)

    model: str = Field(default="smollm2-135m-instruct", alias="model_name")
    engine: str = "respec"
    engine_options: dict[str, Any] = Field(default_factory=dict)
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 256
    stop: list[str] | None = None
    streaming: bool = False
    documents: list[str] | None = None
    device: str | None = None
    dtype: str | None = None
    lm: Any = Field(default=None, exclude=True)  # a preloaded shared_core LM (optional)
    _engine_state: dict[str, Any] = PrivateAttr(default_factory=dict)  # e.g. RAPID's decoders

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, value: str) -> str:
        return check_engine(value)

    @field_validator("max_tokens", "temperature", "top_k", "top_p", "seed", mode="before")
    @classmethod
    def _generation_field(cls, value: Any, info: ValidationInfo) -> Any:
        check_generation_field(info.field_name, value)  # TypeError / ValueError naming it
        return value

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
        if override is not None and override != self.model:
            return loaded_model(override, self.device, self.dtype)
        if self.lm is not None:
            return self.lm, lock_for(self.lm)
        return loaded_model(self.model, self.device, self.dtype)

    def _call(self, messages: list[BaseMessage], stop: list[str] | None,
              kwargs: dict[str, Any]) -> tuple[FairLock, Callable[[], Any], str]:
        """Validate one call (before any model work); return the lock and a stream starter."""
        chat = to_chat_messages(messages)
        engine = check_engine(kwargs.pop("engine", self.engine))
        # the configured options belong to the configured engine; a per-call engine gets its own
        base = self.engine_options if engine == self.engine else {}
        options = {**base, **kwargs.pop("engine_options", {})}
        documents = kwargs.pop("documents", None)
        max_tokens = kwargs.pop("max_tokens", None)
        max_tokens = self.max_tokens if max_tokens is None else max_tokens
        sampling = {"stop": stop if stop is not None else self.stop,
                    "temperature": kwargs.pop("temperature", self.temperature),
                    "top_k": kwargs.pop("top_k", self.top_k),
                    "top_p": kwargs.pop("top_p", self.top_p),
                    "seed": kwargs.pop("seed", self.seed)}
        max_tokens = _DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
        generation_config(max_tokens, name="max_tokens", **sampling)
        lm, lock = self._model(kwargs.pop("model", None))
        texts = _document_texts(documents if documents is not None else self.documents)

        def start() -> Any:
            return stream_engine(engine, lm, chat, max_new_tokens=max_tokens, documents=texts,
                                 engine_state=self._engine_state, **sampling, **options)

        return lock, start, engine

    def _final_chunk(self, result: GenerationResult | None, engine: str) -> ChatGenerationChunk:
        assert result is not None
        stats = result.stats
        usage = UsageMetadata(input_tokens=stats.prompt_tokens, output_tokens=stats.new_tokens,
                              total_tokens=stats.prompt_tokens + stats.new_tokens)
        metadata = {"model_name": self.model, "finish_reason": stats.finish_reason,
                    "engine": engine, "speculative_stats": stats.as_dict()}
        return ChatGenerationChunk(message=AIMessageChunk(
            content="", usage_metadata=usage, response_metadata=metadata, chunk_position="last"))

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any
                  ) -> ChatResult:
        lock, start, engine = self._call(messages, stop, dict(kwargs))
        with lock:  # the whole generation: nothing is yielded to the caller in between
            result = start().run()
        final = self._final_chunk(result, engine).message
        message = AIMessage(content=result.text, usage_metadata=final.usage_metadata,
                            response_metadata=final.response_metadata)
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any
                ) -> Iterator[ChatGenerationChunk]:
        lock, start, engine = self._call(messages, stop, dict(kwargs))
        with lock:
            stream = start()
        for delta in step_locked(lock, stream):  # the lock is free while the caller reads
            chunk = ChatGenerationChunk(message=AIMessageChunk(content=delta))
            if run_manager is not None and delta:
                run_manager.on_llm_new_token(delta, chunk=chunk)
            yield chunk
        yield self._final_chunk(stream.result, engine)

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
