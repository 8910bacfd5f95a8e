"""What every engine shares between the runtime and its rounds (layer 1): pure verification, draft
length, output handling, tool calls, constrained decoding, stats."""
