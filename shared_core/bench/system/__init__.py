"""Benchmarks of the machine and runtimes: the decoding core, forward cost, llama.cpp speed and exact
mode, memory, probes, the GPU check, the passage cache."""
