"""Agents with the specrag chat components over a real retriever tool, fully offline.

Three agent frameworks run the same task: answer a question about a small employee handbook,
using a ``search_handbook`` tool that searches the handbook's passages with the embedded MiniLM
(LangChain ``InMemoryVectorStore`` + ``SpecragEmbeddings``):

1. LangGraph ``create_react_agent(ChatSpeculative(...), [tool])``;
2. LangChain ``langchain.agents.create_agent(ChatSpeculative(...), [tool])``;
3. LlamaIndex ``FunctionAgent(llm=SpeculativeLLM(...), tools=[FunctionTool])``.

The chat model renders the tools with its own chat template (Qwen2.5's takes ``tools=``; for
SmolLM2 the same Hermes format is written into its turns), parses ``<tool_call>`` replies into
tool calls and runs the chosen engine (ReSpec by default) inside every turn. The transcript
shows every message, and for each model turn its wall time and engine stats (prompt tokens,
prefill / decode seconds, drafted / accepted tokens). Nothing stops an agent early: it ends
when the model answers without a call, or at the framework's own step limit (reported as such).

Run: python examples/agents.py [--model qwen2.5-coder-1.5b-instruct] [--engine respec]
     [--agents langgraph langchain llamaindex] [--max-steps 4] [--system stop|plain]
     [--no-prefix-cache] [--show-prompts] [--out F.txt]
(``--show-prompts`` prints the exact prompt each model turn sees, as rendered by the template.)

The system prompt: ``plain`` only says to answer from the search results; ``stop`` (the default)
also says when to stop calling the tool. With ``plain``, Qwen2.5-Coder-1.5B re-issues the same
call after the tool result: its next-token distribution there puts 0.24 on ``{"`` (the call again,
as bare JSON) and 0.23 on a code fence, against 0.11 on ``To``; with ``stop`` its greedy reply
there is the answer, but its first turn then describes the tool in prose instead of calling it
(results/specrag/2026-11-26b/README.md). ``--force-first-call`` gives LangChain's agent a middleware that sets
``tool_choice="required"`` until a tool has answered. ``--no-prefix-cache`` empties the llama.cpp
prefix cache before every model turn, to time the turns as they were before prefix reuse.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from uuid import UUID

from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import AIMessage, BaseMessage, ToolMessage
from langchain_core.runnables import RunnableConfig
from langchain_core.tools import StructuredTool
from langchain_core.vectorstores import InMemoryVectorStore

from langchain_specrag import ChatSpeculative, SpecragEmbeddings
from shared_core.config import DEFAULT_LM
from shared_core.frontend.chat import DEFAULT_ENGINE

logger = logging.getLogger("agents")
HANDBOOK = [
    "Veldmark Ltd employee handbook: every employee gets 27 days of paid vacation per year.",
    "Veldmark Ltd expense policy: meals during travel are reimbursed up to 45 euros per day.",
    "Veldmark Ltd working hours: the core hours are 10:00 to 15:00, Monday to Friday.",
    "Veldmark Ltd parental leave: parents get 16 weeks of paid leave after a birth or adoption.",
    "Veldmark Ltd equipment: every employee may choose a laptop and one external monitor.",
    "Veldmark Ltd remote work: employees may work from home up to three days per week.",
]
QUESTION = "How many days of paid vacation do Veldmark employees get? Use the handbook search tool."
SYSTEM_PROMPTS = {
    "plain": "You are a helpful assistant. Answer from the handbook search results.",
    "stop": ("You are a helpful assistant. Answer from the handbook search results. Once a "
             "<tool_response> holds the answer, reply with that answer in one sentence."),
}
SYSTEM = SYSTEM_PROMPTS["stop"]
AGENTS = ("langgraph", "langchain", "llamaindex")
MAX_STEPS = 4  # model turns per agent
# Tokens per model turn, smaller than DEFAULT_MAX_NEW_TOKENS (256) to keep the run short: a turn
# is one tool call or a short answer.
AGENT_MAX_TOKENS = 128


def handbook_search(k: int = 2) -> Callable[[str], str]:
    """The tool's function: the ``k`` handbook passages nearest to the query (embedded MiniLM)."""
    store = InMemoryVectorStore.from_texts(HANDBOOK, SpecragEmbeddings())

    def search_handbook(query: str) -> str:
        """Search the Veldmark employee handbook and return the most relevant passages."""
        return "\n".join(d.page_content for d in store.similarity_search(query, k=k))

    return search_handbook


@dataclass
class Transcript:
    """What one agent did: the printable lines, its messages (LangChain) or events (LlamaIndex),
    the timed model turns and how it ended."""

    lines: list[str]
    items: list[Any]
    turns: list[Turn]
    outcome: str


@dataclass
class Turn:
    """One model call: its wall time and the engine report the adapter attached."""

    seconds: float
    report: dict[str, Any] = field(default_factory=dict)


def stats_line(turn: Turn) -> str:
    report = turn.report or {}
    s = report.get("speculative_stats") or {}
    return (f"{turn.seconds:.1f}s; engine={report.get('engine')} prompt={s.get('prompt_tokens')} "
            f"reused={s.get('cached_prompt_tokens')} new={s.get('new_tokens')} "
            f"prefill={s.get('prefill_s', 0):.1f}s "
            f"decode={s.get('decode_s', 0):.1f}s drafted={s.get('drafted')} "
            f"accepted={s.get('accepted')} rounds={s.get('rounds')} "
            f"finish={report.get('finish_reason')}")


def render(model: str, turns: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
    """The exact prompt text a turn's model sees (the chat template with the tools)."""
    from shared_core.decoding.tool_calls import check_tools, render_prompt

    lm = _loaded(model)
    return str(lm.tokenizer.decode(render_prompt(lm, turns, check_tools(tools))))


def _loaded(model: str) -> Any:
    """The model object the chat adapters use for ``model`` (same cache, same backend)."""
    from shared_core.config import DEFAULT_BACKEND
    from shared_core.frontend.serving import loaded_model

    return loaded_model(model, None, None, DEFAULT_BACKEND)[0]


def forget_prefixes(model: str) -> None:
    """Empty the llama.cpp prefix cache of ``model`` (a no-op on torch, which keeps none)."""
    from shared_core.runtime.lm import clear_prefix_cache

    clear_prefix_cache(_loaded(model))


class TurnRecorder(BaseCallbackHandler):
    """Times every chat-model call of a LangChain / LangGraph agent (and can print its prompt)."""

    def __init__(self, show_prompt: Callable[[list[BaseMessage]], None] | None = None,
                 before_turn: Callable[[], None] | None = None) -> None:
        self.turns: list[Turn] = []
        self._started: dict[UUID, float] = {}
        self._show_prompt = show_prompt
        self._before_turn = before_turn

    def on_chat_model_start(self, serialized: dict[str, Any], messages: list[list[BaseMessage]],
                            *, run_id: UUID, **kwargs: Any) -> None:
        if self._show_prompt is not None:
            self._show_prompt(messages[0])
        if self._before_turn is not None:
            self._before_turn()
        self._started[run_id] = time.perf_counter()

    def on_llm_end(self, response: Any, *, run_id: UUID, **kwargs: Any) -> None:
        message = response.generations[0][0].message
        self.turns.append(Turn(time.perf_counter() - self._started.pop(run_id),
                               dict(message.response_metadata)))


def _message_lines(messages: list[BaseMessage], turns: list[Turn]) -> list[str]:
    lines, answered = [], iter(turns)
    for m in messages:
        if isinstance(m, AIMessage):
            calls = [(c["name"], c["args"]) for c in m.tool_calls]
            turn = next(answered, None)
            lines.append(f"[ai] {m.content!r}" + (f" tool_calls={calls}" if calls else "")
                         + (f" invalid={m.invalid_tool_calls}" if m.invalid_tool_calls else "")
                         + (f"\n     ({stats_line(turn)})" if turn else ""))
        elif isinstance(m, ToolMessage):
            lines.append(f"[tool {m.name} id={m.tool_call_id}] {m.content!r}")
        else:
            lines.append(f"[{m.type}] {m.content!r}")
    return lines


FACT = "27"  # the handbook's answer to QUESTION


def _ending(answer: str) -> str:
    """How an agent that stopped calling tools ended: an answer (holding the handbook's figure
    or not), or an empty reply."""
    if not answer.strip():
        return "ended with an empty reply"
    return "finished with an answer " + ("that holds the handbook's figure" if FACT in answer
                                         else "that lacks the handbook's figure")


def first_call_required() -> Any:
    """LangChain agent middleware: ``tool_choice="required"`` until a tool has answered, then the
    model's own choice (``"auto"``): a forced first search, and the model decides when to stop."""
    from langchain.agents.middleware import wrap_model_call

    @wrap_model_call
    def require_first_call(request: Any, handler: Callable[[Any], Any]) -> Any:
        if not any(isinstance(m, ToolMessage) for m in request.messages):
            request = request.override(tool_choice="required")
        return handler(request)

    return require_first_call


def run_langchain(kind: str, llm: ChatSpeculative, tool: Callable[[str], str], max_steps: int,
                  show_prompts: bool, system: str = SYSTEM,
                  before_turn: Callable[[], None] | None = None,
                  force_first_call: bool = False) -> Transcript:
    """A LangGraph ReAct agent or a LangChain ``create_agent`` agent (``force_first_call``: the
    :func:`first_call_required` middleware, LangChain's agent only)."""
    from langgraph.errors import GraphRecursionError

    lc_tool = StructuredTool.from_function(tool)
    show = None
    if show_prompts:
        from langchain_core.utils.function_calling import convert_to_openai_tool

        from langchain_specrag.chat_models.speculative import to_chat_messages

        spec = [convert_to_openai_tool(lc_tool)]
        show = lambda msgs: logger.info("prompt:\n%s", render(  # noqa: E731
            llm.model, to_chat_messages(msgs), spec))
    if kind == "langgraph":
        from langgraph.prebuilt import create_react_agent

        agent = create_react_agent(llm, [lc_tool], prompt=system)
    else:
        from langchain.agents import create_agent

        middleware = [first_call_required()] if force_first_call else []
        agent = create_agent(llm, [lc_tool], system_prompt=system, middleware=middleware)
    recorder = TurnRecorder(show, before_turn)
    config: RunnableConfig = {"callbacks": [recorder], "recursion_limit": 2 * max_steps + 1}
    start = time.perf_counter()
    messages: list[BaseMessage] = []
    try:  # stream the state so the messages survive the step limit
        for state in agent.stream({"messages": [("human", QUESTION)]}, config,
                                  stream_mode="values"):
            messages = state["messages"]
        outcome = _ending(str(messages[-1].content) if messages else "")
    except GraphRecursionError:
        outcome = f"did not finish: step limit ({max_steps} model turns) reached"
    lines = [*_message_lines(messages, recorder.turns),
             f"-- {outcome} in {time.perf_counter() - start:.1f}s"]
    return Transcript(lines, messages, recorder.turns, outcome)


async def _llamaindex(llm: Any, tool: Callable[[str], str], max_steps: int,
                      show_prompts: bool, system: str = SYSTEM,
                      before_turn: Callable[[], None] | None = None) -> Transcript:
    from llama_index.core.agent.workflow import AgentInput, AgentOutput, FunctionAgent, ToolCallResult
    from llama_index.core.tools import FunctionTool
    from llama_index.core.workflow.errors import WorkflowRuntimeError

    from llamaindex_specrag.llms.tools import chat_dicts

    li_tool = FunctionTool.from_defaults(fn=tool)
    agent = FunctionAgent(llm=llm, tools=[li_tool], system_prompt=system)
    lines = [f"[human] {QUESTION!r}"]
    events: list[Any] = []
    turns: list[Turn] = []
    start = turn_start = time.perf_counter()
    handler = agent.run(user_msg=QUESTION, max_iterations=max_steps)
    try:
        async for event in handler.stream_events():
            if isinstance(event, AgentInput):
                if before_turn is not None:
                    before_turn()
                turn_start = time.perf_counter()
                if show_prompts:
                    spec = [li_tool.metadata.to_openai_tool(skip_length_check=True)]
                    logger.info("prompt:\n%s", render(llm.model, chat_dicts(event.input), spec))
            elif isinstance(event, AgentOutput):
                turn = Turn(time.perf_counter() - turn_start, event.raw or {})
                turns.append(turn)
                events.append(event)
                calls = [(c.tool_name, c.tool_kwargs) for c in event.tool_calls]
                lines.append(f"[ai] {event.response.content!r}"
                             + (f" tool_calls={calls}" if calls else "")
                             + f"\n     ({stats_line(turn)})")
            elif isinstance(event, ToolCallResult):
                events.append(event)
                lines.append(f"[tool {event.tool_name} id={event.tool_id}] "
                             f"{event.tool_output.content!r}")
        response: object = await handler
        assert isinstance(response, AgentOutput)
        outcome = _ending(str(response.response.content or ""))
    except WorkflowRuntimeError as e:
        outcome = f"did not finish: {e}"
    lines.append(f"-- {outcome} in {time.perf_counter() - start:.1f}s")
    return Transcript(lines, events, turns, outcome)


def run_agents(model: str, engine: str = DEFAULT_ENGINE, agents: tuple[str, ...] = AGENTS,
               max_steps: int = MAX_STEPS, max_tokens: int = AGENT_MAX_TOKENS,
               show_prompts: bool = False, system: str = SYSTEM, prefix_cache: bool = True,
               force_first_call: bool = False) -> dict[str, Transcript]:
    """Each agent's transcript (one model, loaded once through the shared cache);
    ``prefix_cache=False`` empties the model's prefix cache before every turn."""
    from llamaindex_specrag import SpeculativeLLM

    tool = handbook_search()
    before_turn = None if prefix_cache else (lambda: forget_prefixes(model))
    out: dict[str, Transcript] = {}
    for kind in agents:
        if kind == "llamaindex":
            llm = SpeculativeLLM(model=model, engine=engine, max_new_tokens=max_tokens)
            out[kind] = asyncio.run(_llamaindex(llm, tool, max_steps, show_prompts, system,
                                                before_turn))
        else:
            chat = ChatSpeculative(model=model, engine=engine, max_tokens=max_tokens)
            out[kind] = run_langchain(kind, chat, tool, max_steps, show_prompts, system,
                                      before_turn, force_first_call and kind == "langchain")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_LM)
    parser.add_argument("--engine", default=DEFAULT_ENGINE)
    parser.add_argument("--agents", nargs="+", choices=AGENTS, default=list(AGENTS))
    parser.add_argument("--max-steps", type=int, default=MAX_STEPS, help="model turns per agent")
    parser.add_argument("--max-tokens", type=int, default=AGENT_MAX_TOKENS, help="per model turn")
    parser.add_argument("--system", choices=sorted(SYSTEM_PROMPTS), default="stop",
                        help="system prompt: 'stop' also says when to stop calling the tool")
    parser.add_argument("--no-prefix-cache", action="store_true",
                        help="empty the prefix cache before every model turn")
    parser.add_argument("--force-first-call", action="store_true",
                        help="LangChain's agent: tool_choice='required' until a tool answered")
    parser.add_argument("--show-prompts", action="store_true")
    parser.add_argument("--out", default=None, help="also write the transcript here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    header = (f"model={args.model} engine={args.engine} max_steps={args.max_steps} "
              f"max_tokens={args.max_tokens} system={args.system} "
              f"prefix_cache={not args.no_prefix_cache} force_first_call={args.force_first_call} "
              f"threads={os.environ.get('SPECRAG_NUM_THREADS') or os.environ.get('OMP_NUM_THREADS')}")
    text = [header]
    for kind in args.agents:
        load = os.getloadavg()
        lines = run_agents(args.model, args.engine, (kind,), args.max_steps, args.max_tokens,
                           args.show_prompts, SYSTEM_PROMPTS[args.system],
                           not args.no_prefix_cache, args.force_first_call)[kind].lines
        text += [f"\n=== {kind} (load average before {load[0]:.2f}, after "
                 f"{os.getloadavg()[0]:.2f}) ===", *lines]
        logger.info("%s", "\n".join(text[-len(lines) - 1:]))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write("\n".join(text) + "\n")


if __name__ == "__main__":
    main()
