"""Write a model as a plain Hugging Face folder (config, safetensors, tokenizer) a server can load.

The embedded aliases ship GGUF weights that :func:`~shared_core.runtime.models.load_lm` de-quantizes
into a safetensors cache; this copies that cache (or saves any other loaded model) so that
``vllm`` serves exactly the weights the in-process engines use::

    python -m shared_core.runtime.remote.export smollm2-135m-instruct /work/vllm-models/smollm2
"""

from __future__ import annotations

import argparse
import logging
import shutil
from pathlib import Path

from shared_core.runtime.models import load_lm

logger = logging.getLogger(__name__)
_SKIP = {"specrag-manifest.json"}  # our cache's own bookkeeping


def export_model_folder(name: str, out: str | Path) -> Path:
    """Write ``name``'s weights and tokenizer to ``out`` (returned); an existing folder is kept."""
    out = Path(out).expanduser()
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        logger.info("%s already holds a model; kept", out)
        return out
    lm = load_lm(name)
    source = Path(str(lm.model.name_or_path))
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if source.is_dir() and any(source.glob("*.safetensors")):
        for f in source.iterdir():
            if f.is_file() and f.name not in _SKIP:
                shutil.copy2(f, tmp / f.name)
    else:
        lm.model.save_pretrained(tmp)
        lm.tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    logger.info("exported %s to %s", name, out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("name", help="model alias, Hugging Face id or local path for load_lm")
    parser.add_argument("out", help="folder to write")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    export_model_folder(args.name, args.out)


if __name__ == "__main__":
    main()
