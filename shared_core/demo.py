"""`specrag demo`: the project's job in miniature, on the embedded offline models.

It indexes a small knowledge base written here (a fictional town, so the answers must come from
retrieval), retrieves for a few questions, answers with plain decoding and with every available
speculative engine, and reports each engine's measured speed-up and whether its tokens equal
plain greedy decoding.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

KNOWLEDGE_BASE = {
    "harbor": "Veldmark is a small harbor town on the northern coast. Its harbor was built in 1712 "
              "by the shipwright Anna Kessel, and it still shelters the town's fishing fleet of "
              "forty-two boats.",
    "festival": "Every August, Veldmark holds the Lantern Festival. Residents float paper lanterns "
                "on the harbor to honor the fishermen lost at sea, and the festival ends with a "
                "concert on the pier.",
    "library": "The Veldmark Public Library opened in 1903. It holds about 60,000 books and a "
               "collection of maritime maps drawn by the cartographer Lena Brandt.",
    "bridge": "The Iron Bridge connects Veldmark to the island of Osterholm. It is 840 meters "
              "long, opened in 1968, and carries both cars and a single railway track.",
    "school": "The Veldmark Maritime School trains navigators and marine engineers. It was "
              "founded in 1921 and admits about 300 students each year.",
    "mayor": "The current mayor of Veldmark is Tomas Ruud, elected in 2022. Before politics he "
             "ran the town's largest ferry company for eleven years.",
    "climate": "Veldmark has a cool maritime climate. Summers average 17 degrees Celsius and "
               "winter storms often close the Iron Bridge for a day or two.",
    "museum": "The Harbor Museum displays the wreck of the schooner Margit, which sank in 1834 "
              "near Osterholm and was raised by divers in 1991.",
    "market": "A fish market is held on the harbor square every Saturday morning. Herring, cod "
              "and smoked eel are the best-selling products.",
    "railway": "The coastal railway reached Veldmark in 1889. Trains to the capital leave every "
               "two hours and the journey takes three and a half hours.",
}

QUESTIONS = [
    "Who built the harbor of Veldmark, and in which year?",
    "How long is the Iron Bridge and when did it open?",
]


@dataclass
class Answer:
    engine: str
    text: str
    token_ids: list[int]
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.seconds if self.seconds else 0.0


def build_prompt(question: str, passages: list[str]) -> list[dict[str, str]]:
    context = "\n".join(f"- {p}" for p in passages)
    return [{"role": "system", "content": "Answer using only the context. Quote it where you can."},
            {"role": "user", "content": f"Context:\n{context}\n\nQuestion: {question}"}]


def _engines(max_new_tokens: int) -> dict[str, Callable]:
    from shared_core.drafters.prompt_lookup import PromptLookupDrafter
    from shared_core.engines.baseline import autoregressive_generate, speculative_generate
    from shared_core.engines.registry import TOKEN_ENGINES, engine_function, stream_engine

    engines: dict[str, Callable] = {
        "autoregressive": lambda lm, msgs, docs: autoregressive_generate(lm, msgs, max_new_tokens),
        "prompt_lookup": lambda lm, msgs, docs: speculative_generate(
            lm, PromptLookupDrafter(), msgs, max_new_tokens),
    }
    for name in TOKEN_ENGINES:
        if name == "autoregressive":
            continue
        try:
            engine_function(name)
        except (ImportError, AttributeError) as e:
            logger.info("engine %s not available in this build: %s", name, e)
            continue
        engines[name] = (lambda n: lambda lm, msgs, docs: stream_engine(
            n, lm, msgs, max_new_tokens=max_new_tokens, documents=docs).run())(name)
    return engines


def run_demo(max_new_tokens: int = 64, write: Callable[[str], None] = logger.info) -> dict:
    """Index, retrieve, answer with each engine; return the measured table."""
    from shared_core.models import load_lm
    from shared_core.retrieval import DenseRetriever, Document

    lm = load_lm("smollm2-135m-instruct")
    retriever = DenseRetriever("all-minilm-l6-v2")
    retriever.add([Document(key, text) for key, text in KNOWLEDGE_BASE.items()])
    engines = _engines(max_new_tokens)
    table: dict[str, dict[str, float]] = {name: {"seconds": 0.0, "tokens": 0, "identical": 0}
                                          for name in engines}
    for engine in engines.values():  # warm-up, so the first timed call pays no one-off costs
        engine(lm, [{"role": "user", "content": "Where is Veldmark?"}], [KNOWLEDGE_BASE["harbor"]])
    for question in QUESTIONS:
        passages = [hit.document.text for hit in retriever.search([question], 3)[0]]
        messages = build_prompt(question, passages)
        write(f"\nQ: {question}\n   retrieved: {[p[:40] + '...' for p in passages]}")
        reference = None
        for name, engine in engines.items():
            start = time.perf_counter()
            result = engine(lm, messages, passages)
            answer = Answer(name, result.text, result.token_ids, time.perf_counter() - start)
            reference = reference or answer
            same = answer.token_ids == reference.token_ids
            table[name]["seconds"] += answer.seconds
            table[name]["tokens"] += len(answer.token_ids)
            table[name]["identical"] += int(same)
            write(f"   [{name:>14}] {answer.tokens_per_s:6.1f} tok/s  identical={same}  "
                  f"{answer.text.strip()[:160]!r}")
    base = table["autoregressive"]["tokens"] / table["autoregressive"]["seconds"]
    write("\nengine          tok/s   speed-up  identical-to-greedy")
    for name, row in table.items():
        rate = row["tokens"] / row["seconds"] if row["seconds"] else 0.0
        row["speedup"] = rate / base if base else 0.0
        write(f"{name:<14} {rate:6.1f}   {row['speedup']:5.2f}x   "
              f"{int(row['identical'])}/{len(QUESTIONS)}")
    write("(rapid builds its own prompt from the documents as the long context and, by default, "
          "samples from RAPID's retrieval-augmented target, so its tokens are not expected to equal "
          "greedy decoding of the chat prompt)")
    return table
