"""Disaggregated serving: a router, a prefill engine (PP x TP processes) and a decode engine (TP processes)."""

from hybridkv.engine.disagg.config import PD_ENGINE, PDConfig, check_layout
from hybridkv.engine.disagg.engines import PDStartError
from hybridkv.engine.disagg.faults import Fault
from hybridkv.engine.disagg.path import PDPath, RequestTiming, StageTiming
from hybridkv.engine.disagg.pd import PDResult, run_pd
from hybridkv.engine.disagg.results import FAILED, FINISHED, PDRank, WorkerState, pd_path
from hybridkv.engine.disagg.server import PDServer

__all__ = [
    "FAILED",
    "FINISHED",
    "PD_ENGINE",
    "Fault",
    "PDConfig",
    "PDPath",
    "PDRank",
    "PDResult",
    "PDServer",
    "PDStartError",
    "RequestTiming",
    "StageTiming",
    "WorkerState",
    "check_layout",
    "pd_path",
    "run_pd",
]
