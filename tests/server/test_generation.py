"""The engine thread -> event loop bridge (``generation``) on a real ``EngineBackend``: how often the loop
is woken, and that every token and the end arrive, in order, either way."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from hybridkv.engine.engine import Engine
from hybridkv.engine.request import FinishReason, SamplingParams
from hybridkv.server import EngineBackend
from hybridkv.server.generation import Generation, LoopPost
from tests.server.conftest import MODEL, SIZING

PROMPT = list(range(3, 40))
NEW = 8


async def _follow(backend: EngineBackend, stream: bool) -> tuple[list[list[int]], int, Generation]:
    """The tokens of each burst ``updates`` gave, and how many times the loop was woken."""
    post = LoopPost(asyncio.get_running_loop())
    wakes = 0
    deliver = post._deliver

    def counted() -> None:
        nonlocal wakes
        wakes += 1
        deliver()

    post._deliver = counted  # type: ignore[method-assign]
    gen = Generation(backend, post, [PROMPT], stream)
    gen.start([SamplingParams(max_new_tokens=NEW, ignore_eos=True)], f"salt-{stream}")
    bursts = []
    async with asyncio.timeout(60):
        async for updates in gen.updates():
            (up,) = updates
            bursts.append(up.new_tokens)
    return bursts, wakes, gen


def test_a_plain_generation_wakes_the_loop_once_a_stream_once_per_step(make_engine: Callable[..., Engine]) -> None:
    backend = EngineBackend(make_engine(), MODEL, SIZING["gpu_memory"])
    try:
        reference = list(make_engine().generate([PROMPT], NEW, stop_at_eos=False)[0].output_ids)
        plain, plain_wakes, gen = asyncio.run(_follow(backend, stream=False))
        assert plain_wakes == 1 and plain == [reference]  # every token rode along with the end
        p = gen.progress[0]
        assert p.finished is not None and p.finished.finish_reason is FinishReason.LENGTH
        assert p.first_at is not None and p.last_at is not None and p.first_at < p.last_at  # stamped per token
        streamed, stream_wakes, _ = asyncio.run(_follow(backend, stream=True))
        # one wake-up per step, each with its token (the end: with the last token or, posted after the loop
        # took that one, alone)
        assert stream_wakes == len(streamed) and NEW <= len(streamed) <= NEW + 1
        assert all(len(burst) == 1 for burst in streamed[:NEW])
        assert [t for burst in streamed for t in burst] == reference
    finally:
        backend.close(10)
