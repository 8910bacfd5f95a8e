"""LlamaIndex message conversion for ``SpeculativeLLM``: chat messages (with tool calls and
tool results) to template turns, replies to messages with tool calls, ``ToolSelection``s."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    MessageRole,
    TextBlock,
    ToolCallBlock,
)
from llama_index.core.llms.llm import ToolSelection

from shared_core.decoding.output import ChatTurns, chat_turns
from shared_core.decoding.tool_calls import InvalidToolCall, ToolCall, check_tools
from shared_core.frontend.chat import Reply

# LlamaIndex roles the chat templates know under another name
_ROLES = {"developer": "system", "function": "tool", "chatbot": "assistant", "model": "assistant"}


def _calls_of(message: ChatMessage) -> list[dict[str, Any]]:
    """A message's tool calls: its ToolCallBlocks, else OpenAI-style ``additional_kwargs``."""
    calls = [{"name": b.tool_name, "arguments": b.tool_kwargs, "id": b.tool_call_id}
             for b in message.blocks if isinstance(b, ToolCallBlock)]
    if calls:
        return calls
    for c in message.additional_kwargs.get("tool_calls") or []:
        fn = c.get("function", c) if isinstance(c, dict) else {}
        args = fn.get("arguments") or {}
        calls.append({"name": fn.get("name"), "arguments": json.loads(args) if isinstance(
            args, str) else args, "id": c.get("id") if isinstance(c, dict) else None})
    return calls


def chat_dicts(messages: Sequence[ChatMessage]) -> ChatTurns:
    """Template turns, checked once (the engines take them unchecked); non-text blocks other
    than tool calls are refused, never dropped."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, ChatMessage):
            msg = f"message {i} must be a llama_index ChatMessage, got {type(m).__name__}"
            raise TypeError(msg)
        media = [type(b).__name__ for b in m.blocks if not isinstance(b, (TextBlock, ToolCallBlock))]
        if media:
            msg = (f"message {i} has a {media[0]} content block; SpeculativeLLM handles text "
                   "only (images and other media are not supported)")
            raise NotImplementedError(msg)
        role = m.role.value
        calls = _calls_of(m)
        if not calls and role != "assistant" and not any(isinstance(b, TextBlock) for b in m.blocks):
            msg = (f"message {i} content must be text, got None (only an assistant turn may omit "
                   "it)")
            raise ValueError(msg)
        # as ChatMessage.content joins them (a memory block, then the system prompt)
        text = "\n".join(b.text for b in m.blocks if isinstance(b, TextBlock))
        turn: dict[str, Any] = {"role": _ROLES.get(role, role), "content": text}
        if calls:
            turn["tool_calls"] = calls
        if m.additional_kwargs.get("tool_call_id"):
            turn["tool_call_id"] = m.additional_kwargs["tool_call_id"]
        out.append(turn)
    return chat_turns(out)


def reply_message(reply: Reply, tools: bool) -> ChatMessage:
    """The assistant message of a reply: text, plus ToolCallBlocks and OpenAI-style
    ``additional_kwargs["tool_calls"]`` when ``tools`` were offered."""
    if not tools:
        return ChatMessage(role=MessageRole.ASSISTANT, content=reply.text)
    return tool_message(reply.content, [*reply.tool_calls, *reply.invalid_tool_calls])


def tool_message(content: str, found: Sequence[ToolCall | InvalidToolCall]) -> ChatMessage:
    """The assistant message of a reply with tools offered: its content and calls (the same for
    a whole reply and the end of a streamed one)."""
    calls = [c for c in found if isinstance(c, ToolCall)]
    invalid = [c for c in found if isinstance(c, InvalidToolCall)]
    # a reply with neither text nor a complete call (cut off by the token limit) keeps an empty
    # text block: the message stays valid history for the next call, as other LLMs' replies do
    blocks: list[Any] = [TextBlock(text=content)] if content or not calls else []
    blocks += [ToolCallBlock(tool_call_id=c.id, tool_name=c.name, tool_kwargs=c.arguments)
               for c in calls]
    extra: dict[str, Any] = {"tool_calls": [{"id": c.id, "type": "function",
                                             "function": {"name": c.name,
                                                          "arguments": c.arguments}}
                                            for c in calls]}
    if invalid:
        extra["invalid_tool_calls"] = [{"id": c.id, "name": c.name, "arguments": c.arguments,
                                        "error": c.error} for c in invalid]
    return ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks, additional_kwargs=extra)


def prepare_chat_with_tools(tools: Sequence[Any], user_msg: str | ChatMessage | None,
                            chat_history: list[ChatMessage] | None, tool_required: bool,
                            kwargs: dict[str, Any], *, parallel: bool = False) -> dict[str, Any]:
    """``chat`` arguments: messages, OpenAI-format tools and the tool choice (``tool_required``
    forces a call: of the only tool if there is one, else of any); ``parallel`` False (as
    LlamaIndex's ``allow_parallel_tool_calls`` defaults): the reply's first call only."""
    messages = list(chat_history or [])
    if isinstance(user_msg, str):
        user_msg = ChatMessage(role=MessageRole.USER, content=user_msg)
    if user_msg is not None:
        messages.append(user_msg)
    specs = check_tools([t.metadata.to_openai_tool(skip_length_check=True) for t in tools])
    choice = kwargs.pop("tool_choice", None)
    if choice is None and tool_required:
        choice = specs[0]["function"]["name"] if len(specs) == 1 else "required"
    return {"messages": messages, "tools": specs or None, "tool_choice": choice,
            "parallel_tool_calls": parallel, **kwargs}


CUT_OFF = "the reply reached max_new_tokens before its {} was complete; raise max_new_tokens"


def cut_off(response: ChatResponse) -> bool:
    """Whether the token limit ended the reply (a call or JSON object may be unfinished)."""
    return bool((response.raw or {}).get("finish_reason") == "length")


def tool_selections(response: ChatResponse, error_on_no_tool_call: bool) -> list[ToolSelection]:
    """The reply's tool calls as ``ToolSelection``s (ValueError if none and one is required,
    naming ``max_new_tokens`` when the limit cut the call off)."""
    calls = response.message.additional_kwargs.get("tool_calls") or []
    if not calls and error_on_no_tool_call:
        invalid = response.message.additional_kwargs.get("invalid_tool_calls")
        detail = f" (invalid: {invalid[0]['error']})" if invalid else ""
        msg = (CUT_OFF.format("tool call") if invalid and cut_off(response)
               else "expected at least one tool call in the response, got none") + detail
        raise ValueError(msg)
    return [ToolSelection(tool_id=c["id"], tool_name=c["function"]["name"],
                          tool_kwargs=c["function"]["arguments"]) for c in calls]
