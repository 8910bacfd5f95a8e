"""The framework-neutral adapter core (layer 4): what both frameworks' chat and RAG adapters call,
their settings, pickling, streams and the shared model cache."""
