"""``ChatSpeculative``: a LangChain chat model backed by a specrag token engine (adapter only).

Swap it for any chat model in an existing chain (``retriever | prompt | ChatSpeculative()``):
the default engine, ReSpec, drafts from the prompt (which holds the retrieved context) and from
any ``documents`` passed as a field or per call. Engines are resolved by name through
``shared_core.engines.registry`` (``"respec"``, ``"autoregressive"``, ``"rapid"``, ...);
``engine_options`` go to the engine unchanged. Weights load on first use, once per
(model, device, dtype) per process, with one lock per loaded model. Stop strings are cut from
the returned text (the stop string itself is not included).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models.chat_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, ChatMessage
from langchain_core.messages.ai import UsageMetadata
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from pydantic import ConfigDict, Field, field_validator

from shared_core.engines.registry import check_engine, stream_engine
from shared_core.serving import iterate_in_thread, loaded_model, lock_for

_ROLES = {"human": "user", "ai": "assistant", "system": "system", "tool": "tool",
          "function": "tool", "developer": "system"}


def to_chat_messages(messages: Sequence[BaseMessage]) -> list[dict[str, str]]:
    """LangChain messages as ``{"role", "content"}`` dicts for the model's chat template."""
    out = []
    for m in messages:
        role = m.role if isinstance(m, ChatMessage) else _ROLES.get(m.type, "user")
        out.append({"role": role, "content": str(m.text)})
    return out


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

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, value: str) -> str:
        return check_engine(value)

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

    def _model(self, override: str | None = None) -> tuple[Any, threading.Lock]:
        if override is not None and override != self.model:
            return loaded_model(override, self.device, self.dtype)
        if self.lm is not None:
            return self.lm, lock_for(self.lm)
        return loaded_model(self.model, self.device, self.dtype)

    def _run(self, messages: list[BaseMessage], stop: list[str] | None,
             kwargs: dict[str, Any]) -> Iterator[ChatGenerationChunk]:
        """Generate under the model's lock; one chunk per committed block, then a final one."""
        lm, lock = self._model(kwargs.pop("model", None))
        engine = kwargs.pop("engine", self.engine)
        # the configured options belong to the configured engine; a per-call engine gets its own
        base = self.engine_options if engine == self.engine else {}
        options = {**base, **kwargs.pop("engine_options", {})}
        documents = kwargs.pop("documents", None)
        with lock:
            stream = stream_engine(
                engine, lm, to_chat_messages(messages),
                max_new_tokens=kwargs.pop("max_tokens", None) or self.max_tokens or 256,
                documents=_document_texts(documents if documents is not None else self.documents),
                stop=stop if stop is not None else self.stop,
                temperature=kwargs.pop("temperature", self.temperature),
                top_k=kwargs.pop("top_k", self.top_k), top_p=kwargs.pop("top_p", self.top_p),
                seed=kwargs.pop("seed", self.seed), **options)
            for delta in stream:
                yield ChatGenerationChunk(message=AIMessageChunk(content=delta))
            result = stream.result
        assert result is not None
        stats = result.stats
        usage = UsageMetadata(input_tokens=stats.prompt_tokens, output_tokens=stats.new_tokens,
                              total_tokens=stats.prompt_tokens + stats.new_tokens)
        metadata = {"model_name": self.model, "finish_reason": stats.finish_reason,
                    "engine": engine, "speculative_stats": stats.as_dict()}
        yield ChatGenerationChunk(message=AIMessageChunk(
            content="", usage_metadata=usage, response_metadata=metadata, chunk_position="last"))

    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any
                  ) -> ChatResult:
        chunks = list(self._run(messages, stop, dict(kwargs)))
        final = chunks[-1].message
        text = "".join(str(c.message.content) for c in chunks)
        message = AIMessage(content=text, usage_metadata=final.usage_metadata,
                            response_metadata=final.response_metadata)
        return ChatResult(generations=[ChatGeneration(message=message)])

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any
                ) -> Iterator[ChatGenerationChunk]:
        for chunk in self._run(messages, stop, dict(kwargs)):
            if run_manager is not None and chunk.text:
                run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any
                         ) -> ChatResult:
        return await asyncio.to_thread(self._generate, messages, stop, None, **kwargs)

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None, **kwargs: Any
                       ) -> AsyncIterator[ChatGenerationChunk]:
        async for chunk in iterate_in_thread(self._run(messages, stop, dict(kwargs))):
            if run_manager is not None and chunk.text:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

