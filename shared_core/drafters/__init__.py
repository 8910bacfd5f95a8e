"""Drafters: one module per draft source."""
