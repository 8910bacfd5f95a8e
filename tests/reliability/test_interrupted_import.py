"""Ctrl-C while the first model load imports torch (the adapters import no torch, so a server's
first request does): the interrupt comes after the import, and the process keeps working. Run in
a child process, where torch is not imported yet."""

from __future__ import annotations

import subprocess
import sys
import textwrap

CHILD = textwrap.dedent("""
    import builtins, os, signal

    real_import = builtins.__import__
    imports, fired = [0], []

    def interrupting(name, *args, **kwargs):
        if name.startswith("torch"):  # torch imports itself and its parts thousands of times
            imports[0] += 1
            if imports[0] == 300:  # half-way: parts registered, others not yet
                fired.append(name)
                os.kill(os.getpid(), signal.SIGINT)
        return real_import(name, *args, **kwargs)

    from shared_core.util.device import resolve_device

    builtins.__import__ = interrupting
    try:
        resolve_device("cpu")  # the first model load's first torch call
        print("not interrupted")
    except KeyboardInterrupt:
        print("interrupted", bool(fired))
    builtins.__import__ = real_import
    import torch

    print("usable", float((torch.ones(3) * 2).sum()), resolve_device("cpu"))
""")


def test_ctrl_c_during_the_first_torch_import_leaves_torch_usable() -> None:
    child = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                           timeout=300, check=False)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.split("\n")[:2] == ["interrupted True", "usable 6.0 cpu"], child.stdout
