"""LoRA instruction tuning of the Speculative RAG drafter (the paper's "specialist RAG drafter").

Recipe (reproducible, CPU, well under an hour)::

    python -m shared_core.tools.train_drafter --examples 400 --epochs 1 \\
        --out shared_core/runtime/weights/lora_adapters/smollm2-135m-instruct-specrag

Training pairs are (question, documents) -> (rationale, answer), formatted exactly as the engine's
draft prompt (:func:`shared_core.engines.speculative_rag.draft_prompt`, prefilled with
``Rationale:``), with the loss on the target tokens only:

* **SQuAD** (``squad_expmrc``): questions of the six articles NOT in
  :data:`shared_core.config.data_splits.SQUAD_EVAL_TITLES`; rationale = the human evidence sentence,
  answer = the first gold answer; documents = the question's paragraph plus one distractor
  paragraph of the same training articles.
* **NQ** (``nq_open_oracle``): rows from :data:`shared_core.config.data_splits.NQ_EVAL_ROWS` on whose
  gold passages are not gold passages of any evaluation row; rationale = the gold-passage sentence
  containing the answer, answer = that answer string; documents = the gold passage plus one random
  distractor passage.

The split is by question id / article title and is written to ``split.json`` next to the adapter;
the benchmark never evaluates on those questions. ``load_tuned_drafter("smollm2-135m-instruct+specrag")``
(:mod:`shared_core.drafters.lora`, re-exported here) loads the base model, applies the shipped
adapter and merges it.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shared_core.config import DEFAULT_LM
from shared_core.config.data_splits import NQ_EVAL_ROWS, SQUAD_EVAL_TITLES
from shared_core.drafters.lora import ADAPTER_ROOT, ADAPTERS, TUNED_DRAFT_ORDER, load_tuned_drafter
from shared_core.retrieval.base import Document

if TYPE_CHECKING:
    import torch

    from shared_core.runtime.models import LM

logger = logging.getLogger(__name__)

__all__ = ["ADAPTERS", "ADAPTER_ROOT", "TrainDrafterConfig", "build_examples", "encode_example",
           "load_tuned_drafter", "main", "nq_examples", "squad_examples", "train", "train_lora"]


@dataclass(frozen=True)
class TrainDrafterConfig:
    """The recipe's defaults, written once (``train_lora`` and the command line read them)."""

    examples: int = 400  # training pairs, half SQuAD half NQ
    epochs: int = 1
    batch_size: int = 4
    lr: float = 3e-4
    rank: int = 8  # LoRA rank (alpha = 2 * rank)
    max_len: int = 512  # tokens per example (prompt + target, cut from the left)
    seed: int = 0


# --------------------------------------------------------------------------- data


def _sentence_with(text: str, answer: str) -> str | None:
    for sentence in re.split(r"(?<=[.!?])\s+", text):
        if answer.lower() in sentence.lower():
            return sentence.strip()
    return None


def squad_examples(root: Path, rng: random.Random) -> list[dict[str, Any]]:
    from shared_core.bench.common import read_jsonl

    corpus = {r["pid"]: r for r in read_jsonl(root / "squad_expmrc" / "corpus.jsonl")}
    train = [r for r in read_jsonl(root / "squad_expmrc" / "questions.jsonl")
             if r["title"] not in SQUAD_EVAL_TITLES and r["evidences"]]
    pids = sorted({r["pid"] for r in train})
    out = []
    for r in train:
        distractor = corpus[rng.choice([p for p in pids if p != r["pid"]])]
        docs = [corpus[r["pid"]], distractor]
        rng.shuffle(docs)
        out.append({"id": r["id"], "question": r["question"], "answer": r["answers"][0],
                    "rationale": r["evidences"][0],
                    "docs": [Document(d["pid"], d["title"].replace("_", " ") + ": " + d["text"])
                             for d in docs]})
    return out


def nq_examples(root: Path, rng: random.Random) -> list[dict[str, Any]]:
    from shared_core.bench.common import read_jsonl

    corpus = {r["pid"]: r for r in read_jsonl(root / "nq_open_oracle" / "corpus.jsonl")}
    rows = read_jsonl(root / "nq_open_oracle" / "questions.jsonl")
    eval_pids = {p for r in rows[:NQ_EVAL_ROWS] for p in r["gold_pids"]}
    all_pids = sorted(corpus)
    out = []
    for r in rows[NQ_EVAL_ROWS:]:
        if set(r["gold_pids"]) & eval_pids:
            continue
        gold = corpus[r["gold_pids"][0]]
        found = [(a, s) for a in r["answers"] if (s := _sentence_with(gold["text"], a))]
        if not found:
            continue
        answer, sentence = found[0]
        docs = [gold, corpus[rng.choice([p for p in all_pids if p not in eval_pids])]]
        rng.shuffle(docs)
        out.append({"id": r["qid"], "question": r["question"], "answer": answer,
                    "rationale": sentence,
                    "docs": [Document(d["pid"], f"{d['title']}: {d['text']}") for d in docs]})
    return out


def build_examples(root: Path, n: int, seed: int) -> list[dict[str, Any]]:
    """n training examples, half SQuAD half NQ (as available), shuffled with ``seed``."""
    rng = random.Random(seed)
    squad, nq = squad_examples(root, rng), nq_examples(root, rng)
    rng.shuffle(squad)
    rng.shuffle(nq)
    half = min(n // 2, len(squad))
    examples = squad[:half] + nq[: n - half]
    rng.shuffle(examples)
    return examples


def encode_example(lm: LM, ex: dict[str, Any], max_len: int) -> tuple[list[int], list[int]]:
    """(input ids, labels) with the loss on the drafted target only."""
    from shared_core.engines.speculative_rag import draft_prompt

    prompt = draft_prompt(lm, ex["question"], ex["docs"], TUNED_DRAFT_ORDER)
    target = lm.encode(f" {ex['rationale']}\nAnswer: {ex['answer']}\n")
    ids = (prompt + target)[-max_len:]
    labels = ([-100] * len(prompt) + target)[-max_len:]
    return ids, labels


# --------------------------------------------------------------------------- training


def train_lora(lm: LM, encoded: list[tuple[list[int], list[int]]], *,
               epochs: int = TrainDrafterConfig.epochs,
               batch_size: int = TrainDrafterConfig.batch_size, lr: float = TrainDrafterConfig.lr,
               rank: int = TrainDrafterConfig.rank, seed: int = TrainDrafterConfig.seed
               ) -> tuple[Any, list[float]]:
    """LoRA (q/k/v/o projections) over pre-encoded examples; returns (peft model, losses)."""
    import torch
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, lora_dropout=0.05,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM")
    model = get_peft_model(lm.model, lora)
    model.train()
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    steps = epochs * ((len(encoded) + batch_size - 1) // batch_size)
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1 - s / max(1, steps))
    start, losses, order = time.perf_counter(), [], list(encoded)
    # grad mode is thread state a caller may have left off (a generator suspended inside
    # inference_mode does): training turns it on for itself
    with torch.enable_grad():
        for epoch in range(epochs):
            random.Random(seed + epoch).shuffle(order)
            for i in range(0, len(order), batch_size):
                loss = _step(model, order[i:i + batch_size], lm.tokenizer.pad_token_id or 0)
                loss.backward()
                optim.step()
                sched.step()
                optim.zero_grad()
                losses.append(float(loss.detach()))
                if len(losses) % 10 == 0:
                    logger.info("step %d/%d loss %.3f (%.0f s)", len(losses), steps,
                                sum(losses[-10:]) / 10, time.perf_counter() - start)
    model.eval()
    return model, losses


def train(args: argparse.Namespace) -> dict[str, Any]:
    """The recipe: build the split, encode, LoRA-tune, save adapter + ``split.json``."""
    from shared_core.bench.common import data_dir
    from shared_core.runtime.models import load_lm

    root = args.data_dir or data_dir()
    lm = load_lm(args.base)
    examples = build_examples(root, args.examples, args.seed)
    encoded = [encode_example(lm, ex, args.max_len) for ex in examples]
    start = time.perf_counter()
    model, losses = train_lora(lm, encoded, epochs=args.epochs, batch_size=args.batch_size,
                               lr=args.lr, rank=args.rank, seed=args.seed)
    out = Path(args.out)
    model.save_pretrained(out)
    info = {"base": args.base, "examples": len(encoded), "steps": len(losses),
            "epochs": args.epochs, "rank": args.rank, "lr": args.lr, "seed": args.seed,
            "train_s": time.perf_counter() - start,
            "final_loss": sum(losses[-10:]) / max(1, len(losses[-10:])),
            "train_ids": sorted(ex["id"] for ex in examples)}
    (out / "split.json").write_text(json.dumps(info, indent=1))
    logger.info("saved adapter to %s after %.0f s", out, info["train_s"])
    return info


def _step(model: torch.nn.Module, batch: list[tuple[list[int], list[int]]], pad_id: int
          ) -> torch.Tensor:
    import torch

    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, (x, y) in enumerate(batch):  # right padding
        ids[row, :len(x)] = torch.tensor(x)
        labels[row, :len(y)] = torch.tensor(y)
        mask[row, :len(x)] = 1
    loss: torch.Tensor = model(input_ids=ids, attention_mask=mask, labels=labels).loss
    return loss


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="LoRA-tune the Speculative RAG drafter")
    recipe = TrainDrafterConfig()
    parser.add_argument("--base", default=DEFAULT_LM)
    parser.add_argument("--examples", type=int, default=recipe.examples)
    parser.add_argument("--epochs", type=int, default=recipe.epochs)
    parser.add_argument("--batch-size", type=int, default=recipe.batch_size)
    parser.add_argument("--lr", type=float, default=recipe.lr)
    parser.add_argument("--rank", type=int, default=recipe.rank)
    parser.add_argument("--max-len", type=int, default=recipe.max_len)
    parser.add_argument("--seed", type=int, default=recipe.seed)
    parser.add_argument("--data-dir", type=Path, default=None)
    parser.add_argument("--out", default=str(ADAPTERS["smollm2-135m-instruct+specrag"][1]))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    train(args)


if __name__ == "__main__":
    main()
