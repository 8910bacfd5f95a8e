"""Real multi-turn conversations for the chat benchmark: MT-Bench questions and the agent transcript.

A :class:`Conversation` opens with some messages, takes the model's reply to each turn as an
assistant message and says what comes next (the next user turn, tool results) or that it has
ended. :func:`walk` renders every turn's prompt ids exactly as the chat adapters do
(:func:`shared_core.decoding.tool_calls.render_prompt`, the model's own template with the tools) and asks an
``answer`` function for the reply, so the same walk serves the benchmark and the unit tests.

* MT-Bench (``mt_bench/question.jsonl`` in the data folder): each row's two user turns, in order;
  rows are taken round-robin over the eight categories so a few conversations cover several.
* The agent transcript of ``examples/agents.py``: its system prompt (``stop``), its
  ``search_handbook`` tool and question, the model's tool call (the first one forced with the
  ``<tool_call>`` prefill and grammar, as ``--force-first-call`` / ``tool_choice="required"`` do;
  later replies under the ``"auto"`` grammar, as the adapters mask them), the tool result, and so
  on until the model answers without a call. The system prompt, question and handbook are read
  from the example's source (not imported: it needs LangChain and the embedder); the search is a
  word-overlap stand-in for the example's MiniLM search (same ``k``). A forced call the model
  does not finish within the token budget is replaced by a search for the question (noted).
"""

from __future__ import annotations

import ast
import logging
import re
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared_core.bench.common import read_jsonl
from shared_core.decoding.constrained import Constraint, xgrammar_available
from shared_core.decoding.tool_calls import (
    OPEN,
    auto_calls,
    check_tools,
    forced_call,
    parse_tool_calls,
    render_prompt,
)

if TYPE_CHECKING:
    from shared_core.runtime.lm import LM

logger = logging.getLogger(__name__)
Message = dict[str, Any]
AGENT_EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "agents.py"
SEARCH_K = 2  # passages per search, as examples/agents.py's handbook_search(k=2)


@dataclass
class Conversation:
    """One conversation: its opening messages, tools, and how it goes on after each reply."""

    source: str
    name: str
    opening: list[Message]
    tools: list[dict[str, Any]] = field(default_factory=list)
    first_prefill: str = ""  # the first reply's forced beginning (a forced tool call)
    user_turns: list[str] = field(default_factory=list)  # MT-Bench: the turns after the first
    search: Callable[[str], str] | None = None  # agent: the tool's function
    notes: list[str] = field(default_factory=list)  # what the walk had to stand in for

    def reply(self, text: str, turn: int) -> Message:
        """The assistant message of reply ``turn`` (``text``: what followed any prefill)."""
        prefill = self.first_prefill if turn == 1 else ""
        if not self.tools:
            return {"role": "assistant", "content": prefill + text}
        names = [t["function"]["name"] for t in self.tools]
        content, calls, _ = parse_tool_calls(text, names, prefill)
        found = [{"name": c.name, "arguments": c.arguments} for c in calls]
        if prefill and not found:  # a forced call the model did not complete (no grammar here)
            found = [{"name": names[0], "arguments": {"query": self.opening[-1]["content"]}}]
            self.notes.append(f"turn {turn}: no valid forced call in {text!r:.80}; the "
                              "question was searched instead")
            logger.warning("%s: %s", self.name, self.notes[-1])
        return {"role": "assistant", "content": content,
                "tool_calls": [{**c, "id": f"call_{turn}_{i}"} for i, c in enumerate(found)]}

    def constraint(self, turn: int) -> Constraint | None:
        """The grammar the chat adapters would mask reply ``turn`` with (None without xgrammar):
        the forced call on the first turn, any number of schema-valid calls after it."""
        if not self.tools or not xgrammar_available():
            return None
        return forced_call("required", self.tools)[1] if turn == 1 and self.first_prefill \
            else auto_calls(self.tools)

    def follow(self, turn: int, reply: Message) -> list[Message]:
        """The messages after reply ``turn`` (1-based); empty when the conversation has ended."""
        if self.search is None:
            return ([{"role": "user", "content": self.user_turns[turn - 1]}]
                    if turn <= len(self.user_turns) else [])
        return [{"role": "tool", "content": self.search(str(c["arguments"].get("query", ""))),
                 "tool_call_id": c["id"]} for c in reply.get("tool_calls", [])]


def walk(conversation: Conversation, lm: LM, answer: Callable[[int, list[int]], str],
         max_turns: int) -> list[Message]:
    """Run ``conversation`` for at most ``max_turns`` replies; ``answer(turn, prompt_ids)`` gives
    each reply's text (what follows any prefill). Returns the whole history."""
    history = list(conversation.opening)
    for turn in range(1, max_turns + 1):
        prefill = conversation.first_prefill if turn == 1 else ""
        ids = render_prompt(lm, history, conversation.tools, prefill)
        history.append(conversation.reply(answer(turn, ids), turn))
        more = conversation.follow(turn, history[-1])
        if not more:
            break
        history += more
    return history


def mt_bench(root: Path, count: int) -> list[Conversation]:
    """The first ``count`` MT-Bench rows, round-robin over categories (file order within each)."""
    by_category: dict[str, list[Mapping[str, Any]]] = defaultdict(list)
    for row in read_jsonl(root / "mt_bench" / "question.jsonl"):
        by_category[row["category"]].append(row)
    rows = [r for group in zip_longest(*by_category.values()) for r in group if r][:count]
    return [Conversation("mt_bench", f"{r['question_id']} {r['category']}",
                         [{"role": "user", "content": r["turns"][0]}],
                         user_turns=list(r["turns"][1:])) for r in rows]


def _example_constants(source: str) -> tuple[dict[str, Any], ast.Module]:
    tree = ast.parse(source)
    constants: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name):
                try:
                    constants[target.id] = ast.literal_eval(node.value)
                except ValueError:
                    continue
    return constants, tree


def _tool_spec(tree: ast.Module, name: str) -> dict[str, Any]:
    """The OpenAI tool spec of the example's ``name`` function (string arguments)."""
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
    args = [a.arg for a in fn.args.args]
    return {"type": "function", "function": {
        "name": name, "description": ast.get_docstring(fn) or "",
        "parameters": {"type": "object", "properties": {a: {"type": "string"} for a in args},
                       "required": args}}}


def keyword_search(passages: Sequence[str], k: int = SEARCH_K) -> Callable[[str], str]:
    """The ``k`` passages sharing the most words with the query (ties: file order), one a line."""
    def words(text: str) -> set[str]:
        return set(re.findall(r"[a-z0-9]+", text.lower()))

    def search(query: str) -> str:
        ranked = sorted(passages, key=lambda p: -len(words(p) & words(query)))
        return "\n".join(ranked[:k])

    return search


def agent_transcript(example: Path = AGENT_EXAMPLE, system: str = "stop") -> Conversation:
    """examples/agents.py's agent task as a conversation (see the module doc)."""
    constants, tree = _example_constants(example.read_text(encoding="utf-8"))
    tools = check_tools([_tool_spec(tree, "search_handbook")])
    return Conversation(
        "agent", f"examples/agents.py system={system}",
        [{"role": "system", "content": constants["SYSTEM_PROMPTS"][system]},
         {"role": "user", "content": constants["QUESTION"]}],
        tools=tools, first_prefill=f"{OPEN}\n", search=keyword_search(constants["HANDBOOK"]))


def prompts(conversation: Conversation, lm: LM, replies: Sequence[str]) -> list[list[int]]:
    """Each turn's prompt ids when the model replies ``replies`` in order (for tests and checks)."""
    seen: list[list[int]] = []

    def answer(turn: int, ids: list[int]) -> str:
        seen.append(ids)
        return replies[turn - 1]

    walk(conversation, lm, answer, len(replies))
    return seen
