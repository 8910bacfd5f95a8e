"""The torch-free configs: one home per default, one set of validation helpers (issue 15, item 2)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import FrozenInstanceError, fields
from typing import Any

import numpy as np
import pytest

from shared_core.config import (
    DEFAULT_MAX_NEW_TOKENS,
    GenerationConfig,
    check_choice,
    check_fields,
    check_int,
    check_number,
    check_timeout,
)
from shared_core.config.rag import RaLMSpecConfig, SpeculativeRAGConfig, SpeculativeRetrievalConfig

CONFIGS = (SpeculativeRAGConfig, RaLMSpecConfig, SpeculativeRetrievalConfig)


def test_configs_import_without_torch_or_numpy() -> None:
    code = ("import sys; import shared_core.config, shared_core.config.rag; "
            "heavy = [m for m in ('torch', 'numpy', 'transformers') if m in sys.modules]; "
            "assert not heavy, heavy")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0, result.stderr[-2000:]


def test_engines_re_export_the_configs() -> None:
    from shared_core.engines import ralmspec, speculative_rag

    assert speculative_rag.SpeculativeRAGConfig is SpeculativeRAGConfig
    assert ralmspec.RaLMSpecConfig is RaLMSpecConfig
    assert ralmspec.check_timeout is check_timeout
    assert RaLMSpecConfig().instruction == ralmspec.DEFAULT_INSTRUCTION
    assert SpeculativeRAGConfig().embed_instruction == speculative_rag.EMBED_INSTRUCTION


def test_generation_default_is_the_constant() -> None:
    assert GenerationConfig().max_new_tokens == DEFAULT_MAX_NEW_TOKENS
    assert GenerationConfig.build().max_new_tokens == DEFAULT_MAX_NEW_TOKENS


@pytest.mark.parametrize("config", CONFIGS)
def test_defaults_are_valid_and_frozen(config: type) -> None:
    instance = config()
    assert instance == config(**{f.name: getattr(instance, f.name) for f in fields(instance)})
    first = fields(instance)[0].name
    with pytest.raises(FrozenInstanceError):
        setattr(instance, first, getattr(instance, first))


BAD: list[tuple[type, dict[str, Any], type[Exception], str]] = [
    (SpeculativeRAGConfig, {"num_drafts": 2.0}, TypeError, "num_drafts"),
    (SpeculativeRAGConfig, {"docs_per_draft": True}, TypeError, "docs_per_draft"),
    (SpeculativeRAGConfig, {"retrieve_k": 0}, ValueError, "retrieve_k"),
    (SpeculativeRAGConfig, {"use_self_reflect": 1}, TypeError, "use_self_reflect"),
    (SpeculativeRAGConfig, {"seed": "7"}, TypeError, "seed"),
    (SpeculativeRAGConfig, {"embed_instruction": None}, TypeError, "embed_instruction"),
    (SpeculativeRAGConfig, {"selection": "best"}, ValueError, "selection"),
    (SpeculativeRAGConfig, {"subset_strategy": "kmeans"}, ValueError, "subset_strategy"),
    (SpeculativeRAGConfig, {"draft_order": "random"}, ValueError, "draft_order"),
    (RaLMSpecConfig, {"retrieval_stride": "4"}, TypeError, "retrieval_stride"),
    (RaLMSpecConfig, {"prefetch_k": 0}, ValueError, "prefetch_k"),
    (RaLMSpecConfig, {"scheduler": "yes"}, TypeError, "scheduler"),
    (RaLMSpecConfig, {"speculation_stride": 9}, ValueError, "speculation_stride"),
    (RaLMSpecConfig, {"gamma_max": 1.0}, ValueError, "gamma_max"),
    (RaLMSpecConfig, {"gamma_max": "0.5"}, TypeError, "gamma_max"),
    (RaLMSpecConfig, {"cache": "paged"}, ValueError, "cache"),
    (RaLMSpecConfig, {"instruction": 3}, TypeError, "instruction"),
    (RaLMSpecConfig, {"retrieval_timeout_s": 0}, ValueError, "retrieval_timeout_s"),
    (RaLMSpecConfig, {"retrieval_timeout_s": float("inf")}, ValueError, "retrieval_timeout_s"),
    (RaLMSpecConfig, {"retrieval_timeout_s": True}, TypeError, "retrieval_timeout_s"),
    (SpeculativeRetrievalConfig, {"k": 1.5}, TypeError, "k"),
    (SpeculativeRetrievalConfig, {"prefetch_k": -1}, ValueError, "prefetch_k"),
    (SpeculativeRetrievalConfig, {"retrieval_timeout_s": "1"}, TypeError, "retrieval_timeout_s"),
]


@pytest.mark.parametrize(("config", "kwargs", "error", "name"), BAD,
                         ids=[f"{c.__name__}-{next(iter(k))}={next(iter(k.values()))!r}"
                              for c, k, _, _ in BAD])
def test_bad_settings_raise_naming_the_field(config: type, kwargs: dict[str, Any],
                                             error: type[Exception], name: str) -> None:
    with pytest.raises(error, match=rf"^{name}\b"):
        config(**kwargs)


def test_good_settings_pass_numpy_ints_included() -> None:
    assert SpeculativeRAGConfig(num_drafts=np.int64(3), seed=-1).num_drafts == 3
    assert RaLMSpecConfig(prefetch_k=np.int32(4), gamma_max=np.float32(0.5),
                          retrieval_timeout_s=2).prefetch_k == 4
    assert SpeculativeRetrievalConfig(k=np.int64(2)).k == 2


def test_the_shared_helpers() -> None:
    class Settings:
        n, flag, text = 2, True, "x"

    check_fields(Settings(), ints=("n",), bools=("flag",), strs=("text",))
    Settings.n = 0
    with pytest.raises(ValueError, match="n must be an integer >= 1, got 0"):
        check_fields(Settings(), ints=("n",))
    with pytest.raises(TypeError, match="flag must be a bool"):
        Settings.flag = "yes"
        check_fields(Settings(), bools=("flag",))
    check_int(0, "zero", minimum=0)
    with pytest.raises(TypeError, match="k must be an integer >= 1, got bool True"):
        check_int(True, "k")
    check_timeout(None)
    with pytest.raises(ValueError, match="t must be None or a number of seconds > 0"):
        check_timeout(-1, "t")
    with pytest.raises(ValueError, match="mode must be one of 'a', 'b', got 'c'"):
        check_choice("c", "mode", ("a", "b"))
    with pytest.raises(ValueError, match=r"x must be a number in \(0.0, 1.0\), got 0.0"):
        check_number(0.0, "x", 0.0, 1.0)


def test_speculative_retrieval_checks_through_its_config() -> None:
    from shared_core.engines.ralmspec import SpeculativeRetrieval
    from shared_core.retrieval import BM25Retriever

    with pytest.raises(TypeError, match=r"^k must be"):
        SpeculativeRetrieval(BM25Retriever(), k="2")
    with pytest.raises(ValueError, match=r"^retrieval_timeout_s must be"):
        SpeculativeRetrieval(BM25Retriever(), retrieval_timeout_s=-1.0)
    session = SpeculativeRetrieval(BM25Retriever())
    assert (session.k, session.prefetch_k) == (SpeculativeRetrievalConfig.k,
                                               SpeculativeRetrievalConfig.prefetch_k)


# every module whose public signatures take sampling or token-limit keywords
SIGNATURE_MODULES = (
    "shared_core.config", "shared_core.decoding.output", "shared_core.engines.baseline",
    "shared_core.engines.respec.engine", "shared_core.engines.rapid.engine",
    "shared_core.engines.rapid.entry", "shared_core.engines.ralmspec.engine",
    "shared_core.engines.knnlm")


def _signature_defaults(name: str) -> list[tuple[str, str, Any]]:
    """(function, parameter, default) for every defaulted parameter of the module's functions and
    of the methods of its classes."""
    import importlib
    import inspect

    module = importlib.import_module(name)
    functions = [f for _, f in inspect.getmembers(module, inspect.isfunction)
                 if f.__module__ == name]
    for _, cls in inspect.getmembers(module, inspect.isclass):
        if cls.__module__ == name:
            functions += [f for _, f in inspect.getmembers(
                cls, lambda x: inspect.isfunction(x) or inspect.ismethod(x))]  # + classmethods
    return [(f.__qualname__, p.name, p.default) for f in functions
            for p in inspect.signature(f).parameters.values() if p.default is not p.empty]


@pytest.mark.parametrize("module", SIGNATURE_MODULES)
def test_retyped_defaults_equal_their_one_home(module: str) -> None:
    """Sampling defaults written again in keyword signatures (``temperature=0.0, top_k=0,
    top_p=1.0``) equal SamplingConfig's; token limits are DEFAULT_MAX_NEW_TOKENS (RaLMSpec's:
    RALMSPEC_MAX_NEW_TOKENS)."""
    from shared_core.config import SamplingConfig
    from shared_core.config.rag import RALMSPEC_MAX_NEW_TOKENS

    tokens = RALMSPEC_MAX_NEW_TOKENS if "ralmspec" in module else DEFAULT_MAX_NEW_TOKENS
    home = {"temperature": SamplingConfig.temperature, "top_k": SamplingConfig.top_k,
            "top_p": SamplingConfig.top_p, "max_new_tokens": tokens}
    # a config's own fields are homes (KNNLMConfig.temperature is the neighbours' softmax's)
    found = [(f, p, d) for f, p, d in _signature_defaults(module)
             if p in home and d is not None and not f.endswith("Config.__init__")]
    assert found, f"{module} has no sampling or token-limit defaults: is the list stale?"
    wrong = [(f, p, d) for f, p, d in found if d != home[p]]
    assert not wrong, f"defaults that differ from their home in shared_core.config: {wrong}"
