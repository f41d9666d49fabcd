"""Adapters that plug hybridkv into other serving engines.

``hybridkv.integrations.vllm``: ``HybridKVConnector``, a vLLM V1 KV connector that offloads vLLM's
KV blocks into hybridkv's host tier and restores prefix hits from it under hybridkv's hit rule.
Nothing in the core packages imports this package; each adapter imports its engine lazily.
"""
