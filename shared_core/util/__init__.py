"""Standard-library helpers (layer 0): lazy attributes, the file lock, credential redaction, device and
thread resolution."""
