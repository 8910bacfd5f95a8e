"""Why Qwen2.5-Coder-1.5B's agents loop: its next-token distribution and greedy reply at the
agent's first turn and at the turn after the tool result, per system prompt (session 11).

Prompts are rendered exactly as the chat adapters render them (shared_core.tool_calls.render_prompt,
the model's own chat template with the tool); logits come from llama.cpp on the same GGUF.
Run: SPECRAG_NUM_THREADS=1 python results/s11/agent_probe.py > results/s11/agent_probe.txt
"""
import sys

import numpy as np
from llama_cpp import Llama

from shared_core.embedded import EMBEDDED_LMS, cache_dir
from shared_core.models import load_lm
from shared_core.tool_calls import check_tools, render_prompt

NAME = "qwen2.5-coder-1.5b-instruct"
lm = load_lm(NAME, backend="llama.cpp")
gguf = str(cache_dir() / "gguf" / EMBEDDED_LMS[NAME].gguf_name)
llama = Llama(gguf, n_ctx=2048, n_threads=1, verbose=False, logits_all=True)
TOOL = {"type": "function", "function": {
    "name": "search_handbook",
    "description": "Search the Veldmark employee handbook and return the most relevant passages.",
    "parameters": {"properties": {"query": {"type": "string"}}, "required": ["query"],
                   "type": "object"}}}
RESULT = ("Veldmark Ltd employee handbook: every employee gets 27 days of paid vacation per year.\n"
          "Veldmark Ltd working hours: the core hours are 10:00 to 15:00, Monday to Friday.")
QUESTION = ("How many days of paid vacation do Veldmark employees get? "
            "Use the handbook search tool.")
PLAIN = "You are a helpful assistant. Answer from the handbook search results."
SYSTEMS = {
    "plain (examples/agents.py before)": PLAIN,
    "stop (examples/agents.py now)": PLAIN + " Once a <tool_response> holds the answer, reply "
                                             "with that answer in one sentence.",
    "call once, answer after": PLAIN + " Always call the tool first. Once a <tool_response> "
                                       "holds the answer, reply with that answer in one sentence.",
    "never repeat a call": PLAIN + " When you see a <tool_response>, answer the user's question "
                                   "from it in one sentence; never repeat a call.",
}


def turns(system: str, after_tool: bool) -> list[dict]:
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}]
    if after_tool:
        msgs += [{"role": "assistant", "content": "", "tool_calls": [
                     {"name": "search_handbook", "id": "call_1",
                      "arguments": {"query": "Veldmark vacation days"}}]},
                 {"role": "tool", "content": RESULT, "tool_call_id": "call_1"}]
    return msgs


def probe(msgs: list[dict]) -> tuple[list[tuple[str, float]], str, int]:
    ids = render_prompt(lm, msgs, check_tools([TOOL]))
    llama.reset()
    llama.eval(ids)
    logits = np.array(llama.scores[llama.n_tokens - 1])
    p = np.exp(logits - logits.max())
    p /= p.sum()
    top = [(llama.detokenize([int(i)]).decode(errors="replace"), round(float(p[i]), 3))
           for i in np.argsort(-p)[:6]]
    out: list[int] = []
    for _ in range(48):
        token = int(np.argmax(llama.scores[llama.n_tokens - 1]))
        if token in (151643, 151645):  # <|endoftext|>, <|im_end|>
            break
        out.append(token)
        llama.eval([token])
    return top, llama.detokenize(out).decode(errors="replace"), len(ids)


for name, system in SYSTEMS.items():
    for after_tool in (False, True):
        top, reply, n = probe(turns(system, after_tool))
        where = "after the tool result" if after_tool else "first turn"
        sys.stdout.write(f"== {name}, {where} ({n} prompt tokens)\n   next token: {top}\n"
                         f"   greedy: {reply!r}\n")
