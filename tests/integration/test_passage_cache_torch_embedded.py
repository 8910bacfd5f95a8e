"""The passage cache on torch with the embedded SmolLM2 (real weights, fp32 on CPU): exact
prefix blocks give a cold prefill's tokens; blend reuses passages in another order and reports
it (its quality is measured, not asserted: docs/backends.md, *Passage cache*)."""

from __future__ import annotations

import pytest
import torch
from fakes import PASSAGES

from shared_core.config import PassageCacheConfig
from shared_core.runtime.lm import clear_prefix_cache
from shared_core.runtime.passage_cache import attach, register_passages
from shared_core.runtime.passage_cache.torch_cache import BLOCK

pytestmark = pytest.mark.integration


def prompt(lm, order, question):
    text = "Context:\n" + "\n\n".join(PASSAGES[i] for i in order) + f"\n\nQuestion: {question}"
    return lm.prompt_ids([{"role": "user", "content": text}])


def greedy(lm, ids, n=6):
    clear_prefix_cache(lm)
    session = lm.open_session()
    first = logits = session.prefill(ids)
    out = []
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = session.extend([out[-1]])[-1]
    return out, first, session


@pytest.fixture
def cached(smollm, tmp_path):
    def with_cache(mode, **settings):
        return attach(smollm.model, PassageCacheConfig(mode=mode, **settings),
                      disk_dir=tmp_path / "passage_kv")
    yield with_cache
    if smollm.model.passage_cache is not None:
        smollm.model.passage_cache.close()  # its disk writes end before tmp_path goes
    smollm.model.passage_cache = None


def test_smollm_exact_warm_equals_cold(smollm, cached):
    ids = prompt(smollm, [0, 1, 2], "Who built the weir?")
    _, plain_logits, _ = greedy(smollm, ids)
    cached("exact")
    cold, cold_logits, session = greedy(smollm, ids)
    assert session.passage_report.reused == 0 and session.passage_report.stored >= 1
    warm, warm_logits, session = greedy(smollm, ids)
    assert session.passage_report.reused == (len(ids) - 1) // BLOCK * BLOCK > 0
    # the default mode reads the ids after the restored blocks in a forward of their own (the
    # cold read: one over the whole prompt): equal to rounding, its contract (bit for bit with
    # torch 2.13 on this CPU, not with 2.11); exact=True is bit for bit (tests/conformance)
    assert warm == cold
    torch.testing.assert_close(warm_logits, cold_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(cold_logits, plain_logits, atol=1e-3, rtol=1e-4)  # other chunks


def test_smollm_blend_reuses_passages_in_another_order(smollm, cached):
    cached("blend", recompute_share=0.3)
    assert register_passages(smollm, PASSAGES) == 3
    greedy(smollm, prompt(smollm, [0, 1, 2], "Who built the weir?"), 1)
    ids = prompt(smollm, [2, 0, 1], "What did Marta Quell design?")
    tokens, logits, session = greedy(smollm, ids)
    report = session.passage_report
    assert report.reused > 0 and report.computed_alone == 0 and report.probe == len(ids)
    assert abs(report.recomputed - 0.3 * report.reused) <= 1
    assert len(tokens) == 6 and bool(torch.isfinite(logits).all())


def test_the_benchmark_runs_every_torch_method_on_the_same_report(tmp_path):
    """``python -m shared_core.bench passage-cache --backend torch`` on two questions: the
    llama.cpp report's methods but LlamaRAMCache, the exact contract, the backend named."""
    import argparse

    from shared_core.bench.system import passage_cache as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--backend", "torch", "--model", "smollm2-135m-instruct",
                              "--datasets", "nq", "--limit", "2", "--shares", "0", "--exact", "1",
                              "--max-new-tokens", "2", "--kv-dir", str(tmp_path / "kv")])
    args.out, args.plot = str(tmp_path / "report.json"), None
    report = bench.run(args)
    assert report["backend"] == "torch" and report["n_ctx"] is None
    methods = report["datasets"]["nq"]["methods"]
    assert set(methods) == {"full", "blend_stream", "blend_0", "exact_cold", "exact_warm"}
    assert methods["exact_warm"]["answer_equal"] == "1/1"  # the exact contract
    assert methods["exact_warm"]["cache"]["reused"] > 0
    assert methods["blend_0"]["cache"]["reused"] > 0
    assert methods["blend_0"]["steps_s"] and "place" in methods["blend_0"]["steps_s"]
    assert {"gained", "lost", "p_value"} <= set(methods["blend_0"]["accuracy_vs_full"])
