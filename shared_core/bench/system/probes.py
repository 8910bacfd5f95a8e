"""Micro-probes behind measurements quoted in ``results/`` (``python -m shared_core.bench probe-*``).

* ``probe-dtype``: fp32 vs bf16 cost of prompt processing (one decoder forward over
  ``--prompt-tokens`` random ids, no LM head, best of 3) and of one-token decode steps after a
  ``--prefill``-token prefill, for each model in ``--models`` (``results/system/2026-11-22/dtype.json``).
* ``probe-contention``: does a batched exact search over ``--vectors`` random vectors slow down LM
  decoding when both run at once on two threads, and vice versa (RaLMSpec's asynchronous
  verification on a 2-core CPU; ``results/system/2026-11-22/contention4m.json``,
  ``results/ralmspec/2026-11-22/contention.json``).
* ``probe-verify``: cost of one-token steps and of multi-token verification forwards at long
  context, on a prefilled session and on one built by ``copy_positions`` (RAPID's shared
  drafter), plus a torch profile of the verification forwards (``results/rapid/2026-11-22/s5_*``).

Each reports JSON on stdout (and ``--out``); every timing goes through
:func:`shared_core.bench.common.mean_ms`.
"""

from __future__ import annotations

import argparse
import os
import threading
from typing import TYPE_CHECKING, Any

from shared_core.bench.common import mean_ms
from shared_core.config import DEFAULT_LM, DEFAULT_VERIFIER
from shared_core.runtime.models import LM, load_lm

if TYPE_CHECKING:
    from shared_core.runtime.torch.session import KVSession

DEFAULT_MODEL = DEFAULT_LM


def _threads(args: argparse.Namespace, default: int) -> int:
    import torch

    torch.set_num_threads(args.threads or default)
    return torch.get_num_threads()


def _random_ids(lm: LM, n: int, seed: int = 0) -> list[int]:
    """``n`` random ids from the middle of the vocabulary (no special tokens)."""
    import torch

    vocab = len(lm.tokenizer)
    low, high = min(1000, vocab // 3), min(20000, vocab)
    return torch.randint(low, high, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _session(lm: LM, ids: list[int]) -> Any:
    from shared_core.runtime.torch.session import KVSession

    session = KVSession(lm)
    session.prefill(ids)
    return session


def _forward_ms(session: KVSession, tokens: list[int], repeats: int, warmup: int = 3) -> float:
    """Mean ms of one forward of ``tokens`` on ``session``, rolled back after each."""

    def forward() -> None:
        session.extend(tokens)
        session.rollback(len(session) - len(tokens))

    return mean_ms(forward, repeats, device=session.lm.device, warmup=warmup)


# ----------------------------------------------------------------------------- probe-dtype


def add_dtype_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default=f"{DEFAULT_MODEL},{DEFAULT_VERIFIER}",
                        help="comma-separated model aliases or paths")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--prompt-tokens", type=int, default=1200)
    parser.add_argument("--prefill", type=int, default=600, help="context before decode steps")
    parser.add_argument("--decode-steps", type=int, default=32)


def _prompt_s(lm: LM, ids: list[int]) -> float:
    """Best of 3 decoder forwards over ``ids`` (no LM head), after a short warm-up."""
    import torch

    decoder = lm.model.get_decoder()
    batch = torch.tensor([ids], device=lm.device)
    with torch.inference_mode():
        decoder(input_ids=batch[:, :64])
        return min(mean_ms(lambda: decoder(input_ids=batch), 1, device=lm.device)
                   for _ in range(3)) / 1000


def _decode_ms(lm: LM, ids: list[int], prefill: int, steps: int) -> float:
    """Mean ms of one-token steps fed ``ids[prefill:]`` after prefilling ``ids[:prefill]``."""
    session = _session(lm, ids[:prefill])
    tokens = iter(ids[prefill:])
    return mean_ms(lambda: session.extend([next(tokens)]), steps, device=lm.device)


def run_dtype(args: argparse.Namespace) -> dict[str, Any]:
    threads = _threads(args, 2)
    report: dict[str, Any] = {"probe": "dtype", "threads": threads,
                              "load_average_start": os.getloadavg(), "models": {}}
    for name in args.models.split(","):
        for dtype in args.dtypes.split(","):
            lm = load_lm(name, dtype=dtype)
            ids = _random_ids(lm, max(args.prompt_tokens, args.prefill + args.decode_steps))
            report["models"][f"{name}/{dtype}"] = {
                f"prompt_{args.prompt_tokens}_tokens_s":
                    round(_prompt_s(lm, ids[: args.prompt_tokens]), 3),
                f"decode_ms_per_token_at_{args.prefill}":
                    round(_decode_ms(lm, ids, args.prefill, args.decode_steps), 1)}
            del lm
    report["load_average_end"] = os.getloadavg()
    return report


# ----------------------------------------------------------------------------- probe-contention


def add_contention_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default=None, help="LM dtype (default: the device default)")
    parser.add_argument("--context", type=int, default=1200, help="tokens in the LM's context")
    parser.add_argument("--vectors", type=int, default=4_000_000)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--queries", type=int, default=3)
    parser.add_argument("--search", choices=("blocked", "gemm"), default="blocked",
                        help="blocked: retrieval.dense.blocked_top (top-k); gemm: one numpy "
                             "matrix product + argmax")
    parser.add_argument("--k", type=int, default=28, help="neighbours for --search blocked")
    parser.add_argument("--decode-steps", type=int, default=40)
    parser.add_argument("--search-repeats", type=int, default=5)


def _search_fn(args: argparse.Namespace) -> Any:
    import numpy as np

    rng = np.random.default_rng(0)
    stored = rng.standard_normal((args.vectors, args.dim), dtype=np.float32)
    queries = rng.standard_normal((args.queries, args.dim), dtype=np.float32)
    if args.search == "gemm":
        return lambda: (stored @ queries.T).argmax(0)
    from shared_core.retrieval.dense import blocked_top

    return lambda: blocked_top(queries, stored, args.k)


def run_contention(args: argparse.Namespace) -> dict[str, Any]:
    threads = _threads(args, 1)
    lm = load_lm(args.model, dtype=args.dtype)
    session = _session(lm, _random_ids(lm, args.context))
    step = _random_ids(lm, 1, seed=1)
    search = _search_fn(args)

    def decode_ms() -> float:
        return _forward_ms(session, step, args.decode_steps, warmup=0)

    def search_ms() -> float:
        return mean_ms(search, args.search_repeats)

    _forward_ms(session, step, 4, warmup=0), mean_ms(search, 1)  # warm-up
    alone = {"decode_ms": decode_ms(), "search_ms": search_ms()}
    together: dict[str, float] = {}
    worker = threading.Thread(target=lambda: together.update(search_ms=search_ms()))
    worker.start()
    together["decode_ms"] = decode_ms()
    worker.join()
    return {"probe": "contention", "threads": threads, "model": lm.name, "dtype": str(lm.dtype),
            "context": args.context, "search": args.search,
            "vectors": [args.vectors, args.dim], "queries": args.queries,
            "alone": alone, "concurrent": together}


# ----------------------------------------------------------------------------- probe-verify


def add_verify_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--context", type=int, default=7900, help="target session length")
    parser.add_argument("--shared-context", type=int, default=2100,
                        help="drafter session length (prefilled, and via copy_positions)")
    parser.add_argument("--head", type=int, default=100,
                        help="copy_positions keeps the first --head target positions ...")
    parser.add_argument("--span-start", type=int, default=3000,
                        help="... and a span from here up to --shared-context positions")
    parser.add_argument("--tokens", default="2,4,9", help="verification forward sizes")
    parser.add_argument("--step-repeats", type=int, default=24)
    parser.add_argument("--verify-repeats", type=int, default=8)
    parser.add_argument("--no-profile", action="store_true", help="skip the torch profile")


def _profile_table(session: KVSession, tokens: list[int]) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(4):
            session.extend(tokens)
            session.rollback(len(session) - len(tokens))
    return str(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12))


def _shared_positions(args: argparse.Namespace) -> list[int]:
    """The target positions the ``copy_positions`` session keeps: a head and one span."""
    end = args.span_start + args.shared_context - args.head
    if not (0 <= args.head <= args.span_start and args.shared_context <= end <= args.context):
        msg = (f"--head {args.head}, --span-start {args.span_start} and --shared-context "
               f"{args.shared_context} must select positions inside --context {args.context}")
        raise ValueError(msg)
    return [*range(args.head), *range(args.span_start, end)]


def run_verify(args: argparse.Namespace) -> dict[str, Any]:
    positions = _shared_positions(args)
    sizes = [int(n) for n in args.tokens.split(",")]
    threads = _threads(args, 2)
    lm = load_lm(args.model, dtype=args.dtype)
    ids = _random_ids(lm, args.context)
    target = _session(lm, ids)
    plain = _session(lm, ids[: args.shared_context])
    shared = _session(lm, [])
    shared.copy_positions(target, positions)
    step = ids[:1]
    report: dict[str, Any] = {
        "probe": "verify", "threads": threads, "model": lm.name, "dtype": str(lm.dtype),
        "attention": lm.model.config._attn_implementation,
        f"step_ms_target_{args.context}": _forward_ms(target, step, args.step_repeats),
        f"step_ms_prefilled_{args.shared_context}": _forward_ms(plain, step, args.step_repeats),
        f"step_ms_copy_positions_{args.shared_context}": _forward_ms(shared, step,
                                                                     args.step_repeats)}
    for n in sizes:
        report[f"verify_{n}_ms_at_{args.context}"] = _forward_ms(target, ids[:n],
                                                                 args.verify_repeats)
    if not args.no_profile:
        report["profile"] = _profile_table(target, ids[: max(sizes)])
    return report
