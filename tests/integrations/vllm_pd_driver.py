"""Run by a vLLM venv's python (not by pytest): the pieces of the PD test that need vLLM in-process.

    python tests/integrations/vllm_pd_driver.py build DIR            # the tiny Gemma 3 (fp32), seeded
    python tests/integrations/vllm_pd_driver.py reference DIR IN OUT # greedy tokens of IN's prompts, no connector

``reference`` serves the model with ``vllm.LLM`` exactly as the PD servers do (block 32, prefix caching,
chunked prefill of 96 tokens, fp32), without a connector, and writes the tokens of each prompt (8 greedy
tokens, EOS ignored) as JSON. The model and the greedy settings are ``vllm_connector_driver``'s.
"""

from __future__ import annotations

import json
import sys

from vllm_connector_driver import BLOCK, build_model, generate, make_llm


def main() -> None:
    what, directory = sys.argv[1], sys.argv[2]
    if what == "build":
        build_model("gemma3", directory)
        return
    with open(sys.argv[3]) as f:
        prompts = json.load(f)
    llm = make_llm(directory, False, 3 * BLOCK)
    tokens, _, _ = generate(llm, prompts)
    with open(sys.argv[4], "w") as f:
        json.dump(tokens, f)


if __name__ == "__main__":
    main()
