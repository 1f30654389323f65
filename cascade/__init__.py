"""cascade: lossless long-context generation with a hierarchical speculate-verify cascade."""

__version__ = "0.1.0"
