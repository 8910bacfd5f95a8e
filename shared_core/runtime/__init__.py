"""Runtimes behind one protocol (:mod:`.protocol`): what engines ask of a model and its KV
session, the capabilities that differ by design, and the torch runtime's batched rows
(:mod:`.torch_batch`, the sibling of :mod:`shared_core.runtime.llamacpp.batch`)."""

from shared_core.runtime.protocol import (
    Capabilities,
    KVSession,
    ModelLM,
    ServedLM,
    SessionLM,
    open_session,
)

__all__ = ["Capabilities", "KVSession", "ModelLM", "ServedLM", "SessionLM", "open_session"]
