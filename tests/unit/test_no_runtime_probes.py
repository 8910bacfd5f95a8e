"""Engines ask a model or a session through the runtime protocol (``shared_core.runtime``), never by
probing attributes: no ``getattr`` / ``hasattr`` on an LM, a session or a model's internals inside
``shared_core/engines``. Every module there is parsed with :mod:`ast`; a probe is a call of
``getattr`` or ``hasattr`` whose first argument names an LM or a session (a name or attribute
``lm``, ``*_lm``, ``session``, ``*_session``, ``model``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINES = ROOT / "shared_core" / "engines"
_RUNTIME_NAME = re.compile(r"^(lm|\w+_lm|session|\w+_session|model)$")


def _names(node: ast.expr) -> list[str]:
    """The identifiers of a dotted expression (``self.session.lm`` -> self, session, lm)."""
    if isinstance(node, ast.Attribute):
        return [*_names(node.value), node.attr]
    if isinstance(node, ast.Name):
        return [node.id]
    if isinstance(node, ast.Call):
        return _names(node.func)
    return []


def probes(source: str) -> list[str]:
    """``line: call`` for every getattr / hasattr on an LM or a session in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr") and node.args
                and any(_RUNTIME_NAME.match(n) for n in _names(node.args[0]))):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_engines_do_not_probe_models_or_sessions() -> None:
    files = sorted(ENGINES.rglob("*.py"))
    assert len(files) > 20, "found too few engine modules; is the path right?"
    found = {str(p.relative_to(ROOT)): hits for p in files
             if (hits := probes(p.read_text(encoding="utf-8")))}
    assert not found, ("ask the runtime protocol (shared_core.runtime.protocol: methods and "
                       f"Capabilities) instead of probing: {found}")


def test_the_checker_finds_probes_and_passes_other_getattrs() -> None:
    source = "\n".join([
        'x = getattr(lm, "served", False)',
        'y = hasattr(self.lm.model, "get_decoder")',
        'z = getattr(self.session, "reused_tokens", 0)',
        'w = getattr(draft_lm.model.config, "softcap", None)',
        'v = getattr(run.session, "forwards")',
        'u = hasattr(model, "get_decoder")',
        'ok = getattr(self, name)',
        'ok2 = hasattr(retriever, "search")',
        'ok3 = getattr(importlib.import_module(module), attr)',
        'ok4 = setattr(target, name, getattr(target, name) + 1.0)',
    ])
    assert [hit.split(":")[0] for hit in probes(source)] == ["1", "2", "3", "4", "5", "6"]
