"""Importing the adapter packages (and resolving their lazy names) must not import torch."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHECK = """
import sys
import {package}
{touch}
heavy = [m for m in ("torch", "transformers") if m in sys.modules]
assert not heavy, heavy
"""


@pytest.mark.parametrize(("package", "touch"), [
    ("langchain_specrag", ""),
    ("llamaindex_specrag", ""),
    ("langchain_specrag", "from langchain_specrag.chat_models.speculative import ChatSpeculative;"
                          " ChatSpeculative()"),
    ("llamaindex_specrag", "from llamaindex_specrag.llms.speculative import SpeculativeLLM;"
                           " SpeculativeLLM()"),
])
def test_adapters_leave_torch_out(package: str, touch: str) -> None:
    code = CHECK.format(package=package, touch=touch)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
