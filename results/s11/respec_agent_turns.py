"""Agent turns of examples/agents.py per engine, session 11: plain decoding, ReSpec with the
paper's new-position score (learn_new_score=False) and with the learned one; the prefix cache is
emptied before every call; rounds interleaved. Prints one JSON row per call.

Run: SPECRAG_NUM_THREADS=1 python results/s11/respec_agent_turns.py
"""

import json
import os
import sys
import time
from pathlib import Path

from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import StructuredTool

from langchain_specrag import ChatSpeculative

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import agents as example

MODEL = "qwen2.5-coder-1.5b-instruct"
search = example.handbook_search()
tool = StructuredTool.from_function(search)
system = SystemMessage(example.SYSTEM_PROMPTS["plain"])
question = HumanMessage(example.QUESTION)
call = AIMessage("", tool_calls=[{"name": "search_handbook", "id": "call_1",
                                  "args": {"query": "Veldmark vacation days"}}])
result = ToolMessage(search("Veldmark vacation days"), tool_call_id="call_1")
TURNS = {"turn1": [system, question], "turn2": [system, question, call, result]}
ENGINES = {"autoregressive": ("autoregressive", {}),
           "respec_paper": ("respec", {"learn_new_score": False}),
           "respec_learned": ("respec", {})}

for rnd in range(2):
    for turn, messages in TURNS.items():
        for name, (engine, options) in ENGINES.items():
            chat = ChatSpeculative(model=MODEL, engine=engine, engine_options=options,
                                   max_tokens=64).bind_tools([tool])
            example.forget_prefixes(MODEL)
            start = time.perf_counter()
            out = chat.invoke(messages)
            seconds = time.perf_counter() - start
            stats = out.response_metadata["speculative_stats"]
            row = {"round": rnd, "turn": turn, "method": name, "s": round(seconds, 2),
                   "decode_s": round(stats.get("decode_s", 0), 2), "new": stats["new_tokens"],
                   "drafted": stats.get("drafted"), "accepted": stats.get("accepted"),
                   "calls": [c["args"] for c in out.tool_calls]}
            sys.stdout.write(json.dumps(row) + "\n")
sys.stdout.write(f"load {os.getloadavg()}\n")
