"""Write a tiny random hybrid model as a model directory: ``config.json`` + ``model.safetensors``.

    .venv/bin/python examples/make_tiny_model.py out/tiny-model [tiny-qwen3-next]

The weights are hybridkv's tiny random model of that name (the same every run: a fixed seed), saved as
``transformers`` saves a model, so ``hybridkv generate --model DIR`` / ``serve --model DIR`` and
``transformers`` itself load it. The names: ``hybridkv presets`` lists them (the ``tiny-*`` ones).
"""

from __future__ import annotations

import sys
from pathlib import Path

from hybridkv.engine.random_models import save_random, tiny_names


def main(argv: list[str]) -> int:
    if not 1 <= len(argv) <= 2:
        print(f"usage: make_tiny_model.py DIR [{'|'.join(tiny_names())}]", file=sys.stderr)
        return 2
    name = argv[1] if len(argv) == 2 else "tiny-qwen3-next"
    if name not in tiny_names():
        print(f"error: {name!r} is not a tiny model; choose one of {', '.join(tiny_names())}", file=sys.stderr)
        return 2
    out = Path(argv[0])
    out.mkdir(parents=True, exist_ok=True)
    save_random(name, str(out))
    print(f"wrote {name} to {out}/ (config.json + safetensors)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
