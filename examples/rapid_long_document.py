"""Questions over one long document with RAPID, through LangChain and through LlamaIndex.

Offline: SmolLM2-135M-Instruct (target and self-drafter) and MiniLM (chunk retrieval) load from
their PyPI packages. The drafter reads only the chunks retrieved for each question; the target
verifies γ = 10 drafted tokens per forward on the whole document. The document's KV is computed
by the first question and reused by every later one, in either framework (both adapters get the
same preloaded model, so they share one RAPID decoder).

    python examples/rapid_long_document.py [--eta 0]    # η = 0: identical to the target alone
    python examples/rapid_long_document.py --drafter-kv target  # no drafter prefill per question
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from langchain_core.messages import HumanMessage
from llama_index.core.llms import ChatMessage

from langchain_specrag import ChatSpeculative
from llamaindex_specrag import SpeculativeLLM
from shared_core.runtime.models import load_lm

TOWN = [
    "Velmora is a river town founded in 1791 by the clockmaker Ansel Dorrig.",
    "The town hall has a green copper roof and a bell named Old Tessa.",
    "Every autumn Velmora holds the Lantern Regatta, in which boats carry paper lanterns.",
    "The mayor since 2019 is Ilse Marrowby, a former ferry captain.",
    "The main export is blue slate, quarried in the hills north of the river Oune.",
    "The library keeps a map drawn by Ansel Dorrig that shows a tunnel under the river.",
    "In 1902 a flood destroyed the wooden bridge; a stone bridge replaced it in 1906.",
    "The football club, Velmora Rovers, plays in yellow shirts at Dorrig Park.",
]
FILLER = ("The chronicle then lists the harvests, the prices of grain and the names of the "
          "families who kept the ferry, year after year, with little else of note. ")


def long_document() -> str:
    """About 1.7k tokens (SmolLM2's tokenizer): the facts scattered through pages of filler."""
    return "\n\n".join(fact + " " + FILLER * 6 for fact in TOWN)


def show(framework: str, question: str, answer: str, stats: dict[str, Any], seconds: float
         ) -> None:
    print(f"[{framework}] {question}\n  -> {answer.strip()!r} ({seconds:.1f} s)")
    print(f"  accepted {stats['accepted']}/{stats['drafted']} drafted, "
          f"{stats['tokens_per_target_forward']:.2f} tokens per target forward, retrieved "
          f"{stats['extra']['retrieved_tokens']} of {stats['extra']['context_tokens']} context "
          f"tokens, reused prefix {stats['extra']['reused_prefix_tokens']} tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eta", type=float, default=1.0, help="η (0 = lossless)")
    parser.add_argument("--drafter-kv", choices=("own", "target"), default="own",
                        help="'target': draft on the target's cached KV of the retrieved chunks")
    args = parser.parse_args()
    lm = load_lm("smollm2-135m-instruct")
    document = long_document()
    options = {"eta": args.eta, "min_rag_tokens": 512, "drafter_kv": args.drafter_kv}

    chat = ChatSpeculative(lm=lm, engine="rapid", engine_options=options, max_tokens=24,
                           documents=[document])
    for question in ("Who founded Velmora?", "What is the bell in the town hall called?"):
        start = time.perf_counter()
        reply = chat.invoke([HumanMessage(question)])
        show("LangChain", question, str(reply.content),
             reply.response_metadata["speculative_stats"], time.perf_counter() - start)

    llm = SpeculativeLLM(lm=lm, engine="rapid", engine_options=options, max_new_tokens=24,
                         documents=[document])
    question = "Who is the mayor of Velmora?"
    start = time.perf_counter()
    response = llm.chat([ChatMessage(role="user", content=question)])
    assert response.raw is not None
    show("LlamaIndex", question, str(response.message.content),
         response.raw["speculative_stats"], time.perf_counter() - start)


if __name__ == "__main__":
    main()
