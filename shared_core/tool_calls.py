"""Tool calling for local chat models: prompts with tool schemas, forced calls, parsing.

The format is the Hermes / Qwen2.5 one: tool schemas (OpenAI ``{"type": "function",
"function": {...}}`` dicts) listed in the system turn, and each call emitted as
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``; results go back as
``<tool_response>`` turns. A chat template that takes ``tools=`` (Qwen2.5) renders all of it
itself; for one that does not (SmolLM2) the same text is written into the system turn, the
assistant turns and the user turns here, so both kinds of model see one format.

``tool_choice`` (:func:`check_tool_choice`): ``"auto"`` (the model decides), ``"none"`` (no tools
shown, nothing parsed), ``"required"`` (some call: ``<tool_call>`` is prefilled in the assistant
turn and, with a grammar, the call is constrained to one of the tools' schemas) or a tool's name
(the call is prefilled up to its arguments, which a grammar constrains to the tool's schema).
Torch-free; the tokenizer is used only through the LM's chat template.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from shared_core.constrained import Constraint

if TYPE_CHECKING:
    from shared_core.models import LM

logger = logging.getLogger(__name__)
OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
CHOICES = ("auto", "none", "required")
_ALIASES: dict[Any, str] = {None: "auto", "auto": "auto", "none": "none", False: "none",
                            "any": "required", "required": "required", True: "required"}

TOOLS_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>{tools}"
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str


@dataclass(frozen=True)
class InvalidToolCall:
    name: str | None
    arguments: str
    id: str
    error: str


def check_tools(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI-format function tools, validated (unique names, object parameters)."""
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if tool.get("type", "function") != "function" or not isinstance(fn, Mapping):
            msg = f"tools[{i}] must be an OpenAI function tool {{'type': 'function', 'function': {{...}}}}"
            raise TypeError(msg)
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            msg = f"tools[{i}] needs a non-empty function name, got {name!r}"
            raise ValueError(msg)
        params = dict(fn.get("parameters") or {})
        params.setdefault("type", "object")
        params.setdefault("properties", {})
        spec = {"type": "function", "function": {**fn, "parameters": params}}
        if name in out:  # the model could not tell two tools of one name apart: show one
            if out[name] != spec:
                logger.warning("tools[%d] has the name %r of an earlier tool; the first is "
                               "kept", i, name)
            continue
        out[name] = spec
    return list(out.values())


def tool_names(tools: Sequence[Mapping[str, Any]]) -> list[str]:
    return [t["function"]["name"] for t in tools]


def check_tool_choice(tool_choice: Any, tools: Sequence[Mapping[str, Any]]) -> str:
    """``"auto"``, ``"none"``, ``"required"`` or a tool's name (ValueError naming tool_choice)."""
    if isinstance(tool_choice, Mapping):  # {"type": "function", "function": {"name": ...}}
        tool_choice = (tool_choice.get("function") or {}).get("name", tool_choice.get("name"))
    if isinstance(tool_choice, (str, bool)) or tool_choice is None:
        choice = _ALIASES.get(tool_choice)
        if choice is not None:
            return choice
        if tool_choice in tool_names(tools):
            return str(tool_choice)
    msg = (f"tool_choice={tool_choice!r} must be one of {list(CHOICES)} ('any' = 'required') or "
           f"a bound tool's name {tool_names(tools)}")
    raise ValueError(msg)


def template_takes_tools(lm: LM) -> bool:
    """True if the model's own chat template renders ``tools=`` (e.g. Qwen2.5's)."""
    return "tools" in str(getattr(lm.tokenizer, "chat_template", None) or "")


def _call_json(call: Mapping[str, Any]) -> str:
    return json.dumps({"name": call["name"], "arguments": call.get("arguments") or {}},
                      ensure_ascii=False)


def _flatten(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]
             ) -> list[dict[str, str]]:
    """Plain role/content turns carrying the tool format, for templates without tool support."""
    out: list[dict[str, str]] = []
    system = [m["content"] for m in messages[:1] if m["role"] == "system"]
    if tools:
        listed = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
        system.append(TOOLS_SYSTEM.format(tools=listed))
    if system:
        out.append({"role": "system", "content": "\n\n".join(s for s in system if s)})
    for m in messages[1:] if messages and messages[0]["role"] == "system" else messages:
        if m["role"] == "tool":
            text = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1]["role"] == "user" and out[-1]["content"].startswith("<tool_resp"):
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            calls = [f"{OPEN}\n{_call_json(c)}\n{CLOSE}" for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join([m["content"], *calls]).strip()})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return out


def render_prompt(lm: LM, messages: Sequence[Mapping[str, Any]],
                  tools: Sequence[Mapping[str, Any]] = (), prefill: str = "") -> list[int]:
    """Token ids of the conversation with ``tools`` shown and ``prefill`` begun as the reply.

    ``messages`` are ``{"role", "content"}`` dicts; an assistant turn may carry ``tool_calls``
    (``[{"name", "arguments", "id"}]``), a tool turn ``tool_call_id``.
    """
    if template_takes_tools(lm):
        turns = [{**m, "tool_calls": [{"type": "function", "id": c.get("id"),
                                       "function": {"name": c["name"],
                                                    "arguments": c.get("arguments") or {}}}
                                      for c in m["tool_calls"]]} if m.get("tool_calls") else dict(m)
                 for m in messages]
        text = lm.tokenizer.apply_chat_template(turns, tools=list(tools) or None, tokenize=False,
                                                add_generation_prompt=True)
        return lm.encode(text + prefill)
    flat = _flatten(messages, tools)
    ids = lm.prompt_ids(flat)
    return ids + lm.encode(prefill) if prefill else ids


def forced_call(choice: str, tools: Sequence[Mapping[str, Any]]
                ) -> tuple[str, Constraint | None]:
    """The prefill and the grammar that force a call: ``("", None)`` unless a call is forced."""
    if choice in ("auto", "none"):
        return "", None
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": n}, "arguments": p},
                  "required": ["name", "arguments"]} for n, p in by_name.items()]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return f"{OPEN}\n", Constraint("json_schema", schema, suffix=f"\n{CLOSE}")
    prefill = f'{OPEN}\n{{"name": {json.dumps(choice)}, "arguments": '
    return prefill, Constraint("json_schema", by_name[choice], suffix=f"}}\n{CLOSE}")


def _new_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _one_call(item: Any, known: Sequence[str], raw: str) -> ToolCall | InvalidToolCall:
    if not isinstance(item, Mapping) or not isinstance(item.get("name"), str):
        return InvalidToolCall(None, raw, _new_id(), "a tool call must be a JSON object with a 'name'")
    name = item["name"]
    args = item.get("arguments", item.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            return InvalidToolCall(name, args, _new_id(), f"arguments are not JSON: {e}")
    if not isinstance(args, Mapping):
        return InvalidToolCall(name, json.dumps(args), _new_id(), "arguments must be a JSON object")
    if name not in known:
        return InvalidToolCall(name, json.dumps(args), _new_id(), f"unknown tool {name!r}")
    return ToolCall(name, dict(args), _new_id())


def _bodies(text: str, known: Sequence[str]) -> tuple[str, list[str]]:
    if OPEN in text:
        return _CALL.sub("", text).strip(), _CALL.findall(text)
    stripped = text.strip().removeprefix("```json").removeprefix("```").removesuffix("```").strip()
    if stripped.startswith(("{", "[")) and any(f'"{n}"' in stripped for n in known):
        return "", [stripped]  # a bare JSON call, as small models often write
    return text, []


def parse_tool_calls(text: str, known: Sequence[str], prefill: str = ""
                     ) -> tuple[str, list[ToolCall], list[InvalidToolCall]]:
    """``(content, calls, invalid calls)`` from a reply (``prefill`` is the forced beginning)."""
    content, bodies = _bodies(prefill + text, known)
    calls: list[ToolCall] = []
    invalid: list[InvalidToolCall] = []
    for body in bodies:
        try:  # the first JSON value; text after it (e.g. a closing tag cut by max tokens) is not
            parsed, _ = json.JSONDecoder().raw_decode(body)  # part of the call
        except json.JSONDecodeError as e:
            invalid.append(InvalidToolCall(None, body, _new_id(), f"not JSON: {e}"))
            continue
        for item in parsed if isinstance(parsed, list) else [parsed]:
            call = _one_call(item, known, body)
            (calls if isinstance(call, ToolCall) else invalid).append(call)
    return content, calls, invalid
