"""Run by a vLLM venv's python (not by pytest): the pieces of the PD test that need vLLM in-process.

    python tests/integrations/vllm_pd_driver.py build KIND DIR            # gemma3 or qwen3next, seeded
    python tests/integrations/vllm_pd_driver.py reference KIND DIR IN OUT # greedy tokens of IN's prompts

``reference`` serves the model with ``vllm.LLM`` as the PD servers do (the kind's block size and dtype:
Gemma 3 fp32 in blocks of 32, Qwen3-Next bf16 in blocks of 64; prefix caching, chunked prefill of 3
blocks), without a connector, and writes the tokens of each prompt (8 greedy tokens, EOS ignored) as
JSON. The models and the greedy settings are ``vllm_connector_driver``'s.
"""

from __future__ import annotations

import json
import sys

from vllm_connector_driver import BLOCK, BLOCKS, DTYPES, build_model, generate, make_llm


def main() -> None:
    what, kind, directory = sys.argv[1:4]
    if what == "build":
        build_model(kind, directory)
        return
    with open(sys.argv[4]) as f:
        prompts = json.load(f)
    block = BLOCKS.get(kind, BLOCK)
    llm = make_llm(directory, False, 3 * block, block=block, dtype=DTYPES.get(kind, "float32"))
    tokens, _, _ = generate(llm, prompts)
    with open(sys.argv[5], "w") as f:
        json.dump(tokens, f)


if __name__ == "__main__":
    main()
