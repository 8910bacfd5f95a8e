"""`specrag demo`: the project's job in miniature, on the embedded offline models.

It prints the machine's CPU features, threads and load, indexes a small knowledge base written
here (a fictional town, so the answers must come from retrieval), then, in this order:

1. **what makes a RAG answer faster on this machine**: the passage KV cache. A question is
   answered cold (full prefill), then asked again through the ``exact`` contract (cold, warm:
   token-identical); a second question whose retrieved passages overlap the first's in another
   order is answered with a full prefill and through the ``blend`` contract: time to first token
   before / after, the cache's report (reused, recomputed and read prompt ids) and whether the
   answer equals the full prefill's;
2. **what does not pay here, and why**: plain decoding and every token-level engine (measured
   speed-ups, whether their tokens equal greedy decoding, a measured one-line reason), then
   Speculative RAG — Qwen2.5-Coder-0.5B drafts answer-first and Qwen2.5-Coder-1.5B verifies
   (SmolLM2-135M and Gemma-3-270M without the ``qwen`` extra) — next to standard RAG with the
   verifier and with the drafter, showing every draft and its scores.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from shared_core.config import DEFAULT_BACKEND, DEFAULT_EMBEDDER, DEFAULT_LM, DEFAULT_VERIFIER
from shared_core.config.rag import DraftOrder, SpeculativeRAGConfig
from shared_core.runtime.lm import clear_prefix_cache

if TYPE_CHECKING:
    from shared_core.decoding.output import GenerationResult
    from shared_core.engines.speculative_rag.results import (
        SpeculativeRAGResult,
        SpeculativeRAGStats,
        StandardRAGResult,
        StandardRAGStats,
    )
    from shared_core.retrieval.base import Retriever
    from shared_core.runtime.protocol import SessionLM

# an engine of the demo: (model, chat messages, retrieved passages) -> its result
DemoEngine = Callable[["SessionLM", list[dict[str, str]], list[str]], "GenerationResult"]

logger = logging.getLogger(__name__)
# The pair of the papers' regime (a verifier three times the drafter, one tokenizer), used when
# the qwen extra is installed. The 0.5B answer-first drafts held an answer (oracle accuracy) for
# 71% of NQ and 83% of SQuAD questions against 39-43% / 58% for SmolLM2 (results/{demo,specrag}/2026-11-26a).
PAPER_VERIFIER = "qwen2.5-coder-1.5b-instruct"
PAPER_DRAFTER = "qwen2.5-coder-0.5b-instruct"
# Tokens per answer of the demo's token engines, smaller than DEFAULT_MAX_NEW_TOKENS (256) to keep
# `specrag demo` to a few minutes on a CPU.
DEMO_MAX_NEW_TOKENS = 64

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
# The passage cache's pair: the second question's top passages overlap the first's, in another
# order (MiniLM: harbor, railway, school, library, then railway, school, harbor, bridge).
CACHE_QUESTIONS = (QUESTIONS[0], "When did the railway reach Veldmark, and how long is the trip "
                                 "to the capital?")
CACHE_K = 4  # passages per question in the passage cache section
CACHE_MAX_NEW_TOKENS = 24


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


def _engines(max_new_tokens: int) -> dict[str, DemoEngine]:
    from shared_core.drafters.prompt_lookup import PromptLookupDrafter
    from shared_core.engines.baseline import autoregressive_generate, speculative_generate
    from shared_core.engines.registry import TOKEN_ENGINES, engine_function, stream_engine

    engines: dict[str, DemoEngine] = {
        "autoregressive": lambda lm, msgs, docs: autoregressive_generate(lm, msgs, max_new_tokens),
        "prompt_lookup": lambda lm, msgs, docs: speculative_generate(
            lm, PromptLookupDrafter(), msgs, max_new_tokens),
    }
    state: dict[str, Any] = {}  # kept across calls, as the adapters keep it (e.g. RAPID's decoders)
    for name in TOKEN_ENGINES:
        if name == "autoregressive":
            continue
        try:
            engine_function(name)
        except (ImportError, AttributeError) as e:
            logger.info("engine %s not available in this build: %s", name, e)
            continue
        engines[name] = (lambda n: lambda lm, msgs, docs: stream_engine(
            n, lm, msgs, max_new_tokens=max_new_tokens, documents=docs, engine_state=state).run())(name)
    return engines


def machine_line(facts: dict[str, Any]) -> str:
    flags = ", ".join(facts["flags"]) or "none of AVX2/AVX-512/AMX"
    load = ", ".join(f"{x:.2f}" for x in facts["load_avg"])
    return (f"machine: {facts['cpu']} ({facts['cpus']} CPUs; {flags}); torch {facts['torch']} with "
            f"{facts['threads']} threads, OMP_WAIT_POLICY={facts['omp_wait_policy']}; load average {load}")


def pick_verifier() -> str:
    """The 1.5B Qwen when its extra is installed (the papers' regime), else Gemma-3-270M."""
    from shared_core.runtime.weights.embedded import is_installed

    return PAPER_VERIFIER if is_installed(PAPER_VERIFIER) else DEFAULT_VERIFIER


def pick_drafter() -> tuple[str, DraftOrder]:
    """The 0.5B Qwen drafting answer-first when its extra is installed, else SmolLM2 (the
    engine's defaults)."""
    from shared_core.runtime.weights.embedded import is_installed

    if is_installed(PAPER_DRAFTER):
        return PAPER_DRAFTER, "answer_first"
    return DEFAULT_LM, SpeculativeRAGConfig.draft_order


def speculative_rag_section(retriever: Retriever, verifier: str, write: Callable[[str], None],
                            drafter: str = DEFAULT_LM,
                            draft_order: DraftOrder = SpeculativeRAGConfig.draft_order
                            ) -> dict[str, float]:
    """Speculative RAG (``drafter`` drafts, ``verifier`` scores) against standard RAG with
    ``verifier`` and with ``drafter``: every draft with its scores, the time of each part, and
    why it pays or not."""
    from shared_core.engines.speculative_rag import SpeculativeRAG

    write(f"\n== Speculative RAG: {drafter} drafts ({draft_order}), {verifier} verifies; standard "
          f"RAG = {verifier} (or {drafter}) reading every passage ==")
    # the retriever's embedder by name: one loaded copy (runtime.model_cache)
    engine = SpeculativeRAG(drafter, verifier, embedder=DEFAULT_EMBEDDER, backend=DEFAULT_BACKEND,
                            config=SpeculativeRAGConfig(draft_order=draft_order))
    verifier_lm = cast("SessionLM", engine.verifier)  # DEFAULT_BACKEND: an in-process model
    write(f"   runtime: {verifier_lm.backend} ({verifier_lm.backend_reason})")
    docs = [hit.document for hit in retriever.search([QUESTIONS[0]], len(KNOWLEDGE_BASE))[0]]
    engine.answer(QUESTIONS[0], docs)  # warm-up (loads both models)
    engine.standard_rag(QUESTIONS[0], docs)
    standard_parts: list[StandardRAGStats] = []
    spec_parts: list[SpeculativeRAGStats] = []
    for question in QUESTIONS:
        docs = [hit.document for hit in retriever.search([question], len(KNOWLEDGE_BASE))[0]]
        for lm in (engine.drafter, engine.verifier):  # every method reads its prompts cold
            clear_prefix_cache(lm)
        standard = engine.standard_rag(question, docs)
        small = engine.standard_rag(question, docs, model="drafter")
        result = engine.answer(question, docs)
        standard_parts.append(standard.stats)
        spec_parts.append(result.stats)
        _write_specrag_answer(question, standard, small, result, write)
    table = {"standard_rag_s": sum(s.total_s for s in standard_parts),
             "speculative_rag_s": sum(s.total_s for s in spec_parts)}
    table["speedup"] = table["standard_rag_s"] / table["speculative_rag_s"]
    write(f"\nSpeculative RAG took {table['speculative_rag_s']:.1f} s vs standard RAG "
          f"{table['standard_rag_s']:.1f} s: {table['speedup']:.2f}x")
    write("   " + explain_specrag(standard_parts, spec_parts))
    return table


def _write_specrag_answer(question: str, standard: StandardRAGResult, small: StandardRAGResult,
                          result: SpeculativeRAGResult, write: Callable[[str], None]) -> None:
    std, spec = standard.stats, result.stats
    write(f"\nQ: {question}\n   standard RAG  {std.total_s:5.1f} s  {standard.text!r}  (reads "
          f"{std.prompt_tokens} prompt tokens in {std.prefill_s:.1f} s, decodes {std.decode_s:.1f} s)")
    write(f"   ... drafter   {small.stats.total_s:5.1f} s  {small.text!r}  (standard RAG with the "
          f"drafter: reads {small.stats.prompt_tokens} prompt tokens in {small.stats.prefill_s:.1f} s)")
    write(f"   speculative   {spec.total_s:5.1f} s  {result.text!r}  (draft {result.best + 1} of "
          f"{len(result.drafts)}; drafter reads {spec.draft_prompt_tokens} tokens in "
          f"{spec.draft_prefill_s:.1f} s, decodes {spec.draft_decode_s:.1f} s; verifier scores "
          f"{spec.verify_tokens} tokens in {spec.verify_s:.1f} s)")
    for i, d in enumerate(result.drafts):
        mark = "*" if i == result.best else " "
        write(f"    {mark} draft {i + 1} docs {list(d.doc_ids)}: log ρ_draft {d.log_draft:7.2f}  "
              f"log ρ_SC {d.log_self_contain or 0:7.2f}  log ρ_SR {d.log_self_reflect or 0:6.2f}"
              f"  → {d.answer[:60]!r}")


def explain_specrag(standard: list[StandardRAGStats], speculative: list[SpeculativeRAGStats]
                    ) -> str:
    """One measured line: where Speculative RAG's time went against standard RAG's reading."""
    read = sum(s.prefill_s for s in standard)
    read_tokens = sum(s.prompt_tokens for s in standard)
    draft = sum(s.draft_prefill_s + s.draft_decode_s for s in speculative)
    verify = sum(s.verify_s for s in speculative)
    verify_tokens = sum(s.verify_tokens for s in speculative)
    total_std = sum(s.total_s for s in standard)
    total_spec = sum(s.total_s for s in speculative)
    parts = (f"drafting took {draft:.1f} s and verifying {verify:.1f} s ({verify_tokens} tokens, "
             f"no passages), against {read:.1f} s for the verifier to read {read_tokens} prompt "
             "tokens with every passage")
    if total_spec <= total_std:
        return f"(it pays here: {parts})"
    return (f"(it does not pay here: {parts}; the less there is to read, the less the verifier "
            "saves by not reading it, and drafting is a fixed cost)")


def explain_token_speedups(lm: SessionLM, table: dict[str, dict[str, float]],
                           write: Callable[[str], None]) -> None:
    """One line on why token-level speculation does or does not pay on this machine, measured now
    (llama.cpp: the cost curve the engines size their drafts by)."""
    from shared_core.runtime.lm import LM

    curve = lm.forward_cost_curve()
    if curve is not None:
        ratio, step = dict(curve), "the curve ReSpec sizes its drafts by"
    else:
        from shared_core.bench.system.forward_cost import measure_forward_costs

        if not isinstance(lm, LM):
            msg = f"the demo measures a torch model's forwards; {lm.name!r} is on {lm.backend}"
            raise TypeError(msg)
        costs = measure_forward_costs(lm, [1, 4, 8], context=256, repeats=3)
        ratio, step = costs["ratio"], f"{costs['ms'][1]:.0f} ms per step"
    write(f"\nOn this CPU ({lm.backend}) a 4-token verification forward costs {ratio[4]:.1f}x a "
          f"one-token step and an 8-token one {ratio[8]:.1f}x (measured here, {step}).")
    if any(row.get("speedup", 1.0) < 1.0 for row in table.values()):
        write("   Where a speed-up is below 1x: a draft of n tokens saves time only if more than "
              f"about {ratio[4]:.1f} of 4 drafted tokens are accepted, and this small model is "
              "already fast per step, so the drafting and verification overhead is not recovered.")


def token_engines_section(lm: SessionLM, retriever: Retriever, max_new_tokens: int,
                          write: Callable[[str], None]) -> dict[str, dict[str, float]]:
    engines = _engines(max_new_tokens)
    table: dict[str, dict[str, float]] = {name: {"seconds": 0.0, "tokens": 0, "identical": 0}
                                          for name in engines}
    for engine in engines.values():  # warm-up, so the first timed call pays no one-off costs
        engine(lm, [{"role": "user", "content": "Where is Veldmark?"}], [KNOWLEDGE_BASE["harbor"]])
    write(f"\n== Token-level engines on {lm.name} (greedy), answering from the top 3 passages ==")
    for question in QUESTIONS:
        passages = [hit.document.text for hit in retriever.search([question], 3)[0]]
        messages = build_prompt(question, passages)
        write(f"\nQ: {question}\n   retrieved: {[p[:40] + '...' for p in passages]}")
        reference = None
        for name, engine in engines.items():
            clear_prefix_cache(lm)  # each engine reads the prompt cold, not after the last one
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
    if lm.backend == "llama.cpp":
        write("(autoregressive on llama.cpp is plain llama.cpp decoding of the same GGUF: within 10% "
              "of llama-cpp-python's own greedy, results/respec/2026-11-25/respec_llamacpp_*.json)")
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


@dataclass
class TimedAnswer:
    """A greedy answer with its time to first token and the passage cache's report."""

    text: str
    token_ids: list[int]
    ttft_s: float
    total_s: float
    cache: dict[str, int] | None = None


def timed_answer(lm: SessionLM, messages: list[dict[str, str]], max_new_tokens: int) -> TimedAnswer:
    from shared_core.engines.baseline import autoregressive_generate

    start = time.perf_counter()
    result = autoregressive_generate(lm, messages, max_new_tokens)
    return TimedAnswer(result.text.strip(), list(result.token_ids), result.stats.prefill_s,
                       time.perf_counter() - start, result.stats.extra.get("passage_cache"))


def compare_answers(reference: TimedAnswer, answer: TimedAnswer) -> str:
    """Whether ``answer`` equals the full prefill's ``reference`` token for token, else how many
    leading tokens agree and both texts (the quality cost, measured on this answer)."""
    if answer.token_ids == reference.token_ids:
        return f"equal to the full prefill's ({len(answer.token_ids)}/{len(reference.token_ids)} tokens)"
    agree = shared_prefix(answer.token_ids, reference.token_ids)
    return (f"DIFFERS from the full prefill's after {agree} of {len(reference.token_ids)} tokens: "
            f"{answer.text[:80]!r} vs {reference.text[:80]!r}")


def cache_line(report: dict[str, int] | None) -> str:
    """The cache's report of one prefill: prompt ids reused, recomputed, read."""
    if not report:
        return "no cache report"
    reused, recomputed = report["reused"], report["recomputed"]
    share = f" ({recomputed / reused:.0%} of the reused)" if reused and recomputed else ""
    alone = (f", {report['computed_alone']} read alone and stored"
             if report.get("computed_alone") else "")
    if report.get("unseen"):
        alone += f", {report['unseen']} of them new passages, stored as read"
    return (f"{report['prompt']} prompt ids: {reused} reused, {recomputed} recomputed{share}, "
            f"{report['read']} read{alone}")


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


def _question_rows(retriever: Retriever, k: int) -> list[dict[str, Any]]:
    """The two questions' retrieved passages and prompts."""
    rows = []
    for question in CACHE_QUESTIONS:
        hits = retriever.search([question], k)[0]
        rows.append({"question": question, "passages": [hit.document.id for hit in hits],
                     "messages": build_prompt(question, [hit.document.text for hit in hits])})
    return rows


def passage_cache_section(retriever: Retriever, model: str, write: Callable[[str], None],
                          k: int = CACHE_K, max_new_tokens: int = CACHE_MAX_NEW_TOKENS
                          ) -> dict[str, Any]:
    """The passage KV cache on ``model`` (llama.cpp), measured now: Q1 answered cold (full
    prefill); Q1 asked again through the exact contract (cold, warm); then Q2, whose passages
    overlap Q1's in another order, with a full prefill and through the blend contract after Q1
    went through it. Returns the measured numbers (``{}`` where llama.cpp cannot run ``model``)."""
    from shared_core.runtime.models import load_lm

    write(f"\n== What makes a RAG answer faster on this machine: the passage KV cache ({model}, "
          "llama.cpp) ==")
    try:  # no prompt-prefix reuse, no disk tier: every number below is this run's own reading
        full = load_lm(model, backend="llama.cpp", prefix_cache=False)
    except (ImportError, OSError, RuntimeError, ValueError) as e:
        write(f"   skipped: the passage cache runs on llama.cpp, which cannot run {model} here "
              f"({type(e).__name__}: {e})")
        return {}
    try:
        cached: SessionLM | None = load_lm(model, backend="llama.cpp", prefix_cache=False,
                                           passage_cache="blend", passage_cache_disk_mb=0)
    except ValueError as e:  # a model blend cannot run on (sliding-window layers: Gemma-3)
        cached, no_blend = None, str(e)
    write("   On a CPU a RAG answer is mostly reading its passages (prefill); load_lm(..., "
          'passage_cache="exact" | "blend") keeps the KV of what the model read and reuses it.')
    q1, q2 = _question_rows(retriever, k)
    write(f"\nQ1: {q1['question']}\n   passages {q1['passages']}")
    reference = timed_answer(full, q1["messages"], max_new_tokens)
    write(f"   full prefill    TTFT {reference.ttft_s:5.2f} s, answer {reference.total_s:5.2f} s"
          f"  {reference.text[:90]!r}")
    write(f"   reading was {reference.ttft_s / reference.total_s:.0%} of the answer's time "
          f"({len(reference.token_ids)} new tokens): what a cache can remove; token-level "
          "speculation can only shorten the rest (below)")
    q1["full"] = reference
    exact = exact_contract(model, q1["messages"], max_new_tokens, write)
    if cached is None:
        write(f"\n   contract blend skipped: {no_blend} (Qwen2.5 runs it: the `qwen` extra)")
        return {"rows": {"Q1": q1}, "exact": exact}
    _blend_contract(full, cached, q1, q2, max_new_tokens, write)
    speedup = q2["full"].ttft_s / q2["cached"].ttft_s
    write(f"\nOn this machine: {_cache_verdict(exact, speedup, q2['equal'])} (blend's quality over "
          "many questions: `python -m shared_core.bench passage-cache`, "
          "results/system/2026-11-28-passage-cache-qwen0.5b/).")
    return {"rows": {"Q1": q1, "Q2": q2}, "ttft_speedup": speedup, "exact": exact}


def _blend_contract(full: SessionLM, cached: SessionLM, q1: dict[str, Any], q2: dict[str, Any],
                    max_new_tokens: int, write: Callable[[str], None]) -> None:
    """Q1 through the blend cache (which stores its passages), then Q2 (Q1's passages in another
    order) with a full prefill and through the cache; each row gets ``cached`` and ``equal``."""
    from shared_core.config import DEFAULT_RECOMPUTE_SHARE
    from shared_core.runtime.passage_cache import register_passages
    from shared_core.runtime.passage_cache.llamacpp import BLOCK

    ids = [full.prompt_ids(q["messages"]) for q in (q1, q2)]
    common = [key for key in q2["passages"] if key in q1["passages"]]
    order = ("in another order" if common != [key for key in q1["passages"] if key in common]
             else "in the same order")
    shared = shared_prefix(*ids)
    exact_reuse = (f"less than one {BLOCK}-id block for exact reuse" if shared < BLOCK else
                   f"at most {shared // BLOCK * BLOCK} ids for exact reuse")
    write(f"\nQ2: {q2['question']}\n   passages {q2['passages']}: {len(common)} of Q1's "
          f"{len(q1['passages'])}, {order}; Q2 shares its first {shared} prompt ids with Q1: "
          f"{exact_reuse}")
    write('   contract blend (load_lm(..., passage_cache="blend"), opt-in): cached passages reused '
          f"anywhere, in any order, {DEFAULT_RECOMPUTE_SHARE:.0%} of their tokens (those whose "
          "reused KV deviates most) recomputed with full attention; the answer may differ from a "
          "full prefill's")
    register_passages(cached, KNOWLEDGE_BASE.values())  # the texts the app indexes
    q1["cached"] = timed_answer(cached, q1["messages"], max_new_tokens)
    write(f"   Q1 through it   TTFT {q1['cached'].ttft_s:5.2f} s "
          f"({q1['cached'].ttft_s / q1['full'].ttft_s:.2f}x the full prefill's; the cache was "
          f"empty): {cache_line(q1['cached'].cache)}")
    q2["full"] = timed_answer(full, q2["messages"], max_new_tokens)
    q2["cached"] = timed_answer(cached, q2["messages"], max_new_tokens)
    write(f"   full prefill    TTFT {q2['full'].ttft_s:5.2f} s, answer {q2['full'].total_s:5.2f} s"
          f"  {q2['full'].text[:90]!r}")
    write(f"   with the cache  TTFT {q2['cached'].ttft_s:5.2f} s "
          f"({q2['cached'].ttft_s / q2['full'].ttft_s:.2f}x the full prefill's): "
          f"{cache_line(q2['cached'].cache)}")
    write(f"   answer {compare_answers(q2['full'], q2['cached'])}")
    for q in (q1, q2):
        q["equal"] = q["cached"].token_ids == q["full"].token_ids


def _cache_verdict(exact: dict[str, Any], speedup: float, blend_equal: bool) -> str:
    """What each contract gave here, in one sentence."""
    why = ("on passages this short the cache's own work, the layer-1 probe over the prompt and the "
           "recomputed runs, outweighed the reading it saved")
    sooner = (f"{speedup:.1f}x sooner" if speedup >= 1.05 else
              f"no sooner ({why})" if speedup > 0.95 else f"{1 / speedup:.1f}x later ({why})")
    found = [f"exact reuse gave Q1's first token {1 / max(exact['ratio'], 1e-9):.0f}x sooner, "
             f"answer token-identical: {exact['equal']}"] if exact else []
    found.append(f"blend gave Q2's first token {sooner}, answer equal to the full prefill's: "
                 f"{blend_equal}")
    return "; ".join(found)


def exact_contract(model: str, messages: list[dict[str, str]], max_new_tokens: int,
                   write: Callable[[str], None]) -> dict[str, Any]:
    """The same prompt read twice through ``passage_cache="exact"`` on an ``exact=True`` model
    (a repeated question, a follow-up turn over the same passages, another process through the
    disk tier): cold, then warm; the warm answer must equal the cold one token for token."""
    from shared_core.runtime.models import load_lm

    try:
        lm = load_lm(model, backend="llama.cpp", exact=True, prefix_cache=False,
                     passage_cache="exact", passage_cache_disk_mb=0)
    except (ImportError, OSError, RuntimeError, ValueError) as e:
        write(f"   exact contract skipped: {type(e).__name__}: {e}")
        return {}
    write('   Q1 asked again: contract exact (load_lm(..., exact=True, passage_cache="exact")): '
          "exact prompt prefixes reused in 64-id blocks, in memory and on disk across processes")
    cold = timed_answer(lm, messages, max_new_tokens)
    warm = timed_answer(lm, messages, max_new_tokens)
    same = warm.token_ids == cold.token_ids
    write(f"   exact, cold     TTFT {cold.ttft_s:5.2f} s  {cold.text[:90]!r}")
    write(f"   exact, warm     TTFT {warm.ttft_s:5.2f} s ({warm.ttft_s / cold.ttft_s:.2f}x the "
          f"cold read's): {cache_line(warm.cache)}")
    write(f"   answer {'equal to the cold one token for token' if same else 'DIFFERS'} "
          f"({len(warm.token_ids)} tokens)")
    return {"cold": cold, "warm": warm, "equal": same, "ratio": warm.ttft_s / cold.ttft_s}


def run_demo(max_new_tokens: int = DEMO_MAX_NEW_TOKENS, write: Callable[[str], None] = logger.info,
             verifier: str | None = None) -> dict[str, Any]:
    """Machine facts; the passage cache (what pays here); then what does not: the token-level
    engines and Speculative RAG against standard RAG. Returns the measured tables."""
    from shared_core.retrieval import DenseRetriever, Document
    from shared_core.runtime.models import load_lm
    from shared_core.util.device import cpu_facts

    start = time.perf_counter()
    write(machine_line(cpu_facts()))
    retriever = DenseRetriever(DEFAULT_EMBEDDER)
    retriever.add([Document(key, text) for key, text in KNOWLEDGE_BASE.items()])
    verifier = verifier or pick_verifier()
    cache = passage_cache_section(retriever, verifier, write)
    write("\n== What does not pay here, and why: token-level speculation, then Speculative RAG ==")
    lm = load_lm(DEFAULT_LM, backend=DEFAULT_BACKEND)
    write(f"runtime of the token engines: {lm.backend} ({lm.backend_reason})")
    tokens = token_engines_section(lm, retriever, max_new_tokens, write)
    explain_token_speedups(lm, tokens, write)
    specrag = speculative_rag_section(retriever, verifier, write, *pick_drafter())
    write(f"\ndemo finished in {time.perf_counter() - start:.0f} s")
    return {"passage_cache": cache, "token_engines": tokens, "speculative_rag": specrag}
