"""Prefix reuse in a conversation on llama.cpp (issue 29): time to first token of a follow-up turn.

``python -m shared_core.bench chat --models smollm2-135m-instruct --context-tokens 1200 --out F.json``

A system prompt of about ``--context-tokens`` tokens and a first question are answered (greedy);
the follow-up prompt is that conversation, the answer and a new question. Its time to first token
(prefill of all but the last id, then the one decode whose logits give the first new token) is
timed with the idle context still holding the first turn ("on") and from an empty context ("off"),
alternating, ``--repeats`` times each (medians). The report also counts, over ``--questions``
follow-ups generated both ways, how many are identical token for token (the default mode is not
bit-exact, ``exact=True`` is). The load average is recorded: on a shared machine the absolute
times move, the on/off ratio much less.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from shared_core.device import cpu_facts
from shared_core.engines.baseline import autoregressive_generate
from shared_core.models import LM, load_lm

FACTS = ("The Hollin Weir was built in 1874 by the engineer Marta Quell to control the river Dast. "
         "It has eleven sluice gates, each named after a month except June. The keeper's cottage, "
         "painted blue, stands on the east bank next to the fish ladder. Gate {i} was rebuilt in "
         "{year} after a flood carried away its oak beams. ")
QUESTIONS = ("How many sluice gates are there?", "What colour is the cottage?",
             "Which gate was rebuilt most recently?", "Who built the weir?")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", default=["smollm2-135m-instruct"])
    parser.add_argument("--context-tokens", type=int, default=1200)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--questions", type=int, default=len(QUESTIONS))
    parser.add_argument("--exact", action="store_true")


def conversation(lm: LM, tokens: int) -> list[dict[str, str]]:
    parts: list[str] = []
    while len(lm.encode("".join(parts))) < tokens:
        parts.append(FACTS.format(i=len(parts) + 1, year=1900 + 7 * len(parts)))
    return [{"role": "system", "content": "Answer from the record.\n" + "".join(parts)},
            {"role": "user", "content": "Summarise the record in one sentence."}]


def ttft(lm: LM, ids: list[int]) -> tuple[float, int]:
    """Seconds to read ``ids`` and get the first new token's logits; prompt ids reused."""
    start = time.perf_counter()
    session = lm.open_session()
    session.prefill(ids[:-1])
    session.extend([ids[-1]])
    return time.perf_counter() - start, session.reused_tokens


def measure(lm: LM, turn_1: list[dict[str, str]], max_new: int, repeats: int) -> dict[str, Any]:
    first = autoregressive_generate(lm, turn_1, max_new)
    kept = [*lm.prompt_ids(turn_1), *first.token_ids[:-1]]  # what the first turn leaves cached
    follow = lm.prompt_ids([*turn_1, {"role": "assistant", "content": first.text},
                            {"role": "user", "content": QUESTIONS[0]}])
    on, off, reused = [], [], 0
    for _ in range(repeats):
        lm.model.clear_prefix_cache()
        lm.open_session().prefill(kept)  # what the first turn leaves in its context
        seconds, reused = ttft(lm, follow)
        on.append(seconds)
        lm.model.clear_prefix_cache()
        off.append(ttft(lm, follow)[0])
    return {"prompt_tokens": len(follow), "reused_tokens": reused,
            "ttft_off_s": round(statistics.median(off), 4), "ttft_on_s": round(statistics.median(on), 4),
            "speedup": round(statistics.median(off) / statistics.median(on), 2)}


def identical(lm: LM, turn_1: list[dict[str, str]], max_new: int, count: int) -> dict[str, Any]:
    """Follow-ups generated with the first turn cached and cold: how many are equal."""
    same = 0
    for question in QUESTIONS[:count]:
        first = autoregressive_generate(lm, turn_1, max_new)
        ids = lm.prompt_ids([*turn_1, {"role": "assistant", "content": first.text},
                             {"role": "user", "content": question}])
        warm = autoregressive_generate(lm, ids, max_new).token_ids
        lm.model.clear_prefix_cache()
        same += warm == autoregressive_generate(lm, ids, max_new).token_ids
    return {"identical": same, "conversations": count}


def run(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for name in args.models:
        lm = load_lm(name, backend="llama.cpp", exact=args.exact)
        turn_1 = conversation(lm, args.context_tokens)
        row = {"model": name, "exact": args.exact, "threads": lm.model.threads,
               **measure(lm, turn_1, args.max_new_tokens, args.repeats),
               **identical(lm, turn_1, args.max_new_tokens, args.questions),
               "load_average": os.getloadavg()}
        rows.append(row)
    return {"benchmark": "chat", "machine": cpu_facts(), "rows": rows}
