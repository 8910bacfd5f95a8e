"""Frozen configuration dataclasses shared by the engines (each default is defined once here).

Torch-free and numpy-free, so the framework adapters can read their defaults from the configs
(``Field(default=XConfig.field)``). The RAG engines' configs live in :mod:`shared_core.config.rag`,
the token engines' in :mod:`shared_core.config.tokens`; all validate with the one set of helpers
below (:func:`check_int`, :func:`check_real`, :func:`check_fields`, :func:`check_config_types`...).
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import math
import numbers
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypedDict, TypeVar, overload

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

DEFAULT_LM = "smollm2-135m-instruct"  # the embedded target / drafter LM
DEFAULT_VERIFIER = "gemma-3-270m"  # Speculative RAG's embedded verifier
DEFAULT_EMBEDDER = "all-minilm-l6-v2"  # the embedded sentence embedder
DEFAULT_MAX_NEW_TOKENS = 256
DEFAULT_CHUNK_TOKENS = 512  # tokens per chunk (RAPID's long-context chunks, chunk_text)
# Runtimes (shared_core.runtime.models.load_lm): "auto" picks llama.cpp for a GGUF on a CPU when it is
# installed (measured 3-12x faster per step than torch there), torch on a GPU. The adapters and
# the demo default to it; load_lm itself (and the model cache under it) defaults to "torch",
# whose LM exposes a transformers model.
BACKENDS = ("auto", "torch", "llama.cpp")
DEFAULT_BACKEND = "auto"
LOAD_LM_BACKEND = "torch"
# Speculative RAG (engine and RAG adapters) takes the same rule: on a CPU both its parts are
# prompt reading and short batched decoding, where llama.cpp's quantized kernels beat torch
# (results/{demo,specrag}/2026-11-26a; README, "Speculative RAG on llama.cpp"); "auto" still proves llama.cpp
# in a subprocess first.
DEFAULT_SPECRAG_BACKEND = DEFAULT_BACKEND

# Sampling: a temperature in (0, MIN_TEMPERATURE) divides logits into overflow (1e-38 turns every
# logit into inf / nan), and a seed must fit every generator it seeds (torch, numpy, RaLMSpec's
# per-position mix), so both are refused where sampling settings are validated (SamplingConfig).
MIN_TEMPERATURE = 1e-4
MAX_SEED = 2**32 - 1
# OpenAI's limit on top_logprobs (and vLLM's default max_logprobs)
MAX_TOP_LOGPROBS = 20
RANDOM_SEED = -1  # llama.cpp's / llama-cpp-python's / Ollama's "no fixed seed"

# "static": fixed-capacity buffers whose one-token step is compiled (CUDA graphs) on CUDA
# (shared_core.runtime.torch.static; docs/backends.md, "Static cache")
CacheKind = Literal["prealloc", "dynamic", "static"]
CACHE_KINDS: tuple[CacheKind, ...] = ("prealloc", "dynamic", "static")
DEFAULT_CACHE: CacheKind = "prealloc"


def check_backend(backend: object, name: str = "backend") -> str:
    """``backend`` if it names a runtime, else a ValueError naming the choices."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        msg = f"{name}={backend!r} must be one of {BACKENDS}"
        raise ValueError(msg)
    return backend


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def check_prefix_cache(prefix_cache: object) -> None:
    """TypeError / ValueError naming ``prefix_cache`` unless it is None, a bool or an int >= 0."""
    what = "True, False or an int >= 0 (llama.cpp: idle contexts; torch: a budget in MiB)"
    if prefix_cache is None or isinstance(prefix_cache, bool):
        return
    if not isinstance(prefix_cache, int):
        msg = f"prefix_cache must be {what}, got {type(prefix_cache).__name__} {prefix_cache!r:.60}"
        raise TypeError(msg)
    if prefix_cache < 0:
        msg = f"prefix_cache must be {what}, got {prefix_cache}"
        raise ValueError(msg)


K = TypeVar("K")


def check_type(value: object, name: str, kinds: tuple[type[K], ...], what: str) -> K:
    """``value`` as one of ``kinds``, else a TypeError naming ``name`` (bool is never a
    number)."""
    if isinstance(value, bool) or not isinstance(value, kinds):
        msg = f"{name} must be {what}, got {type(value).__name__} {value!r}"
        raise TypeError(msg)
    return value


def require(ok: bool, name: str, requirement: str, value: object) -> None:
    """ValueError ``"<name> must be <requirement>, got <value>"`` unless ``ok``."""
    _check(ok, f"{name} must be {requirement}, got {value!r}")


@overload
def check_int(value: object, name: str, minimum: int | None = 1, *, optional: Literal[False] = False
              ) -> int: ...


@overload
def check_int(value: object, name: str, minimum: int | None = 1, *, optional: bool) -> int | None: ...


def check_int(value: object, name: str, minimum: int | None = 1, *, optional: bool = False
              ) -> int | None:
    """``value`` as an int: TypeError for a non-integer (bool, float, str; numpy integers pass),
    ValueError below ``minimum`` (``None``: any integer); ``optional`` also lets None through."""
    if optional and value is None:
        return None
    what = ("an integer" if minimum is None else f"an integer >= {minimum}") + \
        (" or None" if optional else "")
    number = int(check_type(value, name, (numbers.Integral,), what))
    require(minimum is None or number >= minimum, name, what, value)
    return number


def check_real(value: object, name: str) -> float:
    """``value`` as a finite float: TypeError for bool, str and other non-reals (numpy floats
    pass), ValueError for inf / nan."""
    number = check_type(value, name, (numbers.Real,), "a number")
    require(math.isfinite(number), name, "finite", value)
    return float(number)


def check_bool(value: object, name: str) -> bool:
    """``value`` if it is a bool, else a TypeError naming ``name``."""
    if not isinstance(value, bool):
        msg = f"{name} must be a bool, got {type(value).__name__} {value!r}"
        raise TypeError(msg)
    return value


def check_unicode(value: str, name: str) -> str:
    """``value`` unless it holds a lone surrogate (e.g. ``"\\ud800"``), which no tokenizer can
    encode: a ValueError naming ``name`` and the position, instead of an error deep inside one."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            msg = (f"{name} contains a lone surrogate {value[e.start]!r} at position {e.start}; "
                   "text must be valid Unicode (decode bytes with errors='replace')")
            raise ValueError(msg) from None
    return value


def check_text(value: object, name: str) -> str:
    """A non-empty string (TypeError for another type, ValueError for blank or a lone
    surrogate), returned as is. (Text to embed may be blank:
    ``shared_core.retrieval.embedding.check_str``.)"""
    if not isinstance(value, str):
        msg = f"{name} must be a str, got {type(value).__name__}"
        raise TypeError(msg)
    _check(bool(value.strip()), f"{name} must be a non-empty string")
    return check_unicode(value, name)


def check_str_list(value: object, name: str, *, allow_empty: bool = True) -> list[str]:
    """A list (or other iterable) of strings as a list; a bare string is refused (it would be
    read as its characters), and so is an empty one unless ``allow_empty``."""
    if isinstance(value, (str, bytes)):
        msg = f"{name} must be a list of strings, not one string; wrap it in a list"
        raise TypeError(msg)
    if not isinstance(value, Iterable) or isinstance(value, dict):
        msg = f"{name} must be a list of strings, got {type(value).__name__}"
        raise TypeError(msg)
    items = list(value)
    _check(allow_empty or bool(items), f"{name} must not be empty")
    for i, item in enumerate(items):
        if not isinstance(item, str):
            msg = f"{name}[{i}] must be a str, got {type(item).__name__} {item!r:.80}"
            raise TypeError(msg)
    return items


def check_kwargs(given: Iterable[str], valid: Iterable[str], owner: str) -> None:
    """TypeError naming the first unknown keyword argument of ``owner`` and the closest valid
    name (``difflib``), e.g. ``ChatSpeculative got an unexpected keyword argument 'max_token';
    did you mean 'max_tokens'?``."""
    valid = sorted(set(valid))
    unknown = [name for name in given if name not in valid]
    if not unknown:
        return
    name = str(unknown[0])
    close = closest_name(name, valid)
    hint = f"did you mean {close!r}?" if close else f"valid names: {', '.join(valid)}"
    msg = f"{owner} got an unexpected keyword argument {name!r}; {hint}"
    raise TypeError(msg)


def closest_name(name: str, valid: Iterable[str]) -> str | None:
    """The valid name ``name`` is most likely a typo of (``difflib``), else one containing it or
    contained in it (``top_k`` for ``similarity_top_k``), else None."""
    valid = sorted(set(valid))
    close = difflib.get_close_matches(name, valid, n=1, cutoff=0.6) or [
        v for v in valid if len(name) >= 3 and (name in v or v in name)][:1]
    return close[0] if close else None


F = TypeVar("F", bound=Callable[..., Any])


def suggest_kwargs(func: F) -> F:
    """Refuse an unknown keyword argument of ``func`` with :func:`check_kwargs` (the closest valid
    name), before the call; for functions and ``__init__`` methods with explicit parameters."""
    params = inspect.signature(func).parameters.values()
    valid = frozenset(p.name for p in params if p.name not in ("self", "cls")
                      and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
    owner = func.__qualname__.removesuffix(".__init__")

    @functools.wraps(func)
    def wrapper(*args: object, **kwargs: object) -> object:
        if not valid.issuperset(kwargs):
            check_kwargs(kwargs, valid, owner)
        return func(*args, **kwargs)

    return wrapper  # type: ignore[return-value]  # the same signature as ``func``


def check_settings_keys(cls: type, data: object) -> object:
    """A pydantic ``model_validator(mode="before")`` body: ``data`` unless it names a setting
    ``cls`` does not have (:func:`check_kwargs`; a field's alias counts as its name)."""
    if isinstance(data, dict):
        fields = getattr(cls, "model_fields", {})
        names = set(fields)
        for info in fields.values():
            for alias in (info.alias, info.validation_alias):
                names.update(getattr(alias, "choices", None) or ([alias] if alias else []))
        check_kwargs(data, {n for n in names if isinstance(n, str)}, cls.__name__)
    return data


def check_choice(value: object, name: str, choices: Sequence[str]) -> None:
    """ValueError naming ``name`` unless ``value`` is one of ``choices``."""
    if value not in choices:
        msg = f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}"
        raise ValueError(msg)


def check_timeout(timeout_s: object, name: str = "retrieval_timeout_s") -> None:
    """None or a positive, finite number of seconds."""
    if timeout_s is None:
        return
    what = "None or a number of seconds > 0"
    seconds = check_type(timeout_s, name, (int, float), what)
    _check(0 < seconds < math.inf, f"{name} must be {what}, got {timeout_s!r}")


def check_number(value: object, name: str, low: float, high: float) -> None:
    """A real number (not bool; numpy floats pass) strictly between ``low`` and ``high`` (the
    retrievers' closed interval is ``shared_core.retrieval._common.check_closed_range``)."""
    what = f"a number in ({low}, {high})"
    real = check_type(value, name, (numbers.Real,), what)
    _check(low < float(real) < high, f"{name} must be {what}, got {value!r}")


def check_fields(config: object, *, ints: Iterable[str] = (), bools: Iterable[str] = (),
                 strs: Iterable[str] = ()) -> None:
    """The type (and ``>= 1`` for ints) of a config's named fields; errors name the field."""
    for name in ints:
        check_int(getattr(config, name), name)
    for name in bools:
        check_bool(getattr(config, name), name)
    for name in strs:
        check_type(getattr(config, name), name, (str,), "a str")


def check_config_types(config: DataclassInstance) -> None:
    """Type-check a config dataclass's fields against their defaults' types (bool, int, float,
    str; a ``None`` default allows None or an int), naming the field and the config class."""
    owner = type(config).__name__
    for f in dataclasses.fields(config):
        value, default = getattr(config, f.name), f.default
        name = f"{f.name} ({owner})"
        if default is None:
            if value is not None:
                check_int(value, name, None)
        elif isinstance(default, bool):
            check_bool(value, name)
        elif isinstance(default, int):
            check_int(value, name, None)
        elif isinstance(default, float):
            check_real(value, name)
        elif isinstance(default, str):
            check_type(value, name, (str,), "a str")


@dataclass(frozen=True)
class SamplingConfig:
    """How the next token is chosen; applied identically to draft and target distributions.

    ``temperature == 0`` means greedy decoding (top-k / top-p / min-p are then ignored).
    Otherwise the logits are divided by the temperature first, then filtered by top-k, top-p
    and min-p (tokens less likely than ``min_p`` times the most likely one), in transformers'
    order (``generate``'s warpers). llama.cpp filters before the temperature, so the same
    ``top_p`` / ``min_p`` with a temperature other than 1 keeps another set of tokens there.
    """

    temperature: float = 0.0
    top_k: int = 0  # 0 = no top-k filter
    top_p: float = 1.0  # 1.0 = no nucleus filter
    # seeds a generator on the model's device (decoding.verify.make_generator): reproducible on
    # one device type, not across a CPU and a GPU
    seed: int | None = None
    min_p: float = 0.0  # 0.0 = no min-p filter (last: the fields before it are positional)

    def __post_init__(self) -> None:
        temperature = check_real(self.temperature, "temperature")  # finite: no inf / nan
        _check(temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        _check(temperature == 0 or temperature >= MIN_TEMPERATURE,
               f"temperature={self.temperature!r} is too small to sample with (logits / "
               f"temperature overflow); use temperature=0 for greedy decoding or a value >= "
               f"{MIN_TEMPERATURE}")
        check_int(self.top_k, "top_k", minimum=0)
        top_p = check_real(self.top_p, "top_p")
        _check(0 < top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed == RANDOM_SEED and not isinstance(self.seed, bool):
            object.__setattr__(self, "seed", None)
        if self.seed is not None:
            check_int(self.seed, "seed", None)
            _check(0 <= self.seed <= MAX_SEED,
                   f"seed must be an integer in [0, 2**32 - 1], -1 (unseeded, as llama.cpp's "
                   f"-1) or None, got {self.seed}")
        min_p = check_real(self.min_p, "min_p")
        _check(0 <= min_p < 1, f"min_p must be in [0, 1), got {self.min_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class PenaltyConfig:
    """llama.cpp's penalties (``llama_sampler_init_penalties``; the names of ``ChatLlamaCpp``,
    llama-cpp-python, Ollama and OpenAI's API), over the last ``repeat_last_n`` ids of the prompt
    and the reply: a token seen ``c > 0`` times there has its logit divided by ``repeat_penalty``
    (multiplied where negative), then ``c * frequency_penalty + presence_penalty`` subtracted,
    before the next token is chosen. Off by default (1.0, 0.0, 0.0) or with ``repeat_last_n=0``.
    The prompt's ids count, as in llama.cpp's server; llama-cpp-python's ``Llama`` (0.3) counts
    only the ids it generated."""

    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0

    def __post_init__(self) -> None:
        penalty = check_real(self.repeat_penalty, "repeat_penalty")
        _check(penalty > 0, f"repeat_penalty must be > 0, got {self.repeat_penalty}")
        check_int(self.repeat_last_n, "repeat_last_n", minimum=0)
        check_real(self.frequency_penalty, "frequency_penalty")  # negative: encourages, as in
        check_real(self.presence_penalty, "presence_penalty")  # llama.cpp and OpenAI's API

    @property
    def active(self) -> bool:
        return self.repeat_last_n > 0 and (self.repeat_penalty != 1.0 or self.frequency_penalty
                                           != 0.0 or self.presence_penalty != 0.0)


SAMPLING_SETTINGS = tuple(f.name for f in dataclasses.fields(SamplingConfig))
PENALTY_SETTINGS = tuple(f.name for f in dataclasses.fields(PenaltyConfig))


class SamplingOptions(TypedDict, total=False):
    """The keyword options of :meth:`GenerationConfig.build` (an engine's ``**sampling``)."""

    stop: Sequence[str] | str | None
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int | None


@dataclass(frozen=True)
class GenerationConfig:
    """Limits of one generation: how many tokens, and where to stop."""

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    stop: tuple[str, ...] = ()
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    # None: no log-probabilities; n >= 0: each reply token's log-probability under the model's
    # own distribution and the n most likely tokens at its position (GenerationResult.logprobs)
    top_logprobs: int | None = None

    def __post_init__(self) -> None:
        check_type(self.max_new_tokens, "max_new_tokens", (int,), "an integer >= 1")
        _check(self.max_new_tokens >= 1, f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        _check(all(isinstance(s, str) and s for s in self.stop),
               "stop must be a list of non-empty strings")
        if self.top_logprobs is not None:
            check_int(self.top_logprobs, "top_logprobs", minimum=0)
            _check(self.top_logprobs <= MAX_TOP_LOGPROBS,
                   f"top_logprobs must be at most {MAX_TOP_LOGPROBS}, got {self.top_logprobs}")

    @classmethod
    def build(cls, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, *,
              stop: Sequence[str] | str | None = None,
              temperature: float = SamplingConfig.temperature, top_k: int = SamplingConfig.top_k,
              top_p: float = SamplingConfig.top_p, seed: int | None = None,
              min_p: float = SamplingConfig.min_p, top_logprobs: int | None = None
              ) -> GenerationConfig:
        """Validate loose keyword arguments into a config (the engines' public entry point)."""
        if isinstance(stop, str):
            stop = (stop,)
        return cls(max_new_tokens=max_new_tokens, stop=tuple(stop or ()),
                   sampling=SamplingConfig(temperature, top_k, top_p, seed, min_p),
                   top_logprobs=top_logprobs)


# Passage (chunk) KV cache (shared_core.runtime.passage_cache; docs/backends.md, *Passage cache*):
# "exact" reuses the KV of exact prompt prefixes only (outputs equal a cold prefill with
# load_lm(exact=True)); "blend" reuses cached passages anywhere in a prompt and recomputes a share
# of their tokens so passages attend to each other (CacheBlend, Yao et al. EuroSys 2025: ~15 %).
PASSAGE_CACHE_MODES = ("exact", "blend")
DEFAULT_PASSAGE_CACHE: str | None = None  # off unless asked for
DEFAULT_RECOMPUTE_SHARE = 0.15  # CacheBlend §5: 15 % of the reused tokens
DEFAULT_PASSAGE_MEMORY_MB = 512  # memory tier of the chunk store (MiB)
DEFAULT_PASSAGE_DISK_MB = 4096  # disk tier under $SPECRAG_CACHE/passage_kv (MiB; 0: no disk tier)


def check_passage_cache(passage_cache: object, *, exact: bool = False) -> str | None:
    """``passage_cache`` if it is None, ``"exact"`` or ``"blend"``; ``"blend"`` is refused when
    ``exact`` output was asked for (blending changes outputs). Errors name ``passage_cache``."""
    if passage_cache is None:
        return None
    if not isinstance(passage_cache, str) or passage_cache not in PASSAGE_CACHE_MODES:
        msg = f"passage_cache must be None or one of {PASSAGE_CACHE_MODES}, got {passage_cache!r:.60}"
        raise ValueError(msg)
    if exact and passage_cache == "blend":
        msg = ("passage_cache='blend' changes outputs and exact=True asks for exact ones; use "
               "passage_cache='exact' (prefix reuse, token-identical) or exact=False")
        raise ValueError(msg)
    return passage_cache


@dataclass(frozen=True)
class PassageCacheConfig:
    """How a model's passage cache runs (``load_lm(passage_cache=..., recompute_share=...,
    passage_cache_memory_mb=..., passage_cache_disk_mb=...)``); errors name the parameter."""

    mode: str = "exact"
    recompute_share: float = DEFAULT_RECOMPUTE_SHARE
    memory_mb: int = DEFAULT_PASSAGE_MEMORY_MB
    disk_mb: int = DEFAULT_PASSAGE_DISK_MB

    def __post_init__(self) -> None:
        if self.mode not in PASSAGE_CACHE_MODES:
            check_passage_cache(self.mode)
        share = check_real(self.recompute_share, "recompute_share")
        require(0 <= share <= 1, "recompute_share", "a number in [0, 1]", self.recompute_share)
        memory = check_int(self.memory_mb, "passage_cache_memory_mb", 0)
        disk = check_int(self.disk_mb, "passage_cache_disk_mb", 0)
        if memory == 0 and disk == 0:
            msg = ("passage_cache_memory_mb=0 with passage_cache_disk_mb=0 leaves the passage "
                   "cache nowhere to keep an entry: give either a budget > 0, or load without "
                   "passage_cache")
            raise ValueError(msg)
