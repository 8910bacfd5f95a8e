"""Prefix reuse in a conversation: time to first token of a follow-up turn.

``python -m shared_core.bench chat --models smollm2-135m-instruct --context-tokens 1200 --out F.json``

A system prompt of about ``--context-tokens`` tokens and a first question are answered (greedy);
the follow-up prompt is that conversation, the answer and a new question. Its time to first token
(the prefill of the whole prompt, whose last row gives the first new token, as the engines read it) is
timed with the idle context still holding the first turn ("on") and from an empty context ("off"),
alternating, ``--repeats`` times each (medians). The report also counts, over ``--questions``
follow-ups generated both ways, how many are identical token for token (the default mode is not
bit-exact, ``exact=True`` is). The load average is recorded: on a shared machine the absolute
times move, the on/off ratio much less.

``--sources mt_bench agent`` also runs real conversations (:mod:`shared_core.bench.chat.sources`):
``--conversations`` MT-Bench rows and the agent transcript of ``examples/agents.py``. Every turn
after the first is run twice, interleaved, right after the turn before it: with the cache holding
what that turn left ("on"), then from an empty cache ("off"; the conversation goes on with this
reply); each run's time to first token and total turn time (greedy, ``--max-new-tokens``), the
reused prompt tokens and whether the two replies are identical token for token are one row
(:mod:`shared_core.bench.chat.turns`), with per-source medians and a bar plot (``--plot``).

``--backend torch`` runs the same on torch (:mod:`shared_core.runtime.torch.prefix`): a first turn there
leaves its prompt cached, not its answer; ``--exact`` is its bit-exact mode.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

from shared_core.bench.chat.sources import AGENT_EXAMPLE, agent_transcript, mt_bench
from shared_core.bench.chat.turns import conversation_rows, medians, plot_turns, warm_up
from shared_core.bench.common import NeedsCheckout, data_dir, lm_threads
from shared_core.engines.baseline import autoregressive_generate
from shared_core.runtime.lm import clear_prefix_cache
from shared_core.runtime.models import LM, load_lm
from shared_core.runtime.torch.session import open_session
from shared_core.util.device import cpu_facts

FACTS = ("The Hollin Weir was built in 1874 by the engineer Marta Quell to control the river Dast. "
         "It has eleven sluice gates, each named after a month except June. The keeper's cottage, "
         "painted blue, stands on the east bank next to the fish ladder. Gate {i} was rebuilt in "
         "{year} after a flood carried away its oak beams. ")
SOURCES = ("synthetic", "mt_bench", "agent")
QUESTIONS = ("How many sluice gates are there?", "What colour is the cottage?",
             "Which gate was rebuilt most recently?", "Who built the weir?")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", default=["smollm2-135m-instruct"])
    parser.add_argument("--context-tokens", type=int, default=1200)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--questions", type=int, default=len(QUESTIONS))
    parser.add_argument("--exact", action="store_true")
    parser.add_argument("--backend", choices=("llama.cpp", "torch"), default="llama.cpp")
    parser.add_argument("--sources", nargs="+", choices=SOURCES, default=list(SOURCES))
    parser.add_argument("--conversations", type=int, default=6, help="MT-Bench conversations")
    parser.add_argument("--agent-turns", type=int, default=3, help="model turns of the agent")
    parser.add_argument("--data-dir", default=None, help="the shared data folder")


def conversation(lm: LM, tokens: int) -> list[dict[str, str]]:
    parts: list[str] = []
    while len(lm.encode("".join(parts))) < tokens:
        parts.append(FACTS.format(i=len(parts) + 1, year=1900 + 7 * len(parts)))
    return [{"role": "system", "content": "Answer from the record.\n" + "".join(parts)},
            {"role": "user", "content": "Summarise the record in one sentence."}]


def ttft(lm: LM, ids: list[int]) -> tuple[float, int]:
    """Seconds to read ``ids`` and get the first new token's logits; prompt ids reused."""
    start = time.perf_counter()
    session = open_session(lm)
    session.prefill(ids)
    return time.perf_counter() - start, session.reused_tokens


def measure(lm: LM, turn_1: list[dict[str, str]], max_new: int, repeats: int) -> dict[str, Any]:
    first = autoregressive_generate(lm, turn_1, max_new)
    kept = first_turn_cache(lm, turn_1, first.token_ids)
    follow = lm.prompt_ids([*turn_1, {"role": "assistant", "content": first.text},
                            {"role": "user", "content": QUESTIONS[0]}])
    on, off, reused = [], [], 0
    for _ in range(repeats):
        clear_prefix_cache(lm)
        open_session(lm).prefill(kept)  # what the first turn leaves cached
        seconds, reused = ttft(lm, follow)
        on.append(seconds)
        clear_prefix_cache(lm)
        off.append(ttft(lm, follow)[0])
    return {"prompt_tokens": len(follow), "reused_tokens": reused,
            "ttft_off_s": round(statistics.median(off), 4), "ttft_on_s": round(statistics.median(on), 4),
            "speedup": round(statistics.median(off) / statistics.median(on), 2)}


def first_turn_cache(lm: LM, turn_1: list[dict[str, str]], answer: list[int]) -> list[int]:
    """The ids a first turn leaves cached: a llama.cpp context keeps the prompt and the answer
    (but its last token, never read), torch's prefix store the prompt it prefilled."""
    prompt = lm.prompt_ids(turn_1)
    return prompt if lm.backend == "torch" else [*prompt, *answer[:-1]]


def identical(lm: LM, turn_1: list[dict[str, str]], max_new: int, count: int) -> dict[str, Any]:
    """Follow-ups generated with the first turn cached and cold: how many are equal."""
    same = 0
    for question in QUESTIONS[:count]:
        first = autoregressive_generate(lm, turn_1, max_new)
        ids = lm.prompt_ids([*turn_1, {"role": "assistant", "content": first.text},
                             {"role": "user", "content": question}])
        warm = autoregressive_generate(lm, ids, max_new).token_ids
        clear_prefix_cache(lm)
        same += warm == autoregressive_generate(lm, ids, max_new).token_ids
    return {"identical": same, "conversations": count}


def synthetic_row(name: str, lm: LM, args: argparse.Namespace) -> dict[str, Any]:
    turn_1 = conversation(lm, args.context_tokens)
    return {"model": name, "exact": args.exact, "threads": lm_threads(lm),
            **measure(lm, turn_1, args.max_new_tokens, args.repeats),
            **identical(lm, turn_1, args.max_new_tokens, args.questions),
            "load_average": os.getloadavg()}


def real_turns(lm: LM, args: argparse.Namespace) -> list[dict[str, Any]]:
    conversations = []
    if "mt_bench" in args.sources:
        conversations += mt_bench(Path(args.data_dir) if args.data_dir else data_dir(),
                                  args.conversations)
    if "agent" in args.sources:
        conversations.append(agent_transcript())
    rows: list[dict[str, Any]] = []
    for conv in conversations:
        turns = args.agent_turns if conv.source == "agent" else 1 + len(conv.user_turns)
        rows += conversation_rows(lm, conv, args.max_new_tokens, turns)
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    if "agent" in args.sources and not AGENT_EXAMPLE.is_file():
        msg = (f"--sources agent replays {AGENT_EXAMPLE} (examples/ of a specrag checkout; not "
               "part of the package): leave 'agent' out of --sources")
        raise NeedsCheckout(msg)
    rows, turns, models = [], [], {}
    load_before = os.getloadavg()
    for name in args.models:
        lm = load_lm(name, backend=args.backend, exact=args.exact)
        models[name] = {"backend": lm.backend, "threads": lm_threads(lm), "max_context": lm.max_context}
        warm_up(lm, args.max_new_tokens)
        if "synthetic" in args.sources:
            rows.append(synthetic_row(name, lm, args))
        turns += [{"model": name, **row} for row in real_turns(lm, args)]
    report = {"benchmark": "chat", "machine": cpu_facts(), "models": models,
              "cpu_affinity": sorted(os.sched_getaffinity(0)), "exact": args.exact,
              "max_new_tokens": args.max_new_tokens, "rows": rows, "turns": turns,
              "medians": medians(turns),
              "load_average": {"before": load_before, "after": os.getloadavg()}}
    if getattr(args, "plot", None) and turns:
        plot_turns(report, args.plot)
    return report
