"""The thread count a llama.cpp model gets on a busy machine, and ``stats`` saying so.

ggml's workers spin at barriers, so a worker descheduled by another process stalls the rest:
the count is the usable CPUs less those the load average says are taken, at least one.
"""

from __future__ import annotations

import pytest

from shared_core.decoding.decode_stats import DecodeStats
from shared_core.runtime.llamacpp.threads import choose_threads
from shared_core.util import device


@pytest.mark.parametrize(("cpus", "load", "threads"), [
    (2, 0.0, 2), (2, 0.4, 2), (2, 0.6, 1), (2, 1.0, 1), (2, 9.3, 1), (16, 3.2, 13), (1, 0.0, 1),
])
def test_threads_are_the_cpus_other_processes_leave_free(cpus, load, threads):
    choice = choose_threads(None, cpus=cpus, load=load)
    assert choice.threads == threads
    assert f"{load:.2f}" in choice.policy


def test_an_asked_count_is_kept_whatever_the_load():
    assert choose_threads(2, cpus=2, load=9.0).threads == 2
    assert choose_threads(2, cpus=2, load=9.0).policy == "asked for"


def test_stats_report_the_thread_policy(monkeypatch):
    monkeypatch.setattr(device, "_THREAD_POLICY", {})
    assert DecodeStats().as_dict()["thread_policy"] is None
    device.note_thread_policy("llama.cpp", "1 thread, 1 of 2 usable CPUs: load 1.20 at load time")
    assert DecodeStats().as_dict()["thread_policy"] == (
        "llama.cpp: 1 thread, 1 of 2 usable CPUs: load 1.20 at load time")
