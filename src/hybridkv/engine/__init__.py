"""hybridkv.engine: a small reference engine that serves real hybrid models through UnifiedMemory.

Model code reads and writes K/V only through ``UnifiedMemory.view`` indexed by translated
token slots, and recurrent state only through state slots; ``transformers`` is the oracle
the tests compare against, never a runtime dependency of the forward pass.
"""
