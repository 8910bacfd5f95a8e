"""The ``specrag`` console script: ``specrag demo`` and ``specrag bench <engine|probe-*> ...``."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence


def _write(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        from shared_core.bench.__main__ import main as bench_main

        return bench_main(argv[1:])
    from shared_core.tools.demo import DEMO_MAX_NEW_TOKENS, run_demo  # torch-free at import

    parser = argparse.ArgumentParser(prog="specrag", description="specrag command line")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="index a small knowledge base and answer with each engine")
    demo.add_argument("--max-new-tokens", type=int, default=DEMO_MAX_NEW_TOKENS)
    sub.add_parser("bench", help="benchmarks and probes: specrag bench <name> --help")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        demo.error(f"argument --max-new-tokens: must be >= 1, got {args.max_new_tokens}")
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    _write("specrag demo: embedded offline models (SmolLM2-135M-Instruct, MiniLM and, when "
           "specrag[qwen] is installed, the Qwen2.5-Coder pair)")
    run_demo(args.max_new_tokens, write=_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
