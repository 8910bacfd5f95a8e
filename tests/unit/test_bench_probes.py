"""``python -m shared_core.bench probe-*``: argument parsing, bad input, and tiny smoke runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny import measured

from shared_core.bench.__main__ import build_parser
from shared_core.bench.__main__ import main as bench_main

PROBES = ("probe-dtype", "probe-contention", "probe-verify")


@pytest.mark.parametrize("probe", PROBES)
def test_help_lists_the_probe_options(probe: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([probe, "--help"])
    assert exit_info.value.code == 0
    assert "--threads" in capsys.readouterr().out


def test_console_script_reaches_the_probes(capsys: pytest.CaptureFixture[str]) -> None:
    from shared_core.tools.cli import main as cli_main

    with pytest.raises(SystemExit) as exit_info:
        cli_main(["bench", "probe-verify", "--help"])
    assert exit_info.value.code == 0
    assert "--span-start" in capsys.readouterr().out


@pytest.mark.parametrize("value", ["0", "-3"])
def test_demo_refuses_a_token_limit_below_one_before_any_model_work(
        value: str, capsys: pytest.CaptureFixture[str]) -> None:
    from shared_core.tools.cli import main as cli_main

    with pytest.raises(SystemExit) as exit_info:
        cli_main(["demo", "--max-new-tokens", value])
    assert exit_info.value.code == 2
    assert f"argument --max-new-tokens: must be >= 1, got {value}" in capsys.readouterr().err


def test_defaults_are_the_recorded_measurements() -> None:
    """The defaults reproduce the settings behind results/system/2026-11-22/dtype.json, contention4m.json and
    rapid/s5_verify_profile.txt."""
    parser = build_parser()
    dtype = parser.parse_args(["probe-dtype"])
    assert (dtype.models, dtype.dtypes, dtype.prompt_tokens, dtype.prefill, dtype.decode_steps) \
        == ("smollm2-135m-instruct,gemma-3-270m", "float32,bfloat16", 1200, 600, 32)
    cont = parser.parse_args(["probe-contention", "--dtype", "bfloat16"])
    assert (cont.vectors, cont.dim, cont.queries, cont.k, cont.context, cont.search) \
        == (4_000_000, 384, 3, 28, 1200, "blocked")
    verify = parser.parse_args(["probe-verify"])
    assert (verify.context, verify.shared_context, verify.head, verify.span_start,
            verify.tokens) == (7900, 2100, 100, 3000, "2,4,9")
    with pytest.raises(SystemExit):
        parser.parse_args(["probe-contention", "--search", "faiss"])


def _run(argv: list[str], tmp_path: Path) -> dict:
    out = tmp_path / "report.json"
    assert bench_main([*argv, "--threads", "1", "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_dtype_probe_smoke(tiny_model_folder: str, tmp_path: Path) -> None:
    report = _run(["probe-dtype", "--models", tiny_model_folder, "--dtypes", "float32",
                   "--prompt-tokens", "48", "--prefill", "16", "--decode-steps", "2"], tmp_path)
    row = report["models"][f"{tiny_model_folder}/float32"]
    assert measured(row["prompt_48_tokens_s"], row["decode_ms_per_token_at_16"])
    assert report["threads"] == 1


@pytest.mark.parametrize("search", ["blocked", "gemm"])
def test_contention_probe_smoke(tiny_model_folder: str, tmp_path: Path, search: str) -> None:
    report = _run(["probe-contention", "--model", tiny_model_folder, "--context", "16",
                   "--vectors", "500", "--dim", "8", "--k", "4", "--search", search,
                   "--decode-steps", "2", "--search-repeats", "2"], tmp_path)
    for part in ("alone", "concurrent"):
        assert measured(report[part]["decode_ms"], report[part]["search_ms"])


def test_verify_probe_smoke(tiny_model_folder: str, tmp_path: Path) -> None:
    report = _run(["probe-verify", "--model", tiny_model_folder, "--context", "64",
                   "--shared-context", "24", "--head", "4", "--span-start", "20",
                   "--tokens", "2,3", "--step-repeats", "2", "--verify-repeats", "2"], tmp_path)
    assert measured(report["step_ms_copy_positions_24"], report["verify_3_ms_at_64"])
    assert "Self CPU" in report["profile"]


def test_verify_probe_rejects_positions_outside_the_context(tiny_model_folder: str) -> None:
    # the model is named (checked to exist) but never loaded: the positions check comes first
    with pytest.raises(ValueError, match="--span-start 10"):
        bench_main(["probe-verify", "--model", tiny_model_folder, "--head", "50",
                    "--span-start", "10"])
    with pytest.raises(ValueError, match="inside --context 64"):
        bench_main(["probe-verify", "--model", tiny_model_folder, "--context", "64"])
