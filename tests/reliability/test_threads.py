"""CPU thread defaults (issue 19 row 20): passive OpenMP waiting unless the user chose, and an
explicit, validated thread-count override recorded in stats."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shared_core.decoding.decode_stats import DecodeStats
from shared_core.util.device import THREADS_ENV, apply_thread_setting

REPO = Path(__file__).resolve().parents[2]


def _policy_after(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code + "\nimport os; print(os.environ.get("
                          "'OMP_WAIT_POLICY'))"], env={**clean, "PYTHONPATH": str(REPO), **env},
                         capture_output=True, text=True, check=True, timeout=120)
    return out.stdout.strip().splitlines()[-1]


def test_importing_shared_core_first_makes_openmp_wait_passively():
    assert _policy_after("import shared_core") == "PASSIVE"


def test_a_users_policy_is_kept():
    assert _policy_after("import shared_core", OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"


def test_nothing_is_pretended_when_torch_was_imported_first():
    # OpenMP already read its environment: setting the variable then would be a lie
    assert _policy_after("import torch\nimport shared_core") == "None"


def test_thread_override_is_applied_validated_and_reported(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.setenv(THREADS_ENV, "1")
        assert apply_thread_setting() == 1 == torch.get_num_threads()
        assert DecodeStats().as_dict()["threads"] == 1
        for bad in ("zero", "0", "-2"):
            monkeypatch.setenv(THREADS_ENV, bad)
            with pytest.raises(ValueError, match=THREADS_ENV):
                apply_thread_setting()
    finally:
        torch.set_num_threads(before)
