"""What a user would otherwise run, measured beside cascade by ``scripts/bench.py``: llama.cpp.

- ``llamacpp``: building llama.cpp's tools from the sources the llama-cpp-python sdist vendors.
- ``convert``: a cascade checkpoint as GGUF files (bf16, q8_0), and their YaRN-stretched copies.
- ``llama_bench``: ``llama-bench`` runs (prompt processing, token generation at a KV depth), parsed.
- ``speculative``: ``llama-speculative`` runs (a draft GGUF proposing to a target GGUF), parsed.

``python -m cascade.peers build`` builds the tools and converts the default target once.
"""
