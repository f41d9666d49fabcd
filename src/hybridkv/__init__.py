"""hybridkv: the memory and transfer layer of an LLM serving engine for hybrid models."""

__version__ = "0.1.0"
