"""``python -m cascade.serve``: an OpenAI-compatible HTTP server over ``cascade.LLM`` (``app``)."""
