"""The loaded-model record every engine takes: a causal LM, its tokenizer and the facts engines
need about them, whatever runtime runs it (torch here; llama.cpp in :mod:`shared_core.runtime.llamacpp`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from shared_core.config import DEFAULT_CACHE, CacheKind
from shared_core.runtime.protocol import Capabilities, CostCurve, KVSession, ModelLM, Row, Spans, StopRule
from shared_core.util.device import current_threads, thread_policy

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

# A plain chat format for base models that ship no chat template (e.g. Gemma-3-270M base).
FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | capitalize }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)



def runtime_threads(lm: object) -> int | None:
    """The threads the runtime running ``lm`` computes with: a runtime's own count (llama.cpp's
    ``model.threads``), torch's for a torch model, None for a served one."""
    own = getattr(getattr(lm, "model", None), "threads", None)
    if isinstance(own, int) and not isinstance(own, bool):
        return own
    return current_threads() if getattr(lm, "backend", None) == "torch" else None


def runtime_thread_policy(lm: object) -> str | None:
    """How the model running ``lm`` chose its own thread count (llama.cpp: per model, as each
    ``Llama`` has its own), or None where the count is the process's (torch) or a server's."""
    model = getattr(lm, "model", None)
    policy, threads = getattr(model, "thread_policy", None), getattr(model, "threads", None)
    if not isinstance(policy, str) or not isinstance(threads, int):
        return None
    return f"{getattr(lm, 'backend', '?')}: {threads} thread{'s' * (threads != 1)}, {policy}"


def runtime_report(models: Mapping[str, object]) -> dict[str, Any]:
    """``backend``, ``backend_reason``, ``threads`` and ``thread_policy`` of the models that ran,
    by role (``{"drafter": lm, "verifier": lm}``): a value the models agree on once, else each
    named by its role; threads of the first model."""

    def joined(values: dict[str, str]) -> str:
        if len(set(values.values())) <= 1:
            return next(iter(values.values()), "")
        return ", ".join(f"{role}: {value}" for role, value in values.items())

    first = next(iter(models.values()), None)
    return {"backend": joined({r: str(getattr(m, "backend", "")) for r, m in models.items()}),
            "backend_reason": joined({r: str(getattr(m, "backend_reason", ""))
                                      for r, m in models.items()}),
            "threads": runtime_threads(first),
            "thread_policy": runtime_thread_policy(first) or thread_policy()}


class ChatTokenizer:
    """:class:`~shared_core.runtime.protocol.ModelLM`'s tokenizer methods over ``self.tokenizer``
    (a transformers tokenizer), shared by the in-process :class:`LM` and the served model."""

    tokenizer: PreTrainedTokenizerBase

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def encode_offsets(self, text: str) -> tuple[list[int], list[int] | None]:
        """``text``'s ids (no special tokens added) and the character each one starts at (None
        from a slow tokenizer, which gives no offsets)."""
        fast = bool(getattr(self.tokenizer, "is_fast", False))
        encoded = self.tokenizer(text, add_special_tokens=False, verbose=False,
                                 return_offsets_mapping=fast)
        starts = [int(start) for start, _ in encoded["offset_mapping"]] if fast else None
        return [int(i) for i in encoded["input_ids"]], starts

    def decode(self, ids: Sequence[int]) -> str:
        text: str = self.tokenizer.decode(list(ids), skip_special_tokens=True)
        return text

    def chat_prompt(self, messages: Sequence[dict[str, str]]) -> str:
        """Render chat messages with the model's template (plain fallback for base models)."""
        template = None if self.has_chat_template else FALLBACK_CHAT_TEMPLATE
        rendered: str = self.tokenizer.apply_chat_template(
            list(messages), tokenize=False, add_generation_prompt=True, chat_template=template
        )
        return rendered

    def prompt_ids(self, prompt: str | Sequence[dict[str, str]]) -> list[int]:
        """Token ids for a raw prompt string or a list of chat messages."""
        if isinstance(prompt, str):
            if not prompt:
                msg = "prompt must be a non-empty string or a list of messages"
                raise ValueError(msg)
            # BOS-style special tokens as the tokenizer adds them for a fresh sequence.
            return self.encode(prompt, add_special_tokens=True)
        if not prompt:
            msg = "messages must not be empty"
            raise ValueError(msg)
        # A chat template writes its own special tokens; the plain fallback of a base model does
        # not, so it gets BOS as any fresh sequence does (without it Gemma-3 base babbles).
        add_special = not self.has_chat_template
        return self.encode(self.chat_prompt(prompt), add_special_tokens=add_special)


@dataclass
class LM(ChatTokenizer):
    """A causal LM, its tokenizer and the facts engines need about them."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    name: str
    device: torch.device
    dtype: torch.dtype
    max_context: int
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    linear_weights: str = "dtype"  # "fp16": decoder linears run fp16 weights (use_fp16_linears)
    # positions a cache="static" session holds; None: the window, at most 4096
    # (shared_core.runtime.torch.static.DEFAULT_STATIC_CAPACITY)
    static_capacity: int | None = None
    # exact mode (load_lm(exact=True)): every forward this many rows over the static capacity
    # (shared_core.runtime.torch.exact); None: the default mode
    exact_width: int | None = None
    backend: ClassVar[str] = "torch"  # the runtime; subclasses for other runtimes override it
    backend_reason: str = "built by the caller"  # why load_lm chose this runtime
    served: ClassVar[bool] = False  # runs in this process (shared_core.runtime.protocol)

    @property
    def vocab_size(self) -> int:
        """Rows of the output embedding (may exceed ``len(tokenizer)`` by padding)."""
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def capabilities(self) -> Capabilities:
        """What this runtime offers (:class:`shared_core.runtime.protocol.Capabilities`): torch
        reuses prefixes while the model has a prefix store, bit-exactly in the store's exact mode;
        in exact mode (``exact_width``) every forward has one shape, so any batch is invariant."""
        from shared_core.runtime.torch.prefix import store_for

        store = store_for(self.model)
        invariant = self.exact_width is not None
        return Capabilities(batch_invariant=invariant,
                            exact_reuse=invariant or (store is not None and store.exact),
                            prefix_reuse=store is not None and store.budget > 0,
                            any_positions=True, hidden_states=True, measured_cost=False,
                            branch_rows_exact=not invariant)

    def open_session(self, *, cache: CacheKind = DEFAULT_CACHE) -> KVSession:
        from shared_core.runtime.torch.session import KVSession as TorchSession

        return TorchSession(self, cache=cache)

    def generate_parallel(self, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                          stop: StopRule, on_prefilled: Callable[[], None] | None = None
                          ) -> list[Row]:
        """Greedy continuations of all prompts in one left-padded batch
        (:func:`shared_core.runtime.torch.batch.generate_parallel`)."""
        from shared_core.runtime.torch.batch import generate_parallel

        return generate_parallel(self, prompts, max_new_tokens, stop, on_prefilled)

    def span_logprobs(self, rows: Sequence[Sequence[int]], spans: Spans) -> list[list[float]]:
        """Summed log P over each span of each row from one forward
        (:func:`shared_core.runtime.torch.batch.span_logprobs`)."""
        from shared_core.runtime.torch.batch import span_logprobs

        return span_logprobs(self, rows, spans)

    def forward_cost_curve(self) -> CostCurve | None:
        """None: torch engines fit a forward's cost as they run."""
        return None

    def describe_window(self) -> str:
        return f"the {self.max_context}-token window of {self.name}"

    def positions_for(self, cache: CacheKind) -> int:
        """Positions a session with ``cache`` can fill: the window, or on the static cache (every
        session's in exact mode) its capacity less the padding of exact mode's fixed-width
        forwards (a feed is rounded up to ``exact_width`` rows)."""
        if not self.exact_width and cache != "static":
            return self.max_context
        from shared_core.runtime.torch.static import capacity_for

        return capacity_for(self) - (self.exact_width - 1 if self.exact_width else 0)


def window_text(lm: ModelLM, cache: CacheKind | None = None) -> str:
    """``lm``'s context limit in words for an error message: a runtime that has a setting for it
    names the setting (llama.cpp: ``n_ctx``, :meth:`describe_window`); with ``cache``, the
    positions a session on it holds where that is less (a torch static cache)."""
    positions_for = getattr(lm, "positions_for", None)  # in-process models only
    positions = positions_for(cache) if cache is not None and callable(positions_for) else None
    if positions is not None and positions < lm.max_context:
        return (f"the {positions}-token window of {lm.name} on its static cache "
                "(LM.static_capacity, less exact mode's padding)")
    describe = getattr(lm, "describe_window", None)
    return describe() if callable(describe) else f"the {lm.max_context}-token window of {lm.name}"


def clear_prefix_cache(lm: ModelLM) -> None:
    """Empty the prompts a model keeps for reuse (llama.cpp: idle contexts; torch: the prefix
    store of :mod:`shared_core.runtime.torch.prefix`); a no-op on a model that keeps none (served, or a torch
    model built by hand without a store).

    Benchmarks call it before every timed call: methods interleaved on one prompt would
    otherwise reuse what the method before them read, and only the first would pay its prefill.
    """
    clear = getattr(getattr(lm, "model", None), "clear_prefix_cache", None)
    if clear is not None:
        clear()
