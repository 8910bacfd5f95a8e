"""RAPID: long-context inference with retrieval-augmented speculative decoding.

Chen et al., "RAPID: Long-Context Inference with Retrieval-Augmented Speculative Decoding"
(ICML 2025); reference code ``John-AI-Lab/RAPID``. The long context is chunked (512 tokens) and
the chunks most similar to the query are retrieved (cosine, threshold 0.3, at least
``max(floor, context / λ)`` tokens) and re-sorted into document order. A drafter (the target
itself by default: self-speculation; or any same-vocabulary model) drafts γ tokens on
``[retrieved context; query; generated]``; the target verifies them in one forward on
``[full context; query; generated]``. Acceptance uses the retrieval-augmented target

    p̂ = softmax(z/T + η(q − p))   (tail where p̂ < α·max p̂ keeps p),  accept w.p. min(1, p̂/q),
    residual norm(max(0, max(p − q, p − p̂)))   (see ``shared_core.decoding.verify``, section RAPID).

With ``eta == 0`` this is lossless speculative decoding (output identical to the target alone);
with ``eta > 0`` the engine samples from the modified distribution p̂, not from the target.

The long context's KV is computed once: the target session is kept between calls and
:meth:`KVSession.sync` rolls it back to the common token prefix (the document), so asking many
questions about one document pays its prefill once. Baselines in this module: ``long_context``
(target alone on the full context), ``rag`` (target on the retrieved context only) and ``sd``
(naive speculative decoding, η = 0).

Sharing a decoder (threads, interleaved streams). Every generation checks out its own set of
sessions (target, drafters, RAG baseline: a ``Slot``) when its first step runs and returns it
when it ends, fails or is closed; a finished slot stays cached (``max_idle_slots``) for the next
question's prefix reuse. A stream opened while another is still open gets a new slot whose
target cache is a copy of the open one's (no second prefill), so the old stream continues with
its own output instead of being cut short; each open stream holds its own KV copy, so memory
grows with the number of streams open at once. One lock per decoder (reentrant) serialises
retrieval, slot bookkeeping and every engine step; :meth:`RapidDecoder.generate` holds it for
the whole call, so threads calling ``generate`` queue and share one cached context. An
interrupted step (exception, ``KeyboardInterrupt``) leaves the session consistent
(:meth:`KVSession.heal`) and the next question re-syncs to its prefix.
"""

from __future__ import annotations

from shared_core.config.tokens import DRAFTER_KV, RapidConfig, check_eta

# prompts (per-question prompts, stats), context (chunk index, retrieval, prompt building),
# rounds (the RAPID round, γ schedule), engine (RapidDecoder: slots, baselines, streams), entry
# (the registry's start_rapid, and stream_rapid with loose arguments).
from shared_core.engines.rapid.engine import RapidDecoder
from shared_core.engines.rapid.entry import split_prompt, start_rapid, stream_rapid
from shared_core.engines.rapid.prompts import METHODS, RapidPrompt, RapidStats

__all__ = [
    "DRAFTER_KV",
    "METHODS",
    "RapidConfig",
    "RapidDecoder",
    "RapidPrompt",
    "RapidStats",
    "check_eta",
    "split_prompt",
    "start_rapid",
    "stream_rapid",
]
