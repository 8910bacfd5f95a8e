"""The GPU check's CPU dry run (``python -m shared_core.bench gpu --device cpu --tiny``), run as
the GPU machine would: in fresh processes (the check's and its workers') where faiss, bm25s,
gguf, xgrammar, LangChain and LlamaIndex cannot be imported, with the correctness sections side
by side in spawned workers as on CUDA. Every section must be written, and on a CPU in fp32 every
lossless engine must equal greedy decoding token for token. It runs twice: on our transformers
stack and on the GPU machine's (``scripts/gpu_machine.txt``, installed into the venv's
``gpu-machine`` folder by ``make install``), where an API that moved between the two fails first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny import measured

ROOT = Path(__file__).resolve().parents[2]
ABSENT_THERE = ("faiss", "bm25s", "gguf", "xgrammar", "langchain", "langchain_core",
                "llama_index", "llama_cpp")
# imported by every Python process started with it on the path (a spawned worker too)
SITECUSTOMIZE = f"""
import sys
for name in {ABSENT_THERE!r}:
    sys.modules[name] = None  # import fails, as on the GPU machine
"""


GPU_MACHINE_PINS = ROOT / "scripts" / "gpu_machine.txt"
GPU_MACHINE_SITE = Path(sys.prefix) / "gpu-machine"  # make install puts the pins there


def gpu_machine_versions() -> dict[str, str]:
    """``scripts/gpu_machine.txt``'s pins: distribution name -> version."""
    lines = GPU_MACHINE_PINS.read_text(encoding="utf-8").splitlines()
    return dict(line.split("==") for line in lines if line and not line.startswith("#"))


def stack_path(stack: str) -> list[str]:
    """What goes ahead of the repository on the dry run's path for ``stack``."""
    if stack == "ours":
        return []
    if not GPU_MACHINE_SITE.is_dir():
        pytest.fail(f"{GPU_MACHINE_SITE} is missing: `make install` puts the GPU machine's "
                    f"pins ({GPU_MACHINE_PINS.name}) there")
    return [str(GPU_MACHINE_SITE)]


@pytest.fixture(scope="module", params=["ours", "gpu-machine"])
def report(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("gpu")
    site = tmp_path_factory.mktemp("site")
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE, encoding="utf-8")
    path = os.pathsep.join([str(site), *stack_path(request.param), str(ROOT)])
    env = {**os.environ, "PYTHONPATH": path, "SPECRAG_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-m", "shared_core.bench", "gpu", "--device", "cpu",
                          "--tiny", "--workers", "3", "--threads", "1", "--out", str(out)],
                         cwd=ROOT, env=env, check=True, capture_output=True, text=True,
                         timeout=300)
    assert "side by side in 3 processes" in run.stderr
    assert "Loading faiss" not in run.stderr  # no process of the run could import it
    assert (out / "gpu_k_cost.png").stat().st_size > 0
    data: dict = json.loads((out / "gpu_report.json").read_text(encoding="utf-8"))
    if request.param == "gpu-machine":  # the run imported the pinned transformers, not ours
        assert data["machine"]["transformers"] == gpu_machine_versions()["transformers"]
    return data


def test_every_section_is_written_and_ran(report: dict) -> None:
    assert report["schema"] == "specrag-gpu-check/1"
    assert set(report["sections"]) == {
        "correctness/tiny-a/fp32", "correctness/tiny-a/bf16", "correctness/tiny-a/bf16-exact",
        "physics/tiny-a", "physics/tiny-b", "physics/tiny-c", "correctness/llama-tiny-a/bf16",
        "warm/tiny-a", "warm/tiny-b", "warm/tiny-c"}
    assert {s["status"] for s in report["sections"].values()} == {"ok"}
    assert report["summary"]["aims"]["every_section_ran"] is True
    assert report["machine"]["device"] == "cpu" and report["machine"]["torch"]
    # the correctness sections ran side by side before the physics, recorded in plan order
    assert list(report["sections"])[:4] == [
        "correctness/tiny-a/fp32", "correctness/tiny-a/bf16", "correctness/tiny-a/bf16-exact",
        "correctness/llama-tiny-a/bf16"]
    for name, section in report["sections"].items():  # where each section's time went
        if name.startswith("warm/"):  # each physics shape's static loops called once ahead
            assert set(section["first_call_ms"]) == {"ours_static", "generate_static"}
            assert all(ms > 0 for ms in section["first_call_ms"].values())
            assert section["inductor_caches"]["dir"]  # where the compiles were left
            continue
        assert 0 < sum(section["steps_s"].values()) <= section["elapsed_s"], name
        assert not section.get("errors"), name
    assert list(report["sections"])[-3:] == ["physics/tiny-a", "physics/tiny-b", "physics/tiny-c"]
    lanes = report["side_by_side"]  # how long the side-by-side phase took, against its sections
    assert sorted(name for lane in lanes["lanes"] for name in lane) == sorted(
        name for name in report["sections"] if not name.startswith("physics/"))
    assert lanes["wall_s"] > 0 and lanes["sections_s"] > 0
    assert set(report["sections"]["correctness/tiny-a/fp32"]["steps_s"]) == {
        "draft_model", "prompt_lookup", "respec", "rapid", "ralmspec", "constrained",
        "speculative_rag", "passage_cache", "sampling"}
    assert "sampling" not in report["sections"]["correctness/llama-tiny-a/bf16"]["steps_s"]
    # the sampling test runs in both dtypes on the Qwen shape; the Llama repeats the equalities
    assert len(report["sections"]["correctness/tiny-a/bf16"]["sampling"]) == 2
    assert report["sections"]["correctness/llama-tiny-a/bf16"]["sampling"] == []
    assert report["sections"]["correctness/tiny-a/bf16-exact"]["sampling"] == []


def test_cpu_fp32_equality_holds_for_every_lossless_engine(report: dict) -> None:
    section = report["sections"]["correctness/tiny-a/fp32"]
    assert section["errors"] == {}
    checked = {c["check"].split("/")[0] for c in section["comparisons"]}
    assert checked == {"draft_model", "prompt_lookup", "respec_strict", "rapid_eta0", "ralmspec",
                       "constrained", "speculative_rag", "passage_cache"}
    passages = {c["check"]: c for c in section["comparisons"]
                if c["check"].startswith("passage_cache/")}
    assert set(passages) == {f"passage_cache/{name}" for name in (
        "exact_cold", "exact_warm", "exact_disk", "blend_first_read", "blend_share_1")}
    # each read took the path it names: blocks restored from memory, then from disk; a first
    # read stores what it read; share 1.0 recomputes every passage it placed
    assert passages["passage_cache/exact_warm"]["detail"]["cache"]["reused"] > 0
    assert passages["passage_cache/exact_disk"]["detail"]["cache"]["reused"] > 0
    first = passages["passage_cache/blend_first_read"]["detail"]["cache"]
    assert first["reused"] == 0 and first["unseen"] > 0 and first["stored"] >= 3
    share_1 = passages["passage_cache/blend_share_1"]["detail"]["cache"]
    assert share_1["reused"] > 0 and share_1["recomputed"] == share_1["reused"]
    blend = section["passage_blend"]  # lossy: measured, not compared
    assert blend["cache"]["reused"] > blend["cache"]["recomputed"] > 0
    assert 0 <= blend["identical_rate"] <= 1
    for c in section["comparisons"]:
        if "skipped" in c["detail"]:
            assert c["detail"]["skipped"] == "xgrammar not installed"
            continue
        assert c["equal"] and c["identical_rate"] == 1.0 and c["first_divergence"] is None, c
    perturbed = [c["detail"]["acceptance"] for c in section["comparisons"]
                 if c["check"].startswith("draft_model/perturbed")]
    assert any(0 < a < 1 for a in perturbed)  # the noisy drafter is neither always right nor wrong
    assert [s["check"] for s in section["sampling"]] == ["sampling/draft_model",
                                                        "sampling/respec_strict"]
    for s in section["sampling"]:
        assert s["outside_support"] == 0  # never a token the warped target law excludes
    # each greedy reference decoded once and shared: fewer tokens than the checks compared
    compared = sum(c["tokens"] for c in section["comparisons"]
                   if c["check"].split("/")[0] in {"draft_model", "prompt_lookup",
                                                   "respec_strict", "rapid_eta0", "constrained"})
    assert 0 < section["reference_tokens_decoded"] < compared / 2
    ties = report["summary"]["divergences_at_ties"]["correctness/tiny-a/fp32"]
    assert ties == {"unequal": 0, "at_ties": 0, "all_at_ties": True, "beyond_a_tie": [],
                    "unexamined": [], "verdict": "equal"}


def test_bf16_in_exact_mode_equals_greedy_for_every_lossless_engine(report: dict) -> None:
    """torch's exact mode: every forward one shape, so even bf16 leaves no near-tie to flip."""
    section = report["sections"]["correctness/tiny-a/bf16-exact"]
    assert section["errors"] == {} and section["models"]["exact_width"] > 1
    assert section["models"]["dtype"] == "torch.bfloat16"
    checked = {c["check"].split("/")[0] for c in section["comparisons"]}
    assert checked == {"draft_model", "prompt_lookup", "respec_strict", "rapid_eta0", "ralmspec",
                       "constrained", "speculative_rag", "passage_cache"}
    for c in section["comparisons"]:
        if "skipped" not in c["detail"]:
            assert c["equal"] and c["first_divergence"] is None, c
    assert report["sections"]["correctness/tiny-a/bf16"]["models"]["exact_width"] is None


def test_physics_sections_measure_the_k_cost_curve_and_the_loop(report: dict) -> None:
    for name in ("physics/tiny-a", "physics/tiny-b", "physics/tiny-c"):
        section = report["sections"][name]
        assert set(section["k_cost"]) == {"1", "2", "4", "8", "16", "32", "64"}
        assert section["k_cost"]["1"]["over_step"] == 1.0
        exact = section["exact_cost"]  # torch's exact mode: its price per forward, measured
        assert exact["width"] > 1 and measured(exact["exact_step_over_step"],
                                               exact["exact_k8_over_step"])
        assert section["prefill"]["tok_s"] > 0
        decode = section["decode"]
        assert decode["ours"]["tok_s"] > 0 and decode["generate"]["tok_s"] > 0
        assert decode["ours_static"]["tok_s"] > 0  # cache="static", eager on a CPU
        assert 0 <= decode["tokens_static_vs_ours"]["identical_rate"] <= 1
        assert section["static_cache"].startswith("offered: cache='static'")
        assert decode["ours_static_over_generate_static_spread"]["repeats"] >= 3
        spread = decode["ours_over_generate_spread"]  # interleaved pairs, after a warm-up
        assert spread["repeats"] >= 3 and len(decode["ours"]["runs_ms"]) == spread["repeats"]
        assert spread["min"] <= spread["median"] == decode["ours_over_generate"] <= spread["max"]
        # measured, not asserted: in bf16 a near-tie may go either way between the two loops
        assert 0 <= decode["tokens_vs_generate"]["identical_rate"] <= 1
        for loop in ("plain", "draft_model_k4", "draft_model_k4_sampled", "respec_tree"):
            # issue 39: one sync a round, sampled rounds included
            figures = section["rounds"][loop]
            assert figures["rounds"] > 1 and figures["syncs_per_round"]["engine_max"] <= 1
            split = figures["split"]
            assert split["wall_ms_per_round"] >= split["wait_ms_per_round"] >= 0
    assert set(report["summary"]["syncs_per_round"]) == {
        "physics/tiny-a", "physics/tiny-b", "physics/tiny-c"}
    assert set(report["summary"]["ours_over_generate"]) == {
        "physics/tiny-a", "physics/tiny-b", "physics/tiny-c"}
    assert all(report["summary"]["aims"]["one_sync_per_round"].values())
    for name in ("physics/tiny-a", "physics/tiny-b", "physics/tiny-c"):
        ttft = report["sections"][name]["passage_ttft"]
        ways = {"exact_cold", "exact_warm", "blend_first_read", "blend_0", "blend_0.15",
                "blend_0.15_disk"}
        assert set(ttft["ms"]) == {"full", *ways} and set(ttft["over_full"]) == ways
        assert all(ms > 0 for ms in ttft["ms"].values())
        assert ttft["reports"]["exact_warm"]["reused"] > 0
        assert ttft["reports"]["blend_first_read"]["reused"] == 0
        assert ttft["reports"]["blend_0"]["recomputed"] == 0 < ttft["reports"]["blend_0"]["reused"]
        assert ttft["reports"]["blend_0.15"]["recomputed"] > 0
        long = ttft["long"]  # the toys are all small: each measures the long prompt's main ways
        assert long["prompt_tokens"] > ttft["prompt_tokens"]
        assert set(long["ms"]) == {"full", "exact_warm", "blend_first_read", "blend_0.15"}
    assert set(report["summary"]["passage_ttft_over_full"]) == {
        "physics/tiny-a", "physics/tiny-b", "physics/tiny-c"}


def frozen_budget(total_s: float):
    """A budget whose clock stays at 0 s: whether a section fits never depends on the machine's
    speed."""
    from shared_core.bench.system.gpu_sections import Budget

    class Frozen(Budget):
        def elapsed(self) -> float:
            return 0.0

    return Frozen(total_s)


def test_one_worker_runs_every_section_here_in_order(tmp_path: Path) -> None:
    """``--workers 1`` (the default off CUDA): no process is spawned and nothing is warmed."""
    from shared_core.bench.__main__ import main

    assert main(["gpu", "--device", "cpu", "--tiny", "--only-correctness", "--dtypes", "fp32",
                 "--workers", "1", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_report.json").read_text(encoding="utf-8"))
    assert list(report["sections"]) == ["correctness/tiny-a/fp32"]
    assert report["sections"]["correctness/tiny-a/fp32"]["status"] == "ok"
    assert "side_by_side" not in report


def test_a_section_over_budget_is_skipped_and_recorded(tmp_path: Path) -> None:
    from shared_core.bench.system.gpu_sections import Report, Section

    report = Report(tmp_path, {}, frozen_budget(1.0))
    report.section(Section("slow", 5.0, lambda: {"never": True}))
    report.section(Section("failing", 0.0, lambda: {"x": 1 / 0}))
    data = json.loads((tmp_path / "gpu_report.json").read_text(encoding="utf-8"))
    assert data["sections"]["slow"]["status"] == "skipped: budget"
    assert data["summary"]["aims"]["every_section_ran"] is False
    failed = data["sections"]["failing"]
    assert failed["status"] == "error" and failed["error"]["type"] == "ZeroDivisionError"


def test_sections_side_by_side_queue_within_the_budget_and_survive_a_dead_worker(
        tmp_path: Path) -> None:
    """Two workers and a 9 s budget: sections of 4 s and 6 s start at once, the next 4 s one
    waits for the first worker (4 + 4 <= 9), a last 4 s one would end at 10 on either. A worker
    that dies (a native crash) fails its own sections only: the other worker's come back."""
    from functools import partial

    from shared_core.bench.system.gpu_sections import Report, Section

    report = Report(tmp_path, {}, frozen_budget(9.0))
    report.run_concurrently([
        Section("dies", 4.0, partial(os._exit, 3)),
        Section("lives", 6.0, partial(dict, value=1)),
        Section("queued", 4.0, partial(dict, value=2)),
        Section("too_late", 4.0, partial(dict, value=3)),
    ], workers=2)
    sections = json.loads((tmp_path / "gpu_report.json").read_text(encoding="utf-8"))["sections"]
    assert list(sections) == ["dies", "lives", "queued", "too_late"]  # recorded in plan order
    assert sections["dies"]["status"] == "error"
    assert sections["dies"]["error"]["type"] == "BrokenProcessPool"
    assert sections["lives"]["status"] == "ok" and sections["lives"]["value"] == 1
    # "queued" went to the worker that was to be free first: the one that died
    assert sections["queued"]["status"] == "error"
    assert sections["too_late"] == {"status": "skipped: budget", "estimate_s": 4.0}
    assert report.data["side_by_side"]["lanes"] == [["dies", "queued"], ["lives"]]


@pytest.fixture(scope="module")
def bf16_target():
    import torch

    from shared_core.bench.system.gpu_models import TINY_SHAPES, bench_tokenizer, build_lm

    return build_lm(TINY_SHAPES["tiny-a"], bench_tokenizer(), torch.device("cpu"), torch.bfloat16)


def test_a_passage_comparison_replays_its_divergence_without_the_cache(bf16_target,
                                                                       tmp_path: Path) -> None:
    """Where a passage-cache run parts from its reference, the margin is read from the
    reference's own forwards: the replay must not be served by the cache under test."""
    from shared_core.bench.system import gpu_passages as gp

    passages = gp.passages_of(bf16_target, gp.CHECK_RAG, seed=11)
    ids = gp.rag_prompt(bf16_target, passages, [0, 1, 2], gp.QUESTIONS[0])
    with gp.cached(bf16_target, "exact", 0.0, passages, tmp_path) as cache:
        reference, report = gp._decode(bf16_target, ids, 4)
        last = cache.last
        ours = [*reference[:2], (reference[2] + 1) % bf16_target.vocab_size, reference[3]]
        comparison = gp._compare(bf16_target, "planted", ours, reference, ids, report)
        assert comparison.detail["divergence"]["at"] == 2
        assert cache.last is last  # no prefill went through the cache
        assert bf16_target.model.passage_cache is cache  # put back
    assert bf16_target.model.passage_cache is None


def test_divergence_margin_replays_the_reference_step_and_reports_the_tie(bf16_target) -> None:
    from shared_core.bench.system.gpu_checks import divergence_margin
    from shared_core.engines.baseline import autoregressive_generate
    from shared_core.runtime.lm import clear_prefix_cache

    prompt = "Paris is the capital of France. Berlin is"
    clear_prefix_cache(bf16_target)
    reference = autoregressive_generate(bf16_target, prompt, 8).token_ids
    assert divergence_margin(bf16_target, prompt, reference, reference, 4) is None
    for at in (0, 3):
        ours = [*reference[:at], (reference[at] + 1) % 300, *reference[at + 1 :]]
        d = divergence_margin(bf16_target, prompt, reference, ours, 4)
        assert d is not None and d["at"] == at and d["k"] == 4
        assert (d["reference_token"], d["our_token"]) == (reference[at], ours[at])
        # the very forward the reference took: its token is the argmax, bf16 or not
        assert d["lead_one_token"] >= d["top2_margin"] >= 0
        assert d["max_abs_dlogit"] >= 0 and 0 <= d["argmax_k_token"] < 512


def test_rapid_check_reports_where_and_by_what_margin_it_parts(bf16_target) -> None:
    from shared_core.bench.system.gpu_checks import check_rapid

    comparisons = check_rapid(bf16_target, bf16_target, 6)
    assert len(comparisons) == 4
    for c in comparisons:
        if c.equal:
            assert c.detail["divergence"] is None
        else:  # a tie flipped by bf16 (measured, never asserted): where, and by how much
            assert c.detail["divergence"]["at"] == c.first_divergence


def test_sections_run_most_valuable_first() -> None:
    import torch

    from shared_core.bench.system.gpu import plan
    from shared_core.bench.system.gpu_models import SHAPES

    order = [(name, kind, dtype) for name, kind, _, dtype in plan(
        SHAPES, list(SHAPES), ["fp32", "bf16", "bf16-exact"], only_correctness=False)]
    assert order == [("correctness/qwen2.5-0.5b/fp32", "correctness", torch.float32),
                     ("correctness/qwen2.5-0.5b/bf16", "correctness", torch.bfloat16),
                     ("correctness/qwen2.5-0.5b/bf16-exact", "exact", torch.bfloat16),
                     ("physics/qwen2.5-1.5b", "physics", None),
                     ("physics/qwen2.5-7b", "physics", None),
                     ("correctness/llama-qwen2.5-0.5b/bf16", "equality", torch.bfloat16),
                     ("physics/qwen2.5-0.5b", "physics", None)]
    assert [n for n, *_ in plan(SHAPES, list(SHAPES), ["bf16"], only_correctness=True)] == [
        "correctness/qwen2.5-0.5b/bf16"]


@pytest.mark.parametrize(("flag", "value"), [("--budget-s", "0"), ("--workers", "0")])
def test_bad_settings_are_refused_naming_the_flag_before_any_model_work(tmp_path: Path, flag: str,
                                                                         value: str) -> None:
    from shared_core.bench.__main__ import build_parser
    from shared_core.bench.system.gpu import run

    args = build_parser().parse_args(["gpu", "--device", "cpu", "--tiny", "--out",
                                      str(tmp_path), flag, value])
    with pytest.raises(ValueError, match=flag):
        run(args)
    assert not (tmp_path / "gpu_report.json").exists()  # refused before the report began


def planned_on_cuda(shapes: list[str], dtypes: list[str]) -> list:
    """The check's plan at the real shapes with CUDA's estimates, as ``run`` builds it (no model
    is built: a section is a call not made yet)."""
    import torch

    from shared_core.bench.system.gpu import Sizes, plan, section_of
    from shared_core.bench.system.gpu_models import SHAPES

    cuda = torch.device("cuda")
    return [(kind, section_of(name, kind, shape, dtype, None, cuda, Sizes(), False),
             section_of(f"warm/{shape.name}", "warm", shape, None, None, cuda, Sizes(), False)
             if kind == "physics" else None)
            for name, kind, shape, dtype in plan(SHAPES, shapes, dtypes, only_correctness=False)]


def names(sections: list) -> list[str]:
    return [s.name for s in sections]


def test_the_budget_keeps_sections_in_order_of_value_side_by_side_or_not() -> None:
    """The default run: the correctness sections and the warm-ups of the physics that fits run
    side by side, the 1.5B and 7B physics after them; the 0.5B physics (least value) neither
    runs nor is warmed. A 7B-only run: the 7B equality sections (~300-420 s estimated) would
    push the 7B physics out of the budget if they ran side by side regardless; they are the
    ones left out."""
    from shared_core.bench.system.gpu import schedule

    default = schedule(planned_on_cuda(["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b"],
                                       ["fp32", "bf16"]), 350.0, 0.0)
    assert names(default.side_by_side) == [
        "correctness/qwen2.5-0.5b/fp32", "correctness/qwen2.5-0.5b/bf16", "warm/qwen2.5-1.5b",
        "warm/qwen2.5-7b", "correctness/llama-qwen2.5-0.5b/bf16"]
    assert names(default.timed) == ["physics/qwen2.5-1.5b", "physics/qwen2.5-7b"]
    assert names(default.skipped) == ["physics/qwen2.5-0.5b"]
    only_7b = schedule(planned_on_cuda(["qwen2.5-7b"], ["bf16"]), 350.0, 0.0)
    assert names(only_7b.timed) == ["physics/qwen2.5-7b"]
    assert names(only_7b.side_by_side) == ["warm/qwen2.5-7b"]
    assert names(only_7b.skipped) == ["correctness/qwen2.5-7b/bf16",
                                      "correctness/llama-qwen2.5-7b/bf16"]
    assert names(schedule(planned_on_cuda(["qwen2.5-7b"], ["bf16"]), 350.0, 400.0).skipped) == [
        "correctness/qwen2.5-7b/bf16", "physics/qwen2.5-7b", "correctness/llama-qwen2.5-7b/bf16"]


def test_interleaved_rates_alternate_the_runs_and_report_the_median_ratio(monkeypatch) -> None:
    import torch

    from shared_core.bench.system import gpu_decode

    clock = [0.0]
    calls: list[str] = []
    costs = {"ours": [9.0, 2.0, 2.2, 1.9], "generate": [9.0, 2.0, 2.0, 2.0]}  # warm-up first

    def run(name: str) -> None:
        clock[0] += costs[name][sum(c == name for c in calls)]
        calls.append(name)

    monkeypatch.setattr(gpu_decode.time, "perf_counter", lambda: clock[0])
    out = gpu_decode.interleaved_rates({"ours": lambda: run("ours"), "generate": lambda: run("generate")},
                                torch.device("cpu"), tokens=10, repeats=3)
    assert calls == ["ours", "generate"] * 4
    assert out["ours"]["runs_ms"] == [2000.0, 2200.0, 1900.0]  # the warm-up left out,
    assert out["ours"]["warmup_ms"] == [9000.0]  # and reported on its own (a compile shows)
    assert out["ours"]["ms"] == 2000.0 and out["ours"]["tok_s"] == 5.0
    ratio = out["ratios"]["ours_over_generate"]  # generate's time over ours, pair by pair
    assert ratio == {"median": 1.0, "min": 0.909, "max": 1.053, "repeats": 3}


def test_interleaved_rates_record_a_failing_run_and_time_the_others() -> None:
    import torch

    from shared_core.bench.system.gpu_decode import interleaved_rates

    def broken() -> None:
        raise RuntimeError("static cache refused")

    out = interleaved_rates({"ours": lambda: None, "generate": broken}, torch.device("cpu"), 4, 3)
    assert len(out["ours"]["runs_ms"]) == 3
    assert out["generate"] == {"error": "RuntimeError: static cache refused"}
    assert out["ratios"] == {}


def test_divergences_are_judged_against_one_ulp_of_the_sections_dtype() -> None:
    import torch

    from shared_core.bench.system.gpu_checks import at_tie, spacing
    from shared_core.bench.system.gpu_report import divergences_at_ties

    assert spacing(20.0, torch.bfloat16) == 0.125 and spacing(-12.0, torch.bfloat16) == 0.0625
    assert spacing(20.0, torch.float32) == 2.0**-19
    assert at_tie({"top2_margin": 0.125, "top_logit": 20.0}, torch.bfloat16)
    assert not at_tie({"top2_margin": 0.125, "top_logit": 12.0}, torch.bfloat16)  # two ulps

    def comparison(check: str, equal: bool, divergence: dict | None) -> dict:
        return {"check": check, "equal": equal, "detail": {"divergence": divergence}}

    tie = {"top2_margin": 0.0, "top_logit": 17.5}
    models = {"dtype": "torch.bfloat16"}
    comparisons: list[dict] = [
        comparison("prompt_lookup", False, tie), comparison("rapid_eta0/self", False,
                                                           {**tie, "top2_margin": 0.125}),
        comparison("respec_strict/none", True, None),
        {"check": "constrained/xgrammar_json", "equal": False, "detail": {"skipped": "x"}}]
    section = {"models": models, "comparisons": comparisons}
    judged = divergences_at_ties(section)
    assert judged["verdict"].startswith("not batch-invariant") and judged["at_ties"] == 2
    models["dtype"] = "torch.float32"  # 0.125 is far past an fp32 ulp; 0 is a tie
    judged = divergences_at_ties(section)
    assert judged["verdict"].startswith("a bug") and judged["at_ties"] == 1
    assert judged["beyond_a_tie"] == ["rapid_eta0/self"] and not judged["all_at_ties"]
    comparisons.append(comparison("draft_model/perturbed/k4", False, None))
    assert divergences_at_ties(section)["unexamined"] == ["draft_model/perturbed/k4"]


def test_references_are_decoded_once_and_serve_shorter_lengths(bf16_target) -> None:
    from shared_core.bench.system.gpu_checks import References
    from shared_core.engines.baseline import autoregressive_generate

    prompt = "Paris is the capital of France. Berlin is"
    refs = References(bf16_target)
    long = refs.greedy(prompt, 8)
    assert refs.greedy(prompt, 5) == long[:5] == autoregressive_generate(
        bf16_target, prompt, 5).token_ids
    assert refs.decoded == 8
    masked = refs.greedy(prompt, 5, mask_key="one", make_mask=lambda: _OnlyToken(7))
    assert masked == [7] * 5 and refs.decoded == 13


class _OnlyToken:
    def __init__(self, token: int) -> None:
        self.token = token

    def mask(self, logits, drafted):
        import torch

        out = torch.full_like(logits, float("-inf"))
        out[:, self.token] = logits[:, self.token]
        return out

    def commit(self, tokens) -> None:
        del tokens

    def is_terminated(self) -> bool:
        return False


def test_the_exact_section_holds_at_the_cuda_width(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dry run's exact section runs at the CPU's width (16); on CUDA every forward has 64
    rows, so a prompt chunk, a tree and a verification sit differently in the padded forward:
    the same equalities at 64 rows, on the CPU."""
    import torch

    from shared_core.bench.system import gpu
    from shared_core.bench.system.gpu_models import TINY_SHAPES, bench_tokenizer
    from shared_core.runtime.torch.exact import EXACT_WIDTH, EXACT_WIDTH_CUDA

    assert EXACT_WIDTH_CUDA != EXACT_WIDTH
    monkeypatch.setattr(gpu, "width_for", lambda device: EXACT_WIDTH_CUDA)
    section = gpu.correctness(TINY_SHAPES["tiny-a"], bench_tokenizer(), torch.device("cpu"),
                              torch.bfloat16, gpu.Sizes.tiny(), with_sampling=False, exact=True)
    assert section["errors"] == {} and section["models"]["exact_width"] == EXACT_WIDTH_CUDA
    compared = [c for c in section["comparisons"] if "skipped" not in c["detail"]]
    assert {c["check"].split("/")[0] for c in compared} >= {
        "draft_model", "prompt_lookup", "respec_strict", "rapid_eta0", "ralmspec",
        "speculative_rag", "passage_cache"}
    for c in compared:
        assert c["equal"] and c["first_divergence"] is None, c
