"""Every ``results/...`` path cited in the code, docs, scripts and README exists; ``results/``
holds data only (no code) and its index is up to date."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from shared_core.bench.results_index import build_index

ROOT = Path(__file__).resolve().parents[2]
SUFFIXES = {".py", ".md", ".toml", ".sh", ".txt", ".cfg"}
_TOKEN = re.compile(r"(?<![\w/.-])results/[\w./{},*-]*[\w/}*]")
# where a command writes (an output location, not a citation)
_OUTPUT = re.compile(r"(--out[\s=]\"?|default=\"|OUT:-|\(default |^)$")


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout
    return [p for p in out.split("\0") if p]


def _expand(token: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", token)
    if not m:
        return [token]
    return [x for alt in m[1].split(",") for x in _expand(token[:m.start()] + alt + token[m.end():])]


def cited_paths() -> list[tuple[str, str]]:
    """(file, cited path or pattern) for every citation outside results/."""
    cited = []
    for rel in _tracked():
        path = ROOT / rel
        if rel.startswith("results/") or path.suffix not in SUFFIXES or not path.is_file():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for m in _TOKEN.finditer(text):
            before = text[max(0, m.start() - 12):m.start()]
            if _OUTPUT.search(before):
                continue
            cited.append((rel, m[0]))
    return cited


def test_every_cited_results_path_exists() -> None:
    missing = []
    for rel, token in cited_paths():
        for pattern in _expand(token.rstrip("/")):
            if not list(ROOT.glob(pattern)):
                missing.append(f"{rel}: {token}")
                break
    assert len(cited_paths()) > 10, "the scan found too few citations; is it reading the tree?"
    assert not missing, "cited results paths that do not exist:\n" + "\n".join(sorted(set(missing)))


def test_results_hold_no_code() -> None:
    code = [p for p in _tracked() if p.startswith("results/") and p.endswith(".py")]
    assert not code, f"results/ is data only; move these into the bench: {code}"


def test_results_index_is_up_to_date() -> None:
    index = (ROOT / "results" / "README.md").read_text(encoding="utf-8")
    assert index == build_index(ROOT / "results"), \
        "results/README.md is stale: run `python -m shared_core.bench results-index`"


def test_results_index_writes_to_out_when_given(tmp_path: Path) -> None:
    """``results-index --out FILE`` writes the index there, not over results/README.md."""
    from shared_core.bench.__main__ import main

    before = (ROOT / "results" / "README.md").stat().st_mtime_ns
    assert main(["results-index", "--out", str(tmp_path / "index.md")]) == 0
    assert (tmp_path / "index.md").read_text(encoding="utf-8") == build_index(ROOT / "results")
    assert (ROOT / "results" / "README.md").stat().st_mtime_ns == before


def test_inputs_only_a_checkout_has_are_error_lines_not_tracebacks(monkeypatch, tmp_path, capsys
                                                                   ) -> None:
    """An installed package has no evaluation data, results/ or examples/: the CLI says so in
    one error line (exit 2) naming what is missing and how to point at it; ``--plot`` without
    matplotlib is refused before the run, not after it."""
    import importlib.util

    from shared_core.bench import __main__ as bench_cli
    from shared_core.bench.chat import sources

    def refused(argv: list[str], *words: str) -> None:
        assert bench_cli.main(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and all(w in err for w in words), err

    refused(["results-index", "--results", str(tmp_path / "none")], "--results", "checkout")
    monkeypatch.setenv("SPECRAG_DATA_DIR", str(tmp_path / "no-data"))
    refused(["retrieval"], "evaluation data not found", "SPECRAG_DATA_DIR")
    monkeypatch.setattr(sources, "AGENT_EXAMPLE", tmp_path / "agents.py")
    monkeypatch.setattr("shared_core.bench.chat.AGENT_EXAMPLE", tmp_path / "agents.py")
    refused(["chat", "--sources", "agent", "--models", "smollm2-135m-instruct"],
            "--sources agent", "examples/")
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    refused(["results-index", "--results", str(tmp_path), "--plot", str(tmp_path / "p.png")],
            "--plot", "specrag[bench]")
