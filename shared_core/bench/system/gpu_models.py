"""Random-weight models at real shapes for the GPU check (``python -m shared_core.bench gpu``).

No hub, no weight files: Qwen2 / Llama models are built from configs that copy the numbers of
Qwen2.5-0.5B / 1.5B / 7B (hidden size, layers, heads, KV heads, MLP width, vocabulary, rope
theta, tied embeddings), directly on the device in the requested dtype, with random weights whose
final norm is scaled so that the logits are peaked rather than flat (a flat distribution turns
every greedy step into a near-tie). Peaked is relative: over a 151,936-token vocabulary the top of
a row of std 4 is a crowd (median top-2 margin 0.5, four bf16 ulps), so bf16 forwards of another
shape still flip some tokens; the checks report the margin where outputs part. The tokenizer is
a byte-level BPE trained in-process on a few sentences (the tests' recipe), so nothing has to be
carried to the GPU machine.
"""

from __future__ import annotations

import copy
import logging
import platform
import subprocess
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from shared_core.runtime.models import LM, wrap_lm

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Retrieval augmented generation copies spans from retrieved documents.",
    "Speculative decoding drafts tokens and the target model verifies them in one pass.",
    "Paris is the capital of France. Berlin is the capital of Germany.",
    "A suffix automaton finds every occurrence of the longest matching suffix.",
    "Question: who wrote the report? Answer: the committee wrote the report.",
    "user: hello there\nassistant: hi, how can I help you today?",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20",
] * 4
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
LOGIT_STD = 4.0  # target std of a row of logits after calibration: peaked, not one-hot


@dataclass(frozen=True)
class Shape:
    """The numbers of a decoder config (Qwen2.5's ``config.json``; ``arch`` picks the class)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    rope_theta: float
    tie: bool
    arch: str = "qwen2"  # "qwen2" or "llama"
    max_positions: int = 32768
    # weight init std (Qwen2.5's config: 0.02). A 2-layer toy at 0.02 only copies its last token
    # (the tied embedding dominates the residual stream), so the toys use 0.1.
    init_range: float = 0.02
    drafter_noise: float = 0.02  # the perturbed drafter's noise (measured acceptance: 0.3-0.8)

    @property
    def params_b(self) -> float:
        """Parameters in billions (embeddings counted once when tied)."""
        head = self.hidden // self.heads
        attn = self.hidden * head * (self.heads * 2 + self.kv_heads * 2)
        mlp = 3 * self.hidden * self.intermediate
        emb = self.vocab * self.hidden * (1 if self.tie else 2)
        return (self.layers * (attn + mlp) + emb) / 1e9


SHAPES = {
    "qwen2.5-0.5b": Shape("qwen2.5-0.5b", 896, 24, 14, 2, 4864, 151936, 1e6, True),
    "qwen2.5-1.5b": Shape("qwen2.5-1.5b", 1536, 28, 12, 2, 8960, 151936, 1e6, True),
    "qwen2.5-7b": Shape("qwen2.5-7b", 3584, 28, 28, 4, 18944, 152064, 1e6, False),
}
# CPU dry run: the same code at toy sizes (vocabulary above the tokenizer's, as Qwen pads it)
_TOY: dict[str, Any] = {"max_positions": 2048, "init_range": 0.1, "drafter_noise": 0.03}
TINY_SHAPES = {
    "tiny-a": Shape("tiny-a", 64, 2, 4, 2, 128, 512, 1e4, True, **_TOY),
    "tiny-b": Shape("tiny-b", 96, 2, 4, 2, 192, 512, 1e4, True, **_TOY),
    "tiny-c": Shape("tiny-c", 128, 2, 4, 2, 256, 512, 1e4, False, **_TOY),
}


def bench_tokenizer() -> PreTrainedTokenizerBase:
    """A byte-level BPE with ~320 tokens trained on :data:`CORPUS` (ids stay below every
    shape's vocabulary; a random model's ids above it decode to nothing)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def model_config(shape: Shape, tokenizer: PreTrainedTokenizerBase) -> PretrainedConfig:
    from transformers import LlamaConfig, Qwen2Config

    common = {
        "vocab_size": shape.vocab, "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate, "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads,
        "max_position_embeddings": shape.max_positions, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": shape.tie, "initializer_range": shape.init_range,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id,
    }
    if shape.arch == "qwen2":
        return Qwen2Config(rope_theta=shape.rope_theta, **common)
    if shape.arch == "llama":
        return LlamaConfig(rope_theta=shape.rope_theta, **common)
    msg = f"shape.arch={shape.arch!r} is not 'qwen2' or 'llama'"
    raise ValueError(msg)


def build_lm(shape: Shape, tokenizer: PreTrainedTokenizerBase, device: torch.device, dtype: torch.dtype, *,
             seed: int = 0) -> LM:
    """A random-weight model of ``shape`` built on ``device`` in ``dtype``, logits calibrated."""
    from transformers import AutoModelForCausalLM

    config = model_config(shape, tokenizer)
    torch.manual_seed(seed)
    with torch.device(device):  # weights are created (and initialised) on the device
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if next(model.parameters()).device.type != device.type:
        model.to(device)  # a transformers version that builds on the CPU regardless
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    lm = wrap_lm(model.eval(), tokenizer, name=f"{shape.name}-{shape.arch}-random-s{seed}")
    calibrate_logits(lm)
    return lm


@torch.inference_mode()
def calibrate_logits(lm: LM, target_std: float = LOGIT_STD) -> float:
    """Scale the final norm so a row of logits has std ``target_std``; return the factor.

    With the default init (std 0.02) a deep random model's logits are nearly flat, so greedy
    decoding would follow rounding noise; scaling the last norm sharpens every row alike.
    """
    ids = torch.tensor([lm.encode(" ".join(CORPUS[:4]))[:64]], device=lm.device)
    std = float(lm.model(input_ids=ids).logits.float().std(-1).mean())
    factor = target_std / max(std, 1e-6)
    lm.model.get_decoder().norm.weight.mul_(factor)
    return factor


@torch.inference_mode()
def perturbed_copy(lm: LM, noise: float, *, seed: int = 1) -> LM:
    """A drafter: ``lm``'s weights plus Gaussian noise of ``noise`` times each tensor's std (so
    acceptance falls between 0 and 1). A separate copy of the weights, on the same device."""
    model = copy.deepcopy(lm.model)
    generator = torch.Generator(device=lm.device).manual_seed(seed)
    for param in model.parameters():
        std = float(param.float().std()) if param.numel() > 1 else 0.0
        if std > 0:
            param.add_(torch.randn(param.shape, generator=generator, device=param.device,
                                   dtype=param.dtype) * (noise * std))
    return replace(lm, model=model, name=f"{lm.name}+noise{noise}")


def free(*lms: LM | None) -> None:
    """Drop the models' weights and return the memory to the device (never raises: it runs
    after a section's results are in)."""
    import gc

    for lm in lms:
        if lm is not None:
            try:
                lm.model.to("meta")
            except Exception:  # the caller's references go anyway; the cache is emptied below
                logger.exception("could not move %s to the meta device", lm.name)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _nvidia_smi() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20,
                             check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def machine_facts(device: torch.device) -> dict[str, Any]:
    """GPU name, driver, CUDA / torch / transformers versions, and the CPU facts."""
    import transformers

    from shared_core.util.device import cpu_facts

    facts: dict[str, Any] = {
        "device": str(device), "torch": torch.__version__, "transformers": transformers.__version__,
        "cuda_runtime": torch.version.cuda, "python": platform.python_version(),
        "cpu": cpu_facts(), "nvidia_smi": _nvidia_smi(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        facts.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1),
                     capability=f"{props.major}.{props.minor}",
                     cudnn=torch.backends.cudnn.version())
    return facts
