"""shared_core.decoding.tool_calls: tool choice and tool checks, prompts with tools, forced calls, parsing."""

from __future__ import annotations

import itertools
import json

import pytest

from shared_core.decoding.tool_calls import (
    TOOLS_SYSTEM,
    ReplyScanner,
    auto_calls,
    check_tool_choice,
    check_tools,
    forced_call,
    parse_tool_calls,
    render_prompt,
    template_takes_tools,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}
NAMES = ["get_weather", "add"]


def test_tool_checks_and_choices():
    tools = check_tools([WEATHER, {"type": "function", "function": {"name": "now"}}])
    assert tools[1]["function"]["parameters"] == {"type": "object", "properties": {}}
    assert [check_tool_choice(c, tools) for c in (None, "auto", "none", False, "any",
                                                  "required", True, "now")] == [
        "auto", "auto", "none", "none", "required", "required", "required", "now"]
    assert check_tool_choice({"type": "function", "function": {"name": "now"}}, tools) == "now"
    with pytest.raises(ValueError, match="tool_choice='later'"):
        check_tool_choice("later", tools)
    assert check_tools([WEATHER, WEATHER]) == check_tools([WEATHER])
    other = {"type": "function", "function": {**WEATHER["function"], "description": "other"}}
    assert check_tools([WEATHER, other]) == check_tools([WEATHER])  # the first is kept
    with pytest.raises(TypeError, match=r"tools\[0\]"):
        check_tools([{"name": "x"}])


def test_parse_tagged_bare_multiple_and_invalid_calls():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}'
            '\n</tool_call>')
    content, calls, invalid = parse_tool_calls(text, NAMES)
    assert content == "Let me check." and not invalid
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Paris"}),
                                                      ("add", {"a": 1, "b": 2})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    _, calls, _ = parse_tool_calls(' {"name": "add", "arguments": {"a": 3}} ', NAMES)
    assert [(c.name, c.arguments) for c in calls] == [("add", {"a": 3})]
    _, calls, invalid = parse_tool_calls('<tool_call>\n{"name": "add", "arguments": {"a": 3',
                                         NAMES)
    assert not calls and "not JSON" in invalid[0].error and invalid[0].arguments.endswith('3')
    assert invalid[0].name == "add"  # cut off after its name: still named (a forced call's)
    _, _, invalid = parse_tool_calls('<tool_call>\n{"name": "nope", "arguments": {', NAMES)
    assert invalid[0].name is None  # only a bound tool's name
    _, calls, invalid = parse_tool_calls('<tool_call>{"name": "rm", "arguments": {}}</tool_call>',
                                         NAMES)
    assert not calls and invalid[0].name == "rm" and "unknown tool" in invalid[0].error
    assert parse_tool_calls("Paris is sunny.", NAMES) == ("Paris is sunny.", [], [])


def test_parse_continues_a_prefilled_call():
    prefill, constraint = forced_call("get_weather", check_tools([WEATHER, ADD]))
    assert prefill.endswith('"arguments": ') and constraint.suffix == "}\n</tool_call>"
    assert constraint.schema["required"] == ["city"]
    _, calls, _ = parse_tool_calls('{"city": "Oslo"}}\n</tool_call>', NAMES, prefill)
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Oslo"})]
    prefill, constraint = forced_call("required", check_tools([WEATHER, ADD]))
    names = [s["properties"]["name"]["const"] for s in constraint.schema["anyOf"]]
    assert prefill == "<tool_call>\n" and names == NAMES
    assert forced_call("auto", [WEATHER]) == ("", None)


def test_render_without_template_support_writes_the_tool_format(tiny_target):
    assert not template_takes_tools(tiny_target)
    turns = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": "Weather in Paris?"},
             {"role": "assistant", "content": "", "tool_calls": [
                 {"name": "get_weather", "arguments": {"city": "Paris"}, "id": "c1"}]},
             {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    ids = render_prompt(tiny_target, turns, check_tools([WEATHER]), prefill="<tool_call>\n")
    text = tiny_target.tokenizer.decode(ids)
    listed = "\n" + json.dumps(check_tools([WEATHER])[0])
    assert "Be brief.\n\n" + TOOLS_SYSTEM.format(tools=listed) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    # the tiny template prints any role name (no tool role of its own): a user turn in words
    assert "<|user|>Tool result: sunny\nAnswer my question in a sentence." in text
    assert "<tool_response>" not in text
    assert text.endswith("<|assistant|><tool_call>\n")


# Replies as small models write them: text around tagged calls, a "<tool_" that is not a call,
# an unclosed call cut by max tokens, a bare JSON call, a code fence, whitespace at both ends.
REPLIES = [
    ' Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    '</tool_call>\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call> Done. ',
    "<tool_response>\n20°C\n</tool_response> and a < b <tool",
    'Sure: <tool_call>\n{"name": "add", "arguments": {"a": 3',
    '\n {"name": "add", "arguments": {"a": 3}} ',
    "```python\nprint(1)\n```",
    "  Paris is sunny.  \n",
    "<tool_call>\n{\"name\": \"rm\", \"arguments\": {}}\n</tool_call>",
]


CONTENTS = ["Let me check.\n\n Done.", REPLIES[1], "Sure:", "", REPLIES[4], "Paris is sunny.", ""]


@pytest.mark.parametrize(("text", "content"), list(zip(REPLIES, CONTENTS, strict=True)))
def test_content_is_the_text_outside_the_calls_stripped(text, content):
    assert parse_tool_calls(text, NAMES)[0] == content


def _pieces(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in itertools.pairwise(bounds)]


def _streamed(text: str, pieces: list[str]):
    scanner = ReplyScanner(NAMES)
    deltas, found = [], []
    for piece in pieces:
        delta, calls = scanner.feed(piece)
        deltas.append(delta)
        found += calls
    delta, calls = scanner.close()
    return [*deltas, delta], found + calls


@pytest.mark.parametrize("text", REPLIES)
def test_scanner_gives_the_same_reply_however_it_is_split(text):
    content, calls, invalid = parse_tool_calls(text, NAMES)
    whole = [(c.name, c.arguments) for c in [*calls, *invalid]]
    splits = [[i] for i in range(1, len(text))] + [list(range(1, len(text)))]
    for cuts in splits:
        deltas, found = _streamed(text, _pieces(text, cuts))
        assert "".join(deltas) == content, cuts
        assert sorted((c.name, str(c.arguments)) for c in found) == sorted(
            (n, str(a)) for n, a in whole), cuts
        assert not any("<tool_call" in d or '"arguments"' in d for d in deltas), cuts


@pytest.mark.parametrize("text", [REPLIES[0], '[{"name": "get_weather", "arguments": {"city": '
                                  '"Paris"}}, {"name": "add", "arguments": {"a": 1}}]'])
def test_a_single_call_scanner_keeps_the_first_call_however_the_reply_is_split(text):
    """``parallel_tool_calls=False``: the first call only, the content unchanged."""
    content, calls, _ = parse_tool_calls(text, NAMES)
    assert len(calls) == 2
    for cuts in [[]] + [[i] for i in range(1, len(text), 7)]:
        scanner = ReplyScanner(NAMES, single=True)
        found = [c for piece in _pieces(text, cuts) for c in scanner.feed(piece)[1]]
        found += scanner.close()[1]
        assert [(c.name, c.arguments) for c in found] == [(calls[0].name, calls[0].arguments)]
        assert scanner.content == content and scanner.found == found


def test_scanner_streams_text_before_a_call_and_holds_a_partial_tag():
    scanner = ReplyScanner(NAMES)
    assert scanner.feed("Let me check. <tool") == ("Let me check.", [])  # " <tool" held
    assert scanner.feed("_call>\n{\"name\": \"add\", ") == ("", [])
    delta, calls = scanner.feed('"arguments": {"a": 1}}\n</tool_call> ok')
    assert delta == "  ok" and [(c.name, c.arguments) for c in calls] == [("add", {"a": 1})]
    assert scanner.close() == ("", [])
    assert scanner.content == "Let me check.  ok"
    scanner = ReplyScanner(NAMES)
    assert scanner.feed("a <tool") == ("a", [])
    assert scanner.close() == (" <tool", [])  # not a call after all: the held text is content


def test_auto_calls_grammar_lets_text_through_and_constrains_calls(tiny_target):
    pytest.importorskip("xgrammar")
    import xgrammar as xgr

    from shared_core.decoding.constrained import compile_constraint

    compiled = compile_constraint(tiny_target, auto_calls(check_tools([WEATHER, ADD])))

    def accepted(text: str) -> bool:
        return xgr.GrammarMatcher(compiled).accept_string(text)

    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    assert accepted("It is sunny. ") and accepted(f"Sure. {call} Done.")
    assert accepted(call + call)  # parallel calls
    assert not accepted('<tool_call>\n{"name": "rm", "arguments": {}}\n</tool_call>')
    assert not accepted('<tool_call>\n{"name": "add", "arguments": {"a": "one"}}\n</tool_call>')
    assert not accepted('<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>')
    assert not accepted('<tool_call>\n{"name": "add", "description": "x"}')
