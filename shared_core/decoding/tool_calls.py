"""Tool calling for local chat models: prompts with tool schemas, forced calls, parsing.

The format is the Hermes / Qwen2.5 one: tool schemas (OpenAI ``{"type": "function",
"function": {...}}`` dicts) listed in the system turn, and each call emitted as
``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``; results go back as
``<tool_response>`` turns. A chat template that takes ``tools=`` (Qwen2.5) renders all of it
itself; for one that does not (SmolLM2) the same text is written into the system turn and the
assistant turns here, and a tool result goes in as the template expects it
(:func:`tool_role`): a turn of the template's own ``tool`` role where it has one, holding the
result as it is; else (SmolLM2's template has no tool role, it prints any role name verbatim, and
one that refuses other roles) a user turn in words, ``Tool result: …`` and a request to answer,
without the ``<tool_response>`` tags a small model copies into its answer. Measured with
SmolLM2-135M on 6 forced-call round trips through each framework (12): ``<tool_response>`` in a
user turn 1 of 6 plain-text answers, in a ``tool`` turn 8 of 12 (4 answers were an invented
``<tool_response>``), in words in a user turn 12 of 12.

``tool_choice`` (:func:`check_tool_choice`): ``"auto"`` (the model decides; with a grammar, free
text in which every ``<tool_call>`` must hold a call of one of the tools with schema-valid
arguments, :func:`auto_calls`), ``"none"`` (no tools shown, nothing parsed), ``"required"``
(some call: ``<tool_call>`` is prefilled in the assistant turn and, with a grammar, the call is
constrained to one of the tools' schemas) or a tool's name (the call is prefilled up to its
arguments, which a grammar constrains to the tool's schema).

Replies are split by :class:`ReplyScanner`, fed a reply in pieces as it streams: text outside
the call tags as soon as it is safe to show, each call once its closing tag arrives;
:func:`parse_tool_calls` is the same scanner fed a whole reply, so a streamed reply and an
invoked one give the same content and calls.
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

from shared_core.decoding.constrained import Constraint, check_json_schema

if TYPE_CHECKING:
    from shared_core.runtime.protocol import ModelLM

logger = logging.getLogger(__name__)
OPEN, CLOSE = "<tool_call>", "</tool_call>"
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
    """OpenAI-format function tools, validated (unique names, object parameters whose JSON
    schema :func:`~shared_core.decoding.constrained.check_json_schema` accepts) before any model work."""
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        msg = f"tools must be a list of tools, got {type(tools).__name__}"
        raise TypeError(msg)
    out: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or tool.get("type", "function") != "function":
            msg = (f"tools[{i}] must be an OpenAI function tool {{'type': 'function', 'function': "
                   f"{{...}}}}, got {type(tool).__name__} {tool!r:.60}")
            raise TypeError(msg)
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            msg = f"tools[{i}] needs a non-empty function name, got {name!r}"
            raise ValueError(msg)
        params = fn.get("parameters") or {}
        if not isinstance(params, Mapping):
            msg = f"tools[{i}] ({name}) parameters must be a JSON-schema dict, got {params!r:.60}"
            raise TypeError(msg)
        params = {"type": "object", "properties": {}, **params}
        if params["type"] != "object":
            msg = f"tools[{i}] ({name}) parameters must have type 'object', got {params['type']!r}"
            raise ValueError(msg)
        check_json_schema(params, f"tools[{i}] ({name}) parameters")
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


def check_tool_choice(tool_choice: object, tools: Sequence[Mapping[str, Any]]) -> str:
    """``"auto"``, ``"none"``, ``"required"`` or a tool's name (ValueError naming tool_choice);
    without tools ``"none"``, and only ``None`` / ``"auto"`` / ``"none"`` are taken (a forced
    call needs a tool, as OpenAI's API refuses it)."""
    if not tools:
        if tool_choice not in (None, "auto", "none", False):
            msg = f"tool_choice={tool_choice!r} needs tools (bind_tools / tools=); none were given"
            raise ValueError(msg)
        return "none"
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


def template_takes_tools(lm: ModelLM) -> bool:
    """True if the model's own chat template renders ``tools=`` (e.g. Qwen2.5's)."""
    return "tools" in str(getattr(lm.tokenizer, "chat_template", None) or "")


def _call_json(call: Mapping[str, Any]) -> str:
    return json.dumps({"name": call["name"], "arguments": call.get("arguments") or {}},
                      ensure_ascii=False)


_ROLE_PROBE = "specrag-probe-7f3a"
_ANY_ROLE = "specrag-role-5c1e"
RESULT_REQUEST = "Answer my question in a sentence."


def _renders_turn(lm: ModelLM, role: str) -> bool:
    """Whether the template renders a turn of ``role`` (neither refuses nor drops it)."""
    probe = [{"role": "user", "content": "q"}, {"role": role, "content": _ROLE_PROBE}]
    try:
        return _ROLE_PROBE in lm.chat_prompt(probe)
    except Exception:  # jinja's TemplateError (raise_exception) or the template's own: refused
        return False


def tool_role(lm: ModelLM) -> str:
    """The role a tool result is rendered in by a template without tool support: ``"tool"`` when
    the template has a tool role of its own (it renders a ``tool`` turn but refuses or drops a
    turn of a made-up role), else ``"user"``: a template that refuses or drops the tool role, or
    one that prints any role name verbatim (SmolLM2's), whose model was never trained on a
    ``tool`` turn."""
    return "tool" if _renders_turn(lm, "tool") and not _renders_turn(lm, _ANY_ROLE) else "user"


def _result_turn(results: Sequence[str], role: str) -> dict[str, str]:
    """Consecutive tool results as one turn: as they are in the template's own tool role, else a
    user turn in words (no tags for the model to copy) asking for the answer."""
    if role == "tool":
        return {"role": "tool", "content": "\n\n".join(results)}
    lines = [f"Tool result: {r}" for r in results]
    return {"role": role, "content": "\n".join([*lines, RESULT_REQUEST])}


def _flatten(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]],
             result_role: str = "user") -> list[dict[str, str]]:
    """Plain role/content turns carrying the tool format, for templates without tool support
    (consecutive tool results in one ``result_role`` turn, :func:`_result_turn`)."""
    out: list[dict[str, str]] = []
    system = [m["content"] for m in messages[:1] if m["role"] == "system"]
    if tools:
        listed = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
        system.append(TOOLS_SYSTEM.format(tools=listed))
    if system:
        out.append({"role": "system", "content": "\n\n".join(s for s in system if s)})
    results: list[str] = []
    for m in messages[1:] if messages and messages[0]["role"] == "system" else messages:
        if m["role"] == "tool":
            results.append(m["content"])
            continue
        if results:
            out.append(_result_turn(results, result_role))
            results = []
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [f"{OPEN}\n{_call_json(c)}\n{CLOSE}" for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join([m["content"], *calls]).strip()})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if results:
        out.append(_result_turn(results, result_role))
    return out


def render_prompt(lm: ModelLM, messages: Sequence[Mapping[str, Any]],
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
    has_results = any(m["role"] == "tool" for m in messages)
    flat = _flatten(messages, tools, tool_role(lm) if has_results else "user")
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


def auto_calls(tools: Sequence[Mapping[str, Any]]) -> Constraint:
    """Free text, but each ``<tool_call>`` the model opens must continue as a call of one of
    ``tools`` with arguments valid for its schema, then close (an xgrammar structural tag)."""
    tag = {"type": "structural_tag",
           "format": {"type": "triggered_tags", "triggers": [OPEN], "tags": _call_tags(tools)}}
    return Constraint("structural_tag", tag)


def call_or_answer(tools: Sequence[Mapping[str, Any]], answer: Constraint) -> Constraint:
    """One call of one of ``tools``, or an answer that is ``answer``'s JSON: the reply a tool
    loop with a response format needs (an agent calls tools, then answers in the format)."""
    reply = {"type": "json_schema", "json_schema": answer.json_schema(), "max_whitespace_cnt": 1}
    tag = {"type": "structural_tag",
           "format": {"type": "or", "elements": [*_call_tags(tools), reply]}}
    return Constraint("structural_tag", tag)


def _call_tags(tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    return [{"type": "tag",
             "begin": f'{OPEN}\n{{"name": {json.dumps(t["function"]["name"])}, "arguments": ',
             # one whitespace character at most between JSON tokens: no room to loop on
             "content": {"type": "json_schema", "json_schema": t["function"]["parameters"],
                         "max_whitespace_cnt": 1},
             "end": f"}}\n{CLOSE}"} for t in tools]


def _new_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _one_call(item: object, known: Sequence[str], raw: str) -> ToolCall | InvalidToolCall:
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


_NAMED = re.compile(r'\{\s*"name"\s*:\s*"([^"\\]+)"')  # a call's opening, up to its name


def _parse_body(body: str, known: Sequence[str]) -> list[ToolCall | InvalidToolCall]:
    """The calls in one ``<tool_call>`` body (a JSON object, or a list of them)."""
    body = body.strip()
    try:  # the first JSON value; text after it (e.g. a closing tag cut by max tokens) is not
        parsed, _ = json.JSONDecoder().raw_decode(body)  # part of the call
    except json.JSONDecodeError as e:  # e.g. cut by max tokens: named if its name was written
        named = _NAMED.match(body)
        name = named.group(1) if named and named.group(1) in known else None
        return [InvalidToolCall(name, body, _new_id(), f"not JSON: {e}")]
    return [_one_call(item, known, body) for item in (parsed if isinstance(parsed, list)
                                                      else [parsed])]


def _partial_open(text: str) -> int:
    """Length of the longest end of ``text`` that may begin an opening tag."""
    return next((k for k in range(min(len(OPEN) - 1, len(text)), 0, -1)
                 if OPEN.startswith(text[-k:])), 0)


class ReplyScanner:
    """A reply fed in pieces, split into content and tool calls as soon as each is certain.

    Content is the text outside ``<tool_call>…</tool_call>`` blocks, without the reply's
    leading and trailing whitespace; an unclosed block at the end runs to the end. A possible
    partial opening tag, and whitespace that may turn out to be trailing, are held back until
    the next piece decides them. A reply that begins like a bare JSON call (``{``, ``[``, a code
    fence), as small models often write one, is held whole and decided at :meth:`close`. The
    result does not depend on how the reply is split.
    """

    def __init__(self, known: Sequence[str], prefill: str = "", *, single: bool = False):
        self._known = list(known)
        self.single = single  # keep the first call only (``parallel_tool_calls=False``)
        self._raw = ""  # everything fed, for a held (bare) reply
        self._buf = ""  # not yet decided
        self._bare: bool | None = None  # None: nothing but whitespace so far
        self._in_call = self._started = False
        self._ws = ""  # whitespace held back (trailing unless more text follows)
        self.content = ""
        self.found: list[ToolCall | InvalidToolCall] = []
        if prefill:
            self.feed(prefill)

    @property
    def calls(self) -> list[ToolCall]:
        return [c for c in self.found if isinstance(c, ToolCall)]

    @property
    def invalid(self) -> list[InvalidToolCall]:
        return [c for c in self.found if isinstance(c, InvalidToolCall)]

    def feed(self, piece: str) -> tuple[str, list[ToolCall | InvalidToolCall]]:
        """The content delta and the calls completed by ``piece``."""
        self._raw += piece
        if self._bare is None:
            start = self._raw.lstrip()
            if not start:
                return "", []
            self._bare = start[0] in "{[`"
            piece = self._raw
        if self._bare:
            return "", []
        return self._scan(piece)

    def close(self) -> tuple[str, list[ToolCall | InvalidToolCall]]:
        """The rest, at the end of the reply."""
        if self._bare:
            return self._close_bare()
        text, found = "", []
        if self._in_call:
            found = self._add(_parse_body(self._buf, self._known))
        elif self._buf:
            text = self._emit(self._buf)
        self._buf = self._ws = ""
        return text, found

    def _add(self, calls: list[ToolCall | InvalidToolCall]) -> list[ToolCall | InvalidToolCall]:
        if self.single:
            calls = calls[: max(0, 1 - len(self.found))]
        self.found += calls
        return calls

    def _scan(self, piece: str) -> tuple[str, list[ToolCall | InvalidToolCall]]:
        buf, text, found = self._buf + piece, "", []
        while True:
            tag = CLOSE if self._in_call else OPEN
            i = buf.find(tag)
            if i < 0:
                break
            if self._in_call:
                found += self._add(_parse_body(buf[:i], self._known))
            else:
                text += self._emit(buf[:i])
            buf, self._in_call = buf[i + len(tag):], not self._in_call
        if not self._in_call:
            keep = _partial_open(buf)
            text += self._emit(buf[:len(buf) - keep])
            buf = buf[len(buf) - keep:]
        self._buf = buf
        return text, found

    def _emit(self, text: str) -> str:
        """Content ready to show: leading whitespace of the reply dropped, trailing held."""
        if not self._started:
            text = text.lstrip()
            self._started = bool(text)
        text = self._ws + text
        shown = text.rstrip()
        self._ws = text[len(shown):]
        self.content += shown
        return shown

    def _close_bare(self) -> tuple[str, list[ToolCall | InvalidToolCall]]:
        if OPEN in self._raw:  # tagged calls after all: scan the whole reply as such
            scanner = ReplyScanner(self._known, single=self.single)
            scanner._bare = False
            text, found = scanner._scan(self._raw)
            rest, more = scanner.close()
            self.content, self.found = scanner.content, scanner.found
            return text + rest, found + more
        stripped = self._raw.strip()
        body = stripped.removeprefix("```json").removeprefix("```").removesuffix("```").strip()
        if body.startswith(("{", "[")) and any(f'"{n}"' in body for n in self._known):
            return "", self._add(_parse_body(body, self._known))
        self.content = stripped
        return stripped, []


def parse_tool_calls(text: str, known: Sequence[str], prefill: str = ""
                     ) -> tuple[str, list[ToolCall], list[InvalidToolCall]]:
    """``(content, calls, invalid calls)`` of a whole reply (``prefill``: its forced beginning)."""
    scanner = ReplyScanner(known, prefill)
    scanner.feed(text)
    scanner.close()
    return scanner.content, scanner.calls, scanner.invalid
