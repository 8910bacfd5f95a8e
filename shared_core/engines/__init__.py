"""Engines: one module per paper (see DESIGN §1)."""
