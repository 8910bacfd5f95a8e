"""Tool calls and structured output through the chat adapters' path.

``python -m shared_core.bench tools [--model M] [--limit N]`` runs, on prompts written for this
benchmark (not from the shared data):

- **tool use** (24 prompts, 6 tools): for ``tool_choice`` ``auto`` and ``required`` and for each
  engine: the rate of replies with a call, of the right tool, of the right tool with arguments
  valid for its schema, and with the expected argument values; wall time and tokens per second;
  ReSpec's token ids compared with plain decoding's (``identical_to``).
- **extraction** (20 texts, 4 schemas): valid-JSON and schema-valid rates without and with
  constrained decoding (xgrammar), for each engine; constrained ReSpec compared token for token
  with constrained plain decoding.

Every call goes through :func:`shared_core.frontend.chat.chat` (what ``ChatSpeculative``
and ``SpeculativeLLM`` run), greedy, one model, one process, after a warm-up call per engine.
The engines are interleaved: each prompt runs on every engine in turn before the next prompt,
so on a shared machine they see the same load; the report has the total and the per-prompt
median speed-up, prefill and decode seconds, drafted / accepted tokens and the load averages
before and after each part.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ValidationError, create_model

from shared_core.config import DEFAULT_LM
from shared_core.frontend.chat import ChatSettings, chat
from shared_core.util.device import cpu_facts

logger = logging.getLogger(__name__)
# Tokens per reply, smaller than DEFAULT_MAX_NEW_TOKENS (256) to keep the benchmark short: a tool
# call or a small JSON object fits.
TOOLS_MAX_NEW_TOKENS = 64


class _Settings(ChatSettings):
    max_new_tokens: int = TOOLS_MAX_NEW_TOKENS


def _tool(name: str, description: str, **params: tuple[type, str]) -> dict[str, Any]:
    fields: dict[str, Any] = {k: (t, ...) for k, (t, _) in params.items()}
    model = create_model(name, **fields)
    schema = model.model_json_schema()
    for key, (_, doc) in params.items():
        schema["properties"][key]["description"] = doc
    schema.pop("title", None)
    return {"type": "function", "function": {"name": name, "description": description,
                                             "parameters": schema}}


TOOLS = [
    _tool("get_weather", "Current weather in a city.", city=(str, "the city name")),
    _tool("add_numbers", "Add two integers.", a=(int, "first"), b=(int, "second")),
    _tool("convert_currency", "Convert an amount between currencies.",
          amount=(float, "the amount"), source=(str, "currency code to convert from"),
          target=(str, "currency code to convert to")),
    _tool("search_docs", "Search the product documentation.", query=(str, "search words")),
    _tool("set_timer", "Start a countdown timer.", minutes=(int, "length in minutes")),
    _tool("send_email", "Send an email.", to=(str, "recipient address"),
          subject=(str, "subject line")),
]
# (prompt, expected tool, expected argument values: each must appear in the call's arguments)
TOOL_PROMPTS: list[tuple[str, str, dict[str, Any]]] = [
    ("What's the weather like in Lisbon right now?", "get_weather", {"city": "Lisbon"}),
    ("Is it raining in Tokyo today?", "get_weather", {"city": "Tokyo"}),
    ("Tell me the current weather for Nairobi.", "get_weather", {"city": "Nairobi"}),
    ("How warm is it in Oslo at the moment?", "get_weather", {"city": "Oslo"}),
    ("What is 17 plus 25?", "add_numbers", {"a": 17, "b": 25}),
    ("Add 300 and 45 for me.", "add_numbers", {"a": 300, "b": 45}),
    ("Compute the sum of 8 and 13.", "add_numbers", {"a": 8, "b": 13}),
    ("What do you get when you add 1000 to 234?", "add_numbers", {"a": 1000, "b": 234}),
    ("Convert 50 USD to EUR.", "convert_currency", {"amount": 50, "source": "USD", "target": "EUR"}),
    ("How many yen is 20 GBP?", "convert_currency", {"amount": 20, "source": "GBP", "target": "JPY"}),
    ("Change 75.5 EUR into CHF.", "convert_currency",
     {"amount": 75.5, "source": "EUR", "target": "CHF"}),
    ("Convert 1200 SEK to USD please.", "convert_currency",
     {"amount": 1200, "source": "SEK", "target": "USD"}),
    ("Find the documentation about password reset.", "search_docs", {"query": "password reset"}),
    ("Search the docs for API rate limits.", "search_docs", {"query": "API rate limits"}),
    ("Look up how to export data to CSV in the documentation.", "search_docs",
     {"query": "export data to CSV"}),
    ("Where do the docs explain two-factor authentication?", "search_docs",
     {"query": "two-factor authentication"}),
    ("Set a timer for 10 minutes.", "set_timer", {"minutes": 10}),
    ("Start a 25 minute countdown.", "set_timer", {"minutes": 25}),
    ("Remind me in 5 minutes with a timer.", "set_timer", {"minutes": 5}),
    ("I need a 45-minute timer for the oven.", "set_timer", {"minutes": 45}),
    ("Email bob@example.com with the subject 'Lunch plans'.", "send_email",
     {"to": "bob@example.com", "subject": "Lunch plans"}),
    ("Send an email to ana@corp.io titled 'Q3 report'.", "send_email",
     {"to": "ana@corp.io", "subject": "Q3 report"}),
    ("Write to support@shop.com with subject 'Refund request'.", "send_email",
     {"to": "support@shop.com", "subject": "Refund request"}),
    ("Email li@uni.edu, subject 'Thesis draft'.", "send_email",
     {"to": "li@uni.edu", "subject": "Thesis draft"}),
]


class Person(BaseModel):
    name: str
    age: int
    city: str


class Event(BaseModel):
    title: str
    day: str
    attendees: int


class Product(BaseModel):
    name: str
    price: float
    in_stock: bool


class Ticket(BaseModel):
    customer: str
    priority: Literal["low", "medium", "high"]
    summary: str


EXTRACTION: list[tuple[str, type[BaseModel]]] = [
    ("Maria Lopez is 34 years old and lives in Madrid.", Person),
    ("Our new neighbour, Tom Becker (52), moved here from Hamburg.", Person),
    ("Aiko Tanaka, aged 27, works as a nurse in Osaka.", Person),
    ("Ravi Patel is a 61-year-old retired teacher living in Pune.", Person),
    ("At 19, Lena Novak left Prague to study.", Person),
    ("The Spring Gala takes place on Saturday with 120 guests expected.", Event),
    ("Team standup: Monday, 8 people attending.", Event),
    ("The book club meets on Thursday; 14 members have signed up.", Event),
    ("Quarterly review is scheduled for Friday with 30 attendees.", Event),
    ("Hackathon kickoff on Sunday, 200 participants registered.", Event),
    ("The UltraBlend 3000 blender costs 89.99 dollars and is in stock.", Product),
    ("Trail running shoes, 120.00, currently sold out.", Product),
    ("Noise-cancelling headphones at 249.50 — available now.", Product),
    ("The ceramic teapot is 35 dollars but out of stock until May.", Product),
    ("A 4K monitor priced at 399.00, ships today, in stock.", Product),
    ("Customer Jane Doe reports the app crashes on login; urgent.", Ticket),
    ("Mark Chen asks how to change his invoice address, no rush.", Ticket),
    ("Priya Singh: payment failed twice, needs help soon.", Ticket),
    ("Omar Haddad says the dark mode colors look slightly off.", Ticket),
    ("Sofia Rossi cannot access her account at all; critical.", Ticket),
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_LM)
    parser.add_argument("--limit", type=int, default=None, help="prompts per set")
    parser.add_argument("--max-new-tokens", type=int, default=TOOLS_MAX_NEW_TOKENS)
    parser.add_argument("--engines", nargs="+", default=["autoregressive", "respec"])
    parser.add_argument("--part", choices=["tools", "extraction", "both"], default="both")
    parser.add_argument("--tool-choices", nargs="+", default=["auto", "required"],
                        choices=["auto", "required"])
    parser.add_argument("--extraction-modes", nargs="+", default=["free", "constrained"],
                        choices=["free", "constrained"])


def _generate(settings: _Settings, turns: list[dict[str, Any]], options: dict[str, Any]
              ) -> tuple[Any, Any]:
    # a copy per call: no engine state (decoders) carried from one prompt to the next
    reply = chat(settings.model_copy(deep=True), turns, options).finish().reply
    return reply, reply.result


def _args_valid(tool: str, args: dict[str, Any]) -> bool:
    params = next(t for t in TOOLS if t["function"]["name"] == tool)["function"]["parameters"]
    types: dict[str, type | tuple[type, ...]] = {"string": str, "integer": int,
                                                 "number": (int, float)}
    props = params["properties"]
    return set(args) == set(params.get("required", [])) and all(
        isinstance(v, types[props[k]["type"]]) and not isinstance(v, bool)
        for k, v in args.items() if k in props)


def _expected(args: dict[str, Any], want: dict[str, Any]) -> bool:
    def same(a: Any, b: Any) -> bool:
        if isinstance(b, str):
            return isinstance(a, str) and a.strip().lower() == b.lower()
        return isinstance(a, (int, float)) and float(a) == float(b)

    return all(same(args.get(k), v) for k, v in want.items())


Run = tuple[Any, Any]  # (Reply, GenerationResult)


def _interleaved(cases: list[Any], engines: list[str], one: Callable[[Any, str], Run]
                 ) -> tuple[dict[str, list[Run]], dict[str, list[float]]]:
    """Every case through every engine in turn (case by case), so that the engines compared
    share the machine's load; per-engine runs and per-case wall times."""
    runs: dict[str, list[Run]] = {e: [] for e in engines}
    walls: dict[str, list[float]] = {e: [] for e in engines}
    for i, item in enumerate(cases):
        for engine in engines:
            start = time.perf_counter()
            runs[engine].append(one(item, engine))
            walls[engine].append(time.perf_counter() - start)
        logger.info("case %d/%d: %s", i + 1, len(cases),
                    " ".join(f"{e}={walls[e][-1]:.1f}s" for e in engines))
    return runs, walls


def _speed(runs: list[Run], walls: list[float]) -> dict[str, Any]:
    """Wall time, tokens per second and the engine's counters summed over the cases."""
    stats = [r.stats for _, r in runs]
    tokens = sum(s.new_tokens for s in stats)
    wall = sum(walls)
    decode = sum(s.decode_s for s in stats)
    rounds = sum(s.rounds for s in stats)
    accepted = sum(s.accepted for s in stats)
    return {"wall_s": round(wall, 2), "new_tokens": tokens,
            "tokens_per_s": round(tokens / wall, 2) if wall else None,
            "prefill_s": round(sum(s.prefill_s for s in stats), 2), "decode_s": round(decode, 2),
            "decode_tokens_per_s": round(tokens / decode, 2) if decode else None,
            "drafted": sum(s.drafted for s in stats), "accepted": accepted, "rounds": rounds,
            "accepted_per_round": round(accepted / rounds, 2) if rounds else None}


def _tool_scores(runs: list[Run], prompts: list[Any]) -> dict[str, str]:
    counts = {"called": 0, "right_tool": 0, "right_tool_valid_args": 0, "expected_args": 0}
    for (reply, _), (_, tool, want) in zip(runs, prompts, strict=True):
        calls = reply.tool_calls
        first = calls[0] if calls else None
        counts["called"] += first is not None
        right = first is not None and first.name == tool
        counts["right_tool"] += right
        if first is not None and right:
            counts["right_tool_valid_args"] += _args_valid(tool, first.arguments)
            counts["expected_args"] += _expected(first.arguments, want)
    return {k: f"{v}/{len(prompts)}" for k, v in counts.items()}


def _tool_case(settings: _Settings, choice: str) -> Callable[[Any, str], Run]:
    def one(item: tuple[str, str, dict[str, Any]], engine: str) -> Run:
        return _generate(settings, [{"role": "user", "content": item[0]}],
                         {"tools": TOOLS, "tool_choice": choice, "engine": engine})

    return one


def _extraction_case(settings: _Settings, constrained: bool) -> Callable[[Any, str], Run]:
    def one(item: tuple[str, type[BaseModel]], engine: str) -> Run:
        text, model = item
        schema = model.model_json_schema()
        user = f"Extract the fields from this text as JSON.\nText: {text}"
        if constrained:
            return _generate(settings, [{"role": "user", "content": user}], {
                "engine": engine, "response_format": {"type": "json_schema", "schema": schema}})
        system = ("Respond only with a JSON object that matches this JSON schema:\n"
                  + json.dumps(schema))  # the instruction the constrained path adds
        return _generate(settings, [{"role": "system", "content": system},
                                    {"role": "user", "content": user}], {"engine": engine})

    return one


def _extraction_scores(runs: list[Run], items: list[Any]) -> dict[str, str]:
    valid_json = valid_schema = 0
    for (_, result), (_, model) in zip(runs, items, strict=True):
        try:
            json.loads(result.text)
            valid_json += 1
            model.model_validate_json(result.text)
            valid_schema += 1
        except (json.JSONDecodeError, ValidationError):
            pass
    n = len(items)
    return {"valid_json": f"{valid_json}/{n}", "schema_valid": f"{valid_schema}/{n}"}


def _identical(a: list[list[int]], b: list[list[int]]) -> str:
    return f"{sum(x == y for x, y in zip(a, b, strict=True))}/{len(a)}"


def _compare(name: str, engines: list[str], runs: dict[str, list[Run]],
             walls: dict[str, list[float]], scores: Callable[[list[Run]], dict[str, str]]
             ) -> dict[str, Any]:
    """One method per engine: scores and speed; the others compared with the first engine
    (token ids, total and per-case median speed-up: the cases ran side by side)."""
    import statistics

    base = engines[0]
    out: dict[str, Any] = {}
    for engine in engines:
        row = {**scores(runs[engine]), **_speed(runs[engine], walls[engine])}
        if engine != base:
            ids = [[r.token_ids for _, r in runs[e]] for e in (engine, base)]
            row["identical_to"] = {base: _identical(*ids)}
            row["speedup"] = round(sum(walls[base]) / sum(walls[engine]), 2)
            row["speedup_median_per_case"] = round(statistics.median(
                b / e for b, e in zip(walls[base], walls[engine], strict=True)), 2)
        out[f"{name}/{engine}"] = row
    return out


def _parts(args: argparse.Namespace, settings: _Settings) -> list[tuple[str, list[Any], Any, Any]]:
    """(method prefix, cases, case runner, scorer) of each selected part and mode."""
    prompts, items = TOOL_PROMPTS[: args.limit], EXTRACTION[: args.limit]
    out: list[tuple[str, list[Any], Any, Any]] = []
    if args.part in ("tools", "both"):
        out += [(f"tools/{choice}", prompts, _tool_case(settings, choice),
                 lambda runs, p=prompts: _tool_scores(runs, p)) for choice in args.tool_choices]
    if args.part in ("extraction", "both"):
        out += [(f"extraction/{mode}", items, _extraction_case(settings, mode == "constrained"),
                 lambda runs, i=items: _extraction_scores(runs, i)) for mode in args.extraction_modes]
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    import os

    import torch

    settings = _Settings(model=args.model, max_new_tokens=args.max_new_tokens)
    for engine in args.engines:  # warm-up: weights, kernels, the grammar compiler
        _generate(settings, [{"role": "user", "content": "Hi"}],
                  {"tools": TOOLS, "tool_choice": "required", "engine": engine})
    methods: dict[str, Any] = {}
    loads: dict[str, Any] = {}
    n: dict[str, int] = {}
    for name, cases, one, scores in _parts(args, settings):
        before = os.getloadavg()
        runs, walls = _interleaved(cases, args.engines, one)
        loads[name] = {"before": before, "after": os.getloadavg()}
        methods.update(_compare(name, args.engines, runs, walls, scores))
        n[name.split("/")[0]] = len(cases)
    return {"engine": "tools", "dataset": "issue-16 tool-use and extraction prompts (in code)",
            "n": n, "device": "cpu", "order": "interleaved: each case runs on every engine in "
            "turn, after one warm-up call per engine", "threads": torch.get_num_threads(),
            "models": {"target": args.model}, "loadavg": loads, "cpu": cpu_facts(),
            "methods": methods}
