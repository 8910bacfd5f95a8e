"""Adapters (see the package __init__ for the public names)."""
