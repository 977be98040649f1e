"""EngineReplica.shutdown (what Serve's graceful stop and SIGTERM end in) with the real
AsyncEngine on a tiny random model, no Ray: running streams finish within the drain
timeout, and past it they end cleanly with finish_reason "abort" instead of hanging.
"""

from __future__ import annotations

import asyncio

import pytest

from deployments.contract import EngineRequest
from deployments.replica import EngineReplica
from engine.errors import EngineDeadError
from engine.sampling import SamplingParams

ENGINE = {"device": "cpu", "dtype": "float32", "max_num_seqs": 4, "block_size": 16, "num_kv_blocks": 256,
          "max_model_len": 1024, "num_threads": 1}


def _request(rid: str, max_tokens: int) -> dict:
    return EngineRequest(request_id=rid, prompt_token_ids=[5, 6, 7, 8], priority=0, params=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))


async def _collect(gen) -> list[dict]:
    return [m async for m in gen]


async def _started(replica: EngineReplica, n: int) -> None:
    for _ in range(500):
        if replica.record_autoscaling_stats()["slot_occupancy"] * ENGINE["max_num_seqs"] >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError("requests did not start")


@pytest.mark.timeout(120)
def test_shutdown_lets_running_streams_finish(tiny_model_dir):
    async def main():
        replica = EngineReplica(str(tiny_model_dir), ENGINE, drain_timeout_s=60)
        streams = [asyncio.ensure_future(_collect(replica.generate(_request(f"r{i}", 120)))) for i in range(2)]
        await _started(replica, 2)
        await asyncio.wait_for(replica.shutdown(), 60)
        for stream in streams:
            messages = stream.result()  # done: shutdown waited for them
            assert messages[-1].finish_reason == "length"
            assert sum(len(m.token_ids) for m in messages) == 120
        with pytest.raises(EngineDeadError, match="shutting down"):
            await replica.generate(_request("late", 4)).__anext__()
    asyncio.run(main())


@pytest.mark.timeout(120)
def test_past_the_drain_timeout_streams_end_with_abort(tiny_model_dir):
    async def main():
        replica = EngineReplica(str(tiny_model_dir), ENGINE, drain_timeout_s=0.3)
        # ~1,000 steps: far longer than the drain timeout.
        stream = asyncio.ensure_future(_collect(replica.generate(_request("long", 1000))))
        await _started(replica, 1)
        await asyncio.wait_for(replica.shutdown(), 30)
        messages = await asyncio.wait_for(stream, 10)
        assert messages[-1].finish_reason == "abort"
        assert 0 < sum(len(m.token_ids) for m in messages) < 1000
    asyncio.run(main())
