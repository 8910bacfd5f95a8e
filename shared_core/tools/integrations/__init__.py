"""Plug-ins for other systems' extension hooks (e.g. vLLM's ``custom_class`` proposer)."""
