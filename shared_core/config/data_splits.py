"""Which benchmark questions are evaluation-only (the tuned drafter never trains on them).

Torch-free constants shared by the Speculative RAG benchmark (:mod:`shared_core.bench.specrag`)
and drafter tuning (:mod:`shared_core.tools.train_drafter`), so neither has to import the other.
"""

from __future__ import annotations

NQ_EVAL_ROWS = 1000  # nq_open_oracle/questions.jsonl rows [0, 1000) are evaluation-only
# SQuAD (ExpMRC dev subset): the first six articles in file order are evaluation-only.
SQUAD_EVAL_TITLES = ("Victoria_(Australia)", "Steam_engine", "Apollo_program", "Geology",
                     "Genghis_Khan", "Harvard_University")
