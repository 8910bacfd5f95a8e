"""llama.cpp's speed per build, weight format, thread count, polling level and machine load:
``python -m shared_core.bench forward-cost --llamacpp --speed ...``.

Driven through the C API, one context per (threads, poll) setting, all measured round by round
so a change of load hits every setting alike. Per setting: prefill tok/s of ``prefill`` tokens
into an empty cache, then after that prefix a k-token decode (logits for all k) per k, as
milliseconds and as a ratio to the one-token step. ``busy`` runs the same rounds beside a
competing CPU-bound process started here. Perplexity of each format on a fixed text
(:func:`perplexity`) states what a format costs in quality.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import logging
import math
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from shared_core.runtime.llamacpp.lm import llama_cpp_module
from shared_core.runtime.llamacpp.threads import Threadpool, usable_cpus
from shared_core.util.device import cpu_model_and_flags

logger = logging.getLogger(__name__)

DEFAULT_POLL = "default"  # no pool attached: llama.cpp's pool made per decode (poll 50)


@dataclass(frozen=True)
class Setting:
    threads: int
    poll: str  # DEFAULT_POLL or a polling level 0-100 of an attached pool

    @property
    def name(self) -> str:
        return f"t{self.threads}_poll{self.poll}"


class SpeedContext:
    """One context (and its attached pool) of a loaded model."""

    def __init__(self, llama: ModuleType, model: Any, setting: Setting, n_ctx: int):
        params = llama.llama_context_default_params()
        params.n_ctx, params.n_batch, params.n_ubatch = n_ctx, n_ctx, n_ctx
        params.n_threads = params.n_threads_batch = setting.threads
        params.no_perf = True
        self.llama, self.ctx = llama, llama.llama_init_from_model(model, params)
        if not self.ctx:
            msg = f"llama.cpp could not create a context of {n_ctx} positions"
            raise MemoryError(msg)
        self.pool = None
        if setting.poll != DEFAULT_POLL:
            self.pool = Threadpool(llama, setting.threads, int(setting.poll))
            self.pool.attach(self.ctx)
        self.memory = llama.llama_get_memory(self.ctx)
        self.batch = llama.llama_batch_init(n_ctx, 0, 1)

    def decode(self, tokens: Sequence[int], start: int) -> float:
        """Seconds of one decode of ``tokens`` at ``start`` (logits for every token)."""
        batch = self.batch
        batch.n_tokens = len(tokens)
        for i, token in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, start + i, 1
            batch.seq_id[i][0], batch.logits[i] = 0, True
        begin = time.perf_counter()
        if self.llama.llama_decode(self.ctx, batch) != 0:
            msg = f"llama_decode failed ({len(tokens)} tokens at {start})"
            raise RuntimeError(msg)
        return time.perf_counter() - begin

    def rollback(self, length: int) -> None:
        self.llama.llama_memory_seq_rm(self.memory, 0, length, -1)

    def free(self) -> None:
        if self.pool is not None:
            self.pool.detach(self.ctx)
        self.llama.llama_batch_free(self.batch)
        self.llama.llama_free(self.ctx)
        if self.pool is not None:
            self.pool.free()


def load_model(path: Path, *, repack: bool = True) -> Any:
    llama = llama_cpp_module()
    params = llama.llama_model_default_params()
    params.use_extra_bufts = repack
    model = llama.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        msg = f"llama.cpp could not load {path}"
        raise ValueError(msg)
    return model


def measure_settings(path: Path, settings: Sequence[Setting], *, prefill: int = 256,
                     ks: Sequence[int] = (1, 2, 4, 8), rounds: int = 3) -> dict[str, Any]:
    """Median prefill tok/s and k-token decode ms per setting, rounds interleaved."""
    llama = llama_cpp_module()
    model = load_model(path)
    n_vocab = int(llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(model)))
    tokens = [(i * 7919) % (n_vocab - 1000) + 500 for i in range(prefill + max(ks))]
    contexts = {s.name: SpeedContext(llama, model, s, prefill + max(ks) + 16) for s in settings}
    prefill_s: dict[str, list[float]] = {name: [] for name in contexts}
    step_s: dict[str, dict[int, list[float]]] = {name: {k: [] for k in ks} for name in contexts}
    try:
        for context in contexts.values():  # warm-up: first touches of weights and buffers
            context.decode(tokens[:32], 0)
            context.rollback(0)
        for _ in range(rounds):
            for name, context in contexts.items():
                context.rollback(0)
                prefill_s[name].append(context.decode(tokens[:prefill], 0))
                for k in ks:
                    step_s[name][k].append(context.decode(tokens[prefill:prefill + k], prefill))
                    context.rollback(prefill)
    finally:
        for context in contexts.values():
            context.free()
        llama.llama_model_free(model)
    return {name: _summary(prefill, prefill_s[name], step_s[name]) for name in contexts}


def _summary(prefill: int, prefill_s: list[float], steps: dict[int, list[float]]) -> dict[str, Any]:
    ms = {k: round(1000 * statistics.median(v), 2) for k, v in steps.items()}
    first = ms[min(ms)]
    return {"prefill_tok_s": round(prefill / statistics.median(prefill_s), 1),
            "prefill_tok_s_all": [round(prefill / s, 1) for s in prefill_s],
            "ms": ms, "ratio": {k: round(v / first, 2) for k, v in ms.items()}}


def perplexity(path: Path, text: str, *, chunk: int = 256, max_chunks: int = 8,
               threads: int = 1) -> dict[str, Any]:
    """Perplexity of ``text`` under the GGUF at ``path``: chunks of ``chunk`` tokens, each scored
    from its own start, the second half of each chunk counted (llama.cpp's perplexity tool
    does the same), at most ``max_chunks`` chunks."""
    llama = llama_cpp_module()
    model = load_model(path)
    vocab = llama.llama_model_get_vocab(model)
    data = text.encode()
    buf = (ctypes.c_int32 * (len(data) + 8))()
    n = llama.llama_tokenize(vocab, data, len(data), buf, len(buf), False, False)
    ids = list(buf[:n])
    n_vocab = int(llama.llama_vocab_n_tokens(vocab))
    context = SpeedContext(llama, model, Setting(threads, DEFAULT_POLL), chunk)
    nll, count = 0.0, 0
    try:
        for start in range(0, min(len(ids) - chunk, chunk * max_chunks) + 1, chunk):
            piece = ids[start:start + chunk]
            if len(piece) < chunk:
                break
            context.rollback(0)
            context.decode(piece, 0)
            for i in range(chunk // 2, chunk - 1):
                nll -= _log_softmax_at(llama.llama_get_logits_ith(context.ctx, i), n_vocab,
                                       piece[i + 1])
                count += 1
    finally:
        context.free()
        llama.llama_model_free(model)
    return {"perplexity": round(math.exp(nll / count), 4), "tokens_scored": count,
            "chunk": chunk}


def _log_softmax_at(row: Any, n_vocab: int, target: int) -> float:
    import numpy as np

    values = np.ctypeslib.as_array(row, shape=(n_vocab,)).astype(np.float64)
    top = values.max()
    return float(values[target] - top - math.log(np.exp(values - top).sum()))


@contextlib.contextmanager
def competing_process(busy: bool) -> Iterator[int | None]:
    """A CPU-bound Python loop beside the measurement while the block runs (None: none)."""
    if not busy:
        yield None
        return
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def speed_report(args: argparse.Namespace) -> dict[str, Any]:
    """Per model and format: perplexity, then every (threads, poll) setting measured quiet and
    beside a busy process (``args`` from ``forward-cost --llamacpp --speed``)."""
    from shared_core.runtime.llamacpp.builds import build_facts
    from shared_core.runtime.weights.sources import resolve_lm_source

    llama = llama_cpp_module()
    settings = [Setting(t, p) for t in args.llamacpp_threads for p in args.polls]
    text = squad_text()
    cpu, flags = cpu_model_and_flags()
    report: dict[str, Any] = {"build": build_facts(llama), "cpu": cpu, "cpu_flags": sorted(flags),
                              "cpus_usable": usable_cpus(), "prefill": args.prefill,
                              "ks": args.ks, "rounds": args.rounds, "models": {}}
    for name in args.models:
        source = resolve_lm_source(name).gguf
        if source is None:
            continue
        report["models"][name] = {}
        for fmt in args.formats:
            report["models"][name][fmt] = _format_report(llama, source, fmt, settings, text, args)
            _keep_partial(report, getattr(args, "out", None))
    return report


def _keep_partial(report: dict[str, Any], out: str | None) -> None:
    """The formats measured so far beside ``out`` (a run stopped at its time limit keeps them)."""
    import json

    if out:
        Path(f"{out}.partial").write_text(json.dumps(report, indent=1, default=str))


def _format_report(llama: ModuleType, source: Path, fmt: str, settings: list[Setting], text: str,
                   args: argparse.Namespace) -> dict[str, Any]:
    from shared_core.runtime.llamacpp.formats import repacked_gguf

    path = source if fmt == "shipped" else repacked_gguf(llama, source, fmt)
    out: dict[str, Any] = {"file": path.name, "bytes": path.stat().st_size}
    if args.perplexity_chunks:
        out["quality"] = perplexity(path, text, max_chunks=args.perplexity_chunks)
    if getattr(args, "accuracy_questions", 0):
        out["task"] = nq_accuracy(path, args.accuracy_questions)
    for load in args.loads:
        with competing_process(load == "busy") as pid:
            before = loadavg()
            table = measure_settings(path, settings, prefill=args.prefill, ks=args.ks,
                                     rounds=args.rounds)
            out[load] = {"loadavg_before": before, "loadavg_after": loadavg(),
                         "competitor_pid": pid, "settings": table}
        logger.info("%s %s %s: %s", source.name, fmt, load,
                    {k: (v["prefill_tok_s"], v["ms"]) for k, v in table.items()})
    return out


def squad_text(passages: int = 40) -> str:
    """A fixed text for perplexity: the first SQuAD (ExpMRC) passages of the evaluation data."""
    import json

    from shared_core.bench.common import data_dir

    with (data_dir() / "squad_expmrc" / "corpus.jsonl").open() as f:
        rows = [json.loads(line) for _, line in zip(range(passages), f, strict=False)]
    return "\n\n".join(row["text"] for row in rows)


def nq_accuracy(path: Path, questions: int, *, threads: int = 1,
                max_new_tokens: int = 32) -> dict[str, Any]:
    """Share of the first ``questions`` NQ-open questions (with their gold passage) whose greedy
    answer contains a gold answer (normalized), and the answers themselves (to count flips)."""
    llama = llama_cpp_module()
    model = load_model(path)
    vocab = llama.llama_model_get_vocab(model)
    context = SpeedContext(llama, model, Setting(threads, DEFAULT_POLL), 1024)
    answers: list[str] = []
    correct = 0
    try:
        for row in nq_rows(questions):
            text = _greedy(llama, context, vocab, _qa_prompt(row), max_new_tokens)
            answers.append(text)
            correct += any(_norm(a) and _norm(a) in _norm(text) for a in row["answers"])
    finally:
        context.free()
        llama.llama_model_free(model)
    return {"questions": len(answers), "accuracy": round(100 * correct / max(1, len(answers)), 1),
            "answers": answers}


def nq_rows(questions: int) -> list[dict[str, Any]]:
    import json

    from shared_core.bench.common import data_dir

    folder = data_dir() / "nq_open_oracle"
    with (folder / "corpus.jsonl").open() as f:
        passages = {p["pid"]: p for p in map(json.loads, f)}
    with (folder / "questions.jsonl").open() as f:
        rows = [json.loads(line) for _, line in zip(range(questions), f, strict=False)]
    for row in rows:
        row["passage"] = passages[row["gold_pids"][0]]
    return rows


def _qa_prompt(row: dict[str, Any]) -> str:
    passage = row["passage"]  # ChatML: the chat format of both embedded models (SmolLM2, Qwen2.5)
    return (f"<|im_start|>user\nAnswer the question with a few words from the passage.\n\n"
            f"Passage ({passage['title']}): {passage['text']}\n\nQuestion: {row['question']}?"
            "<|im_end|>\n<|im_start|>assistant\n")


def _greedy(llama: ModuleType, context: SpeedContext, vocab: Any, prompt: str, max_new: int) -> str:
    import numpy as np

    data = prompt.encode()
    buf = (ctypes.c_int32 * (len(data) + 8))()
    n = llama.llama_tokenize(vocab, data, len(data), buf, len(buf), False, True)
    ids = list(buf[:min(n, 1024 - max_new)])
    n_vocab = int(llama.llama_vocab_n_tokens(vocab))
    context.rollback(0)
    context.decode(ids, 0)
    last, pieces = len(ids) - 1, []
    for step in range(max_new):
        row = np.ctypeslib.as_array(llama.llama_get_logits_ith(context.ctx, last), shape=(n_vocab,))
        token = int(row.argmax())
        if llama.llama_vocab_is_eog(vocab, token):
            break
        piece = ctypes.create_string_buffer(64)
        size = llama.llama_token_to_piece(vocab, token, piece, len(piece), 0, False)
        pieces.append(piece.raw[:max(size, 0)])
        if b"\n" in pieces[-1] and b"".join(pieces).strip():  # the first line of the answer
            break
        context.decode([token], len(ids) + step)
        last = 0
    return b"".join(pieces).decode("utf-8", "replace").strip().split("\n")[0].strip()


def _norm(text: str) -> str:
    import re
    import string

    text = "".join(c for c in text.lower() if c not in string.punctuation)
    return " ".join(w for w in text.split() if w not in ("a", "an", "the")) if re.search(r"\w", text) else ""
