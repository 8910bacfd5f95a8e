"""``SpeculativeLLM``: a LlamaIndex LLM backed by a specrag token engine (adapter only).

Use it wherever LlamaIndex takes an LLM (``index.as_query_engine(llm=SpeculativeLLM())``). The
default engine, ReSpec, drafts from the prompt (which holds the retrieved context) and from any
``documents`` given as a field or per call. Engines are resolved by name through
``shared_core.engines.registry``; ``engine_options`` go to the engine unchanged. Weights load on
first use, once per (model, device, dtype) per process, with one lock per loaded model; the
async methods run generation on worker threads. Chat messages use the model's chat template;
``complete(prompt)`` wraps the prompt as one user turn unless ``formatted=True``. Stop strings
are cut from the returned text. Engine stats are in ``raw`` / ``additional_kwargs``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr, field_validator
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.custom import CustomLLM

from shared_core.engines.registry import check_engine, stream_engine
from shared_core.serving import iterate_in_thread, loaded_model, lock_for


class SpeculativeLLM(CustomLLM):
    """LlamaIndex LLM running a speculative engine on a local model (default: ReSpec, SmolLM2)."""

    model: str = Field(default="smollm2-135m-instruct", description="alias, hub id or path")
    engine: str = Field(default="respec", description="a shared_core token engine name")
    engine_options: dict[str, Any] = Field(default_factory=dict)
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 256
    stop: list[str] | None = None
    documents: list[str] | None = None
    context_window: int | None = Field(default=None, description="None = the model's window")
    device: str | None = None
    dtype: str | None = None
    _lm: Any = PrivateAttr(default=None)
    _lock: threading.Lock | None = PrivateAttr(default=None)

    def __init__(self, lm: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if lm is not None:  # a preloaded shared_core LM
            self._lm, self._lock = lm, lock_for(lm)

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, value: str) -> str:
        return check_engine(value)

    @classmethod
    def class_name(cls) -> str:
        return "SpeculativeLLM"

    def _model(self) -> tuple[Any, threading.Lock]:
        if self._lm is None:
            self._lm, self._lock = loaded_model(self.model, self.device, self.dtype)
        assert self._lock is not None
        return self._lm, self._lock

    @property
    def metadata(self) -> LLMMetadata:
        window = self.context_window or self._model()[0].max_context
        return LLMMetadata(context_window=window, num_output=self.max_new_tokens,
                           is_chat_model=True, is_function_calling_model=False,
                           model_name=self.model, system_role=MessageRole.SYSTEM)

    # -- one generation path ----------------------------------------------------------------
    def _run(self, prompt: str | list[dict[str, str]], kwargs: dict[str, Any]
             ) -> Iterator[tuple[str, str, dict[str, Any] | None]]:
        """Yield ``(cumulative text, delta, None)``, then ``(text, "", raw stats)``."""
        lm, lock = self._model()
        engine = kwargs.pop("engine", self.engine)
        # the configured options belong to the configured engine; a per-call engine gets its own
        base = self.engine_options if engine == self.engine else {}
        options = {**base, **kwargs.pop("engine_options", {})}
        documents = kwargs.pop("documents", None)
        documents = self.documents if documents is None else documents
        with lock:
            stream = stream_engine(
                engine, lm, prompt,
                max_new_tokens=kwargs.pop("max_new_tokens", self.max_new_tokens),
                documents=[getattr(d, "text", d) for d in documents] if documents else None,
                stop=kwargs.pop("stop", self.stop),
                temperature=kwargs.pop("temperature", self.temperature),
                top_k=kwargs.pop("top_k", self.top_k), top_p=kwargs.pop("top_p", self.top_p),
                seed=kwargs.pop("seed", self.seed), **options)
            text = ""
            for delta in stream:
                text += delta
                yield text, delta, None
            result = stream.result
        assert result is not None
        stats = result.stats
        raw = {"engine": engine, "model": self.model, "finish_reason": stats.finish_reason,
               "prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.new_tokens,
               "speculative_stats": stats.as_dict()}
        yield result.text, "", raw

    def _messages(self, prompt: str, formatted: bool) -> str | list[dict[str, str]]:
        if formatted:
            return prompt
        turns = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*turns, {"role": "user", "content": prompt}]

    @staticmethod
    def _chat_dicts(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
        return [{"role": m.role.value, "content": m.content or ""} for m in messages]

    def _complete(self, prompt: str, formatted: bool, kwargs: dict[str, Any]
                  ) -> CompletionResponse:
        *_, (text, _, raw) = self._run(self._messages(prompt, formatted), kwargs)
        return CompletionResponse(text=text, raw=raw, additional_kwargs=dict(raw or {}))

    def _stream_complete(self, prompt: str, formatted: bool, kwargs: dict[str, Any]
                         ) -> CompletionResponseGen:
        for text, delta, raw in self._run(self._messages(prompt, formatted), kwargs):
            yield CompletionResponse(text=text, delta=delta, raw=raw,
                                     additional_kwargs=dict(raw or {}))

    def _chat(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ChatResponse:
        *_, (text, _, raw) = self._run(self._chat_dicts(messages), kwargs)
        return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text),
                            raw=raw, additional_kwargs=dict(raw or {}))

    def _stream_chat(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]
                     ) -> ChatResponseGen:
        for text, delta, raw in self._run(self._chat_dicts(messages), kwargs):
            yield ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=text),
                               delta=delta, raw=raw, additional_kwargs=dict(raw or {}))

    # -- public API: sync, streaming, and async on worker threads ---------------------------
    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return self._complete(prompt, formatted, kwargs)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any
                        ) -> CompletionResponseGen:
        return self._stream_complete(prompt, formatted, kwargs)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any
                        ) -> CompletionResponse:
        return await asyncio.to_thread(self._complete, prompt, formatted, kwargs)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any
                               ) -> CompletionResponseAsyncGen:
        return iterate_in_thread(self._stream_complete(prompt, formatted, kwargs))

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._chat(messages, kwargs)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return self._stream_chat(messages, kwargs)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return await asyncio.to_thread(self._chat, messages, kwargs)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any
                           ) -> ChatResponseAsyncGen:
        return iterate_in_thread(self._stream_chat(messages, kwargs))
