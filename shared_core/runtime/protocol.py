"""The runtime protocol: what an engine may ask of a model and of its KV session.

A runtime (torch: :class:`shared_core.runtime.lm.LM` with
:class:`shared_core.runtime.torch.session.KVSession`; llama.cpp:
:class:`shared_core.runtime.llamacpp.lm.LlamaCppLM` with its session) implements :class:`SessionLM`
and :class:`KVSession`; a served model (:class:`shared_core.runtime.remote.RemoteLM`) implements
:class:`ServedLM`, which has no session. Every model offers :class:`ModelLM`: tokenizer-level
facts and Speculative RAG's rows (greedy drafts decoded together, span log-probabilities scored
together). What differs between runtimes by design is a typed field of :class:`Capabilities`,
which engines read instead of probing attributes; ``tests/conformance/test_runtimes.py`` is
the contract every runtime passes. The ``check_*`` functions are the argument checks every
:class:`KVSession` shares (each runtime adds its own limits after them).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, Self, runtime_checkable

from shared_core.config import DEFAULT_CACHE, CacheKind

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from shared_core.config import SamplingConfig
    from shared_core.runtime.remote.protocol import Generation

Row = tuple[list[int], list[float]]  # a generated row: new ids, log P of each under the model
StopRule = Callable[[int, list[int]], bool]  # (row, its ids so far) -> the row ends here
Spans = Sequence[Sequence[tuple[int, int]]]  # per row, (start, end) token spans to score
CostCurve = tuple[tuple[int, float], ...]  # (tokens, one-token steps) of one forward


@dataclass(frozen=True)
class Capabilities:
    """What a runtime offers beyond the methods every runtime has.

    ``batch_invariant``: a k-token ``extend`` gives bit for bit the logits of k one-token steps
    (else only to rounding), for decodes of fewer than ``invariant_tokens`` tokens where that is
    set (llama.cpp's kernels take another path from 64 rows on). ``exact_reuse``: a prefill that
    starts from a kept prefix gives bit for bit the logits of a cold one. ``prefix_reuse``: a
    fresh session's first ``prefill`` may start from KV the model kept (``reused_tokens``).
    ``any_positions``: ``copy_positions`` keeps any ascending subset (else it must keep the
    source's last token). ``hidden_states``: forward hooks can read the final hidden states
    (KNN-LM's keys). ``measured_cost``: ``forward_cost_curve()`` is the machine's measured curve
    (else None: engines fit it as they run). ``max_rows`` / ``max_tree_leaves`` / ``max_extend``:
    rows of one batched call, leaves of one tree, tokens of one ``extend`` (None: only memory and
    the window limit them). ``branch_rows_exact``: every row of an ``extend_tree`` is as exact
    as ``batch_invariant`` says; False where only the first chain's rows are (node ``i`` at
    depth ``i``: torch's exact mode, where a later branch's tokens sit in slots apart from
    their ancestors and attention sums them in another grouping), so an exact greedy walk stops
    at the first node off that chain (``verify_tree(..., first_chain_only=True)``).
    ``rollback``: a session can forget its newest tokens in place (``rollback``, ``sync``,
    ``keep_path``); every engine that verifies drafts needs it. False for a llama.cpp model with
    a recurrent state (Mamba, RWKV, hybrids such as Qwen3.5), whose session can only read its
    tokens again. ``position_shift``: cached KV can be moved to other positions (a blend
    passage cache places passages so); False for multi-axis rotary positions (M-RoPE).
    """

    batch_invariant: bool
    exact_reuse: bool
    prefix_reuse: bool
    any_positions: bool
    hidden_states: bool
    measured_cost: bool
    max_rows: int | None = None
    max_tree_leaves: int | None = None
    max_extend: int | None = None
    invariant_tokens: int | None = None
    branch_rows_exact: bool = True
    rollback: bool = True
    position_shift: bool = True


class PassageReport(Protocol):
    """Prompt ids a passage cache reused, recomputed and read in a session's first prefill."""

    def as_dict(self) -> dict[str, Any]: ...


@runtime_checkable
class KVSession(Protocol):
    """One model, one growing token sequence and its KV cache.

    ``tokens`` lists exactly the ids whose keys/values are cached. A method that raises (or is
    interrupted) leaves the session usable, ``tokens`` and the cache in agreement: after
    ``extend`` / ``extend_tree`` it holds what it held before the call; after ``prefill``, that
    plus a prefix of the new ids (torch keeps the chunks that completed; llama.cpp none).
    """

    tokens: list[int]
    forwards: int  # forwards run (prefill chunks, extends, trees)
    position_offset: int  # added to the position of every token fed from now on
    reused_tokens: int  # prompt ids the first prefill took from KV the model kept
    passage_report: PassageReport | None  # what a passage cache did in the first prefill

    def __len__(self) -> int: ...

    def prefill(self, ids: Sequence[int]) -> torch.Tensor | None:
        """Append ``ids``; the ``[V]`` logits after the last one (None if ``ids`` is empty)."""

    def extend(self, ids: Sequence[int]) -> torch.Tensor:
        """Append ``ids`` in one forward; ``[len(ids), V]`` logits, one row per new token."""

    def extend_tree(self, ids: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        """Append a token tree (``parents[i] < i``, -1: a root) in one forward; ``[n, V]``."""

    def keep_path(self, path: Sequence[int]) -> None:
        """After ``extend_tree``: keep only the nodes of ``path`` (root to leaf)."""

    def rollback(self, length: int) -> None:
        """Forget everything after the first ``length`` tokens."""

    def heal(self, limit: int | None = None) -> None:
        """Make the cache and ``tokens`` agree (at most ``limit`` tokens) after a failure."""

    def reset(self) -> None:
        """Empty the session."""

    def sync(self, ids: Sequence[int]) -> list[int]:
        """Roll back to the longest common prefix with ``ids``; the ids still to feed."""

    def fork(self) -> Self:
        """An independent copy on the same model."""

    def copy_positions(self, source: Self, positions: Sequence[int]) -> None:
        """Hold ``source``'s tokens at ``positions`` (ascending) at their source positions."""


class ModelLM(Protocol):
    """What every model offers an engine, in process or served: its tokenizer's facts and
    Speculative RAG's rows."""

    name: str
    max_context: int
    eos_token_ids: frozenset[int]
    # a transformers tokenizer: templates, decoding, chunk sizes; prompts are encoded by `encode`,
    # which a runtime with a tokenizer of its own (llama.cpp) answers with that one
    tokenizer: PreTrainedTokenizerBase

    @property
    def served(self) -> bool:
        """True for a model behind a server: no session, requests instead of forwards."""

    @property
    def has_chat_template(self) -> bool: ...

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]: ...

    def encode_offsets(self, text: str) -> tuple[list[int], list[int] | None]:
        """``text``'s ids as ``encode`` gives them and the character each starts at (None where
        the tokenizer gives no offsets)."""

    def decode(self, ids: Sequence[int]) -> str: ...

    def chat_prompt(self, messages: Sequence[dict[str, str]]) -> str: ...

    def prompt_ids(self, prompt: str | Sequence[dict[str, str]]) -> list[int]: ...

    def generate_parallel(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                          stop: StopRule, on_prefilled: Callable[[], None] | None = None
                          ) -> list[Row]:
        """Greedy continuations of every prompt, decoded together; per row (new ids, log P of
        each under the raw distribution). ``stop(row, ids)`` ends a row after its newest token;
        ``on_prefilled()`` is called once, when every prompt has been read (in process)."""

    def span_logprobs(self, rows: Sequence[Sequence[int]], spans: Spans) -> list[list[float]]:
        """Per row, the summed log P(token) over each ``(start, end)`` span, all rows scored
        together."""


class SessionLM(ModelLM, Protocol):
    """A model run in this process: it opens KV sessions and says what its runtime offers."""

    model: Any  # the runtime's own model object (read only by that runtime)
    device: torch.device
    dtype: torch.dtype
    backend_reason: str

    @property
    def backend(self) -> str:
        """The runtime's name (``"torch"``, ``"llama.cpp"``)."""

    @property
    def vocab_size(self) -> int:
        """Rows of the logits (may exceed ``len(tokenizer)`` by padding)."""

    @property
    def capabilities(self) -> Capabilities: ...

    def open_session(self, *, cache: CacheKind = DEFAULT_CACHE) -> KVSession:
        """A new, empty session (``cache``: the torch cache layout; other runtimes ignore it)."""

    def forward_cost_curve(self) -> CostCurve | None:
        """The measured cost of a forward by tokens, where the runtime measures one."""

    def describe_window(self) -> str:
        """The context limit in words, naming the setting that sets it."""

    def positions_for(self, cache: CacheKind) -> int:
        """Positions a session opened with ``cache`` can fill (at most ``max_context``)."""


@runtime_checkable
class ServedLM(ModelLM, Protocol):
    """A model behind a server (vLLM, SGLang): token ids in, token ids and log-probs out."""

    def require(self, *needs: str, by: str) -> None:
        """Raise unless the server offers every one of ``needs`` (``by``: who needs them)."""

    def generate(self, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, n: int = 1,
                 sampling: SamplingConfig | None = None, stop_token_ids: Sequence[int] = ()
                 ) -> list[list[Generation]]:
        """Per prompt, ``n`` continuations, all prompts in one request."""


def open_session(lm: SessionLM, *, cache: CacheKind = DEFAULT_CACHE) -> KVSession:
    """A new KV session on ``lm``, whatever its runtime."""
    return lm.open_session(cache=cache)


def check_extend(ids: Sequence[int]) -> None:
    """ValueError unless ``extend`` has ids to append."""
    if not ids:
        msg = "extend needs at least one token"
        raise ValueError(msg)


def check_tree(ids: Sequence[int], parents: Sequence[int]) -> None:
    """ValueError unless ``extend_tree`` has one parent per id and at least one id."""
    if len(ids) != len(parents) or not ids:
        msg = "extend_tree needs one parent per token and at least one token"
        raise ValueError(msg)


def check_tree_parent(node: int, parent: int) -> None:
    """ValueError unless tree node ``node``'s ``parent`` precedes it (called per node, in order,
    by the loop that lays out the tree)."""
    if parent >= node:
        msg = "tree parents must precede their children (parents[i] < i)"
        raise ValueError(msg)


def check_copy_source(same_model: bool) -> None:
    """ValueError unless ``copy_positions``' source session runs on the same model."""
    if not same_model:
        msg = "copy_positions needs a source session on the same model"
        raise ValueError(msg)


def check_positions(keep: Sequence[int], n_source: int) -> None:
    """ValueError unless ``copy_positions``' ``keep`` is ascending and within the source's
    ``n_source`` tokens (each runtime adds its own limits)."""
    if keep and (any(b <= a for a, b in itertools.pairwise(keep)) or keep[0] < 0
                 or keep[-1] >= n_source):
        msg = f"positions must be ascending and within the source's {n_source} tokens"
        raise ValueError(msg)


def check_session_lm(lm: object, name: str = "lm") -> None:
    """TypeError naming ``name`` unless ``lm`` runs sessions (a model from ``load_lm``; a name
    string gets the call that loads it as a hint)."""
    if not (callable(getattr(lm, "open_session", None)) and callable(getattr(lm, "prompt_ids", None))):
        hint = f" (load it first: {name}=load_lm({lm!r}))" if isinstance(lm, str) else ""
        if getattr(lm, "served", False) is True:
            hint = (": a served model runs no forwards in this process, which the token engines "
                    "(respec, rapid, autoregressive) need; served models draft or verify in "
                    "Speculative RAG (drafter= / verifier=) and generate in RaLMSpec (lm=)")
        msg = f"{name} must be a model from load_lm, got {type(lm).__name__}{hint}"
        raise TypeError(msg)


def require_rollback(lm: SessionLM, by: str) -> None:
    """Refuse, before any forward, to verify drafts on a model whose sessions cannot forget their
    newest tokens (``Capabilities.rollback``): each rejected draft would re-read the context."""
    if not lm.capabilities.rollback:
        msg = (f"{by} verifies drafted tokens and rolls back the rejected ones; model "
               f"{lm.name!r} keeps a recurrent state that {lm.backend} cannot roll back: decode "
               "it without speculation (engine='autoregressive')")
        raise ValueError(msg)
