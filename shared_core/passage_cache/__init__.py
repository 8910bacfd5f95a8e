"""Passage (chunk) KV reuse: reuse precomputed passage KV anywhere in a prompt (issue 36)."""
