"""Disaggregated serving: pipeline-parallel prefill processes hand KV and state to tensor-parallel decode ones."""

from hybridkv.engine.disagg.pd import PDConfig, PDRank, PDResult, RequestTiming, check_layout, run_pd

__all__ = ["PDConfig", "PDRank", "PDResult", "RequestTiming", "check_layout", "run_pd"]
