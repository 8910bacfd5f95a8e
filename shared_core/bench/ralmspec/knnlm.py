"""``python -m shared_core.bench ralmspec --suite knnlm``: KNN-LM serving, retrieval at every
token vs RaLMSpec's speculation (:mod:`shared_core.engines.knnlm`), per neighbour count k.

The datastore is built from the ``nq_open_oracle`` corpus with the LM itself (cached as ``.npz``
under ``--cache-dir``), optionally padded with random far-away keys to mimic a large store. Both
methods run in the same process on the same NQ-open questions after a warm-up question, and
RaLMSpec's tokens are compared with the baseline's.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import replace
from typing import Any

import numpy as np

from shared_core.bench.common import MethodResult, data_dir, make_report, read_jsonl, timed_loop
from shared_core.engines.knnlm import KNNDatastore, KNNLMConfig, knnlm_generate
from shared_core.runtime.models import LM, load_lm

_METHODS = (("baseline", False), ("RaLMSpec", True))


def load_datastore(lm: LM, corpus: list[str], tokens: int, cache_dir: str) -> KNNDatastore:
    """The datastore over the first ``tokens`` corpus tokens, built once and cached on disk."""
    path = os.path.join(cache_dir, f"knnlm-{tokens}.npz")
    if os.path.exists(path):
        saved = np.load(path)
        return KNNDatastore(saved["keys"], saved["values"])
    store = KNNDatastore.build(lm, corpus, max_tokens=tokens)
    os.makedirs(cache_dir, exist_ok=True)
    np.savez(path, keys=store.keys, values=store.values)
    return store


def config_knobs(args: argparse.Namespace) -> dict[str, Any]:
    """KNNLMConfig overrides from the command line (fixed stride turns OS³ off)."""
    fixed = getattr(args, "knn_fixed_stride", 0)
    knobs: dict[str, Any] = {"scheduler": not fixed,
                             "speculation_stride": fixed or KNNLMConfig().speculation_stride}
    if getattr(args, "knn_gamma_max", None) is not None:
        knobs["gamma_max"] = args.knn_gamma_max
    return knobs


def measure(lm: LM, store: KNNDatastore, prompts: list[Any], max_new_tokens: int,
            config: KNNLMConfig, speculative: bool) -> MethodResult:
    """One method over ``prompts[1:]`` after a warm-up on ``prompts[0]``."""

    def generate(prompt: Any) -> Any:
        return knnlm_generate(lm, store, prompt, max_new_tokens, config=config,
                              speculative=speculative)

    generate(prompts[0])
    load = [round(os.getloadavg()[0], 2)]
    outs, wall = timed_loop(prompts[1:], generate, lm.device, "knnlm", progress=False)
    load.append(round(os.getloadavg()[0], 2))
    stats = {"retrieval_s": sum(o.stats.retrieval_s for o in outs),
             "retrieval_calls": sum(o.stats.retrieval_calls for o in outs),
             "drafted": sum(o.stats.drafted for o in outs),
             "accepted": sum(o.stats.accepted for o in outs),
             "load_avg_1m": load, "gamma_max": config.gamma_max, "scheduler": config.scheduler,
             "speculation_stride": config.speculation_stride}
    return MethodResult(wall_s=wall, new_tokens=sum(len(o.token_ids) for o in outs),
                        outputs=[o.token_ids for o in outs], stats=stats)


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    """Speed-up of RaLMSpec over the baseline per k in ``--knn-k``; identical tokens checked."""
    lm = load_lm(args.model, dtype=args.dtype)
    folder = data_dir() / "nq_open_oracle"
    corpus = [f"{r['title']}: {r['text']}" for r in read_jsonl(folder / "corpus.jsonl")]
    store = load_datastore(lm, corpus, args.knn_datastore_tokens, args.cache_dir)
    real = len(store)
    if args.knn_pad:
        store.add_padding(args.knn_pad)
    rows = read_jsonl(folder / "questions.jsonl", limit=args.limit + 1)
    prompts = [[{"role": "user", "content": r["question"]}] for r in rows]
    methods: dict[str, MethodResult] = {}
    speedup: dict[str, float] = {}
    for k in (int(x) for x in args.knn_k.split(",")):
        config = replace(KNNLMConfig(), k=k, **config_knobs(args))
        for name, speculative in _METHODS:
            methods[f"k={k}/{name}"] = measure(lm, store, prompts, args.max_new_tokens, config,
                                               speculative)
        speedup[f"k={k}/RaLMSpec"] = round(methods[f"k={k}/baseline"].wall_s
                                           / methods[f"k={k}/RaLMSpec"].wall_s, 3)
    report = make_report(
        engine="ralmspec-knnlm", dataset="nq_open_oracle", device=str(lm.device),
        models={"lm": lm.name}, methods=methods, primary_baseline=next(iter(methods)),
        identical_to={m: [m.replace("RaLMSpec", "baseline")] for m in methods
                      if m.endswith("RaLMSpec")},
        extra={"datastore": {"real_entries": real, "padding_entries": len(store) - real,
                             "dim": int(store.keys.shape[1]),
                             "search": "exact squared L2: blocked PyTorch GEMM candidates "
                                       "(k + margin), re-ranked in float64"}})
    report["speedup"] = speedup
    return report
