"""Another engine process sharing a Mooncake master (``test_tiers_shared.py`` runs it).

``python -m tests.engine.tier_peer MASTER MODEL SALT PAGE_SIZE PROMPT_JSON`` serves one prompt
with the Mooncake Store below its device (no host memory), evicts it into the store, prints
``{"output_ids": [...], "written": n}`` as one line, then keeps its store client (whose
mounted segment may hold the objects) until its stdin closes.
"""

from __future__ import annotations

import json
import sys

from hybridkv.engine.config import EngineConfig
from hybridkv.engine.engine import Engine
from hybridkv.engine.random_models import build_random


def main(argv: list[str]) -> int:
    master, name, salt, page_size, ids = argv[0], argv[1], argv[2], int(argv[3]), json.loads(argv[4])
    hf, _ = build_random(name)
    engine = Engine(
        hf.config,
        hf,
        EngineConfig(
            gpu_memory=400_000,
            page_size=page_size,
            chunk_size=8,
            max_context=96,
            store="mooncake",
            store_master=master,
            store_memory="32MiB",
        ),
    )
    try:
        out = engine.generate([ids], 6, cache_salts=[salt])[0]
        engine.clear_cache()
        assert engine.tiers is not None
        written = engine.tiers.hierarchy.counters.written_objects["mooncake"]
        print(json.dumps({"output_ids": out.output_ids, "written": written}), flush=True)
        sys.stdin.read()
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
