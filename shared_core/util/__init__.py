"""Standard-library helpers (layer 0): lazy attributes, the file lock, per-object registries,
credential redaction, device and thread resolution."""
