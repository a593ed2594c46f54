"""DPAsyncLLM's supervision over fake replicas (no engine processes): bounded restarts with
backoff, the client dead only once every replica has failed, adapters registered in every
replica and again in a restarted one, requests never sent to a replica that is down."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time
from types import SimpleNamespace

import pytest

from serving.core.lora_request import LoRARequest
from serving.engine.data_parallel import DPAsyncLLM
from serving.engine.exceptions import EngineDeadError


class FakeReplica:
    """What DPAsyncLLM uses of an MPAsyncLLM."""

    def __init__(self, index: int):
        self.index = index
        self.engine = SimpleNamespace(page_size=16, model_config=SimpleNamespace(vocab_size=100),
                                      model_path="fake", tokenizer=None)
        self.step_listeners: list = []
        self.dead_listeners: list = []
        self.loras: dict[str, LoRARequest] = {}
        self.served: list[str] = []
        self.closed = False
        self.num_streams = 0

    def stats(self) -> dict:
        return {"num_total_pages": 64, "kv_cache_usage": 0.0, "num_running": 0}

    def die(self) -> None:
        for listener in self.dead_listeners:
            listener(RuntimeError(f"replica {self.index} exited"))

    def _request(self, name, *args):
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(getattr(self, f"_{name}")(*args))
        return future

    def _add_lora(self, lora: LoRARequest) -> bool:
        added = lora.lora_name not in self.loras
        self.loras[lora.lora_name] = lora
        return added

    async def add_lora(self, lora: LoRARequest) -> bool:
        return self._add_lora(lora)

    async def remove_lora(self, name: str) -> bool:
        return self.loras.pop(name, None) is not None

    async def generate(self, prompt, params, request_id, **kw):
        self.served.append(request_id)
        yield request_id

    def shutdown(self) -> None:
        self.closed = True


class FakeDP(DPAsyncLLM):
    """Replicas are FakeReplicas; `fail_starts[i]`: how many of replica i's next starts fail."""

    def __init__(self, **kwargs):
        self.launched: list[list[FakeReplica]] = [[], []]
        self.fail_starts = [0, 0]
        self.restart_gate = threading.Event()  # restarts wait for it
        self.restart_gate.set()
        super().__init__(None, data_parallel_size=2, restart_backoff_s=0.0, **kwargs)

    def _launch(self, replica):
        if self.launched[replica.index]:
            self.restart_gate.wait(10)
        if self.fail_starts[replica.index]:
            self.fail_starts[replica.index] -= 1
            raise RuntimeError(f"replica {replica.index} failed to start")
        fake = FakeReplica(replica.index)
        self.launched[replica.index].append(fake)
        return fake


def wait_for(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert condition()


async def served_by(dp, prompt_ids) -> list[str]:
    return [o async for o in dp.generate({"prompt_token_ids": prompt_ids})]


def test_a_dead_replica_restarts_and_gets_the_adapters_registered_before():
    dp = FakeDP()
    lora = LoRARequest("sql", 1, "/loras/sql")
    assert asyncio.run(dp.add_lora(lora)) is True
    assert all("sql" in fakes[0].loras for fakes in dp.launched)
    first = dp.launched[1][0]
    first.die()
    wait_for(lambda: dp.replicas[1].state == "serving" and len(dp.launched[1]) == 2)
    restarted = dp.launched[1][1]
    assert first.closed and restarted.loras == {"sql": lora}
    assert dp.replicas[1].num_restarts == 1 and dp.dead is None
    # removed adapters are not replayed
    asyncio.run(dp.remove_lora("sql"))
    restarted.die()
    wait_for(lambda: len(dp.launched[1]) == 3 and dp.replicas[1].state == "serving")
    assert dp.launched[1][2].loras == {}
    dp.shutdown()


def test_restarts_are_bounded_and_the_client_dies_only_when_every_replica_has_failed():
    dp = FakeDP(max_restarts=2)
    dead: list[BaseException] = []
    dp.dead_listeners.append(dead.append)
    dp.fail_starts[1] = 10
    dp.launched[1][0].die()
    wait_for(lambda: dp.replicas[1].state == "failed")
    assert dp.fail_starts[1] == 10 - 2  # two tries, then it stays down
    assert dp.dead is None and not dead
    ok, body = dp.health()
    assert ok and [r["state"] for r in body["replicas"]] == ["serving", "failed"]
    assert "failed to start" in body["replicas"][1]["error"]
    # requests go to the one that serves
    assert asyncio.run(served_by(dp, [1] * 40)) and dp.launched[0][0].served
    dp.fail_starts[0] = 10
    dp.launched[0][0].die()
    wait_for(lambda: dp.dead is not None)
    assert dead and "every data-parallel replica failed" in str(dead[0])
    assert dp.health()[0] is False
    with pytest.raises(EngineDeadError, match="no data-parallel replica is serving"):
        asyncio.run(served_by(dp, [1] * 40))
    dp.shutdown()


def test_a_replica_that_is_restarting_gets_no_requests():
    dp = FakeDP()
    dp.restart_gate.clear()
    dp.fail_starts[1] = 1  # its first restart fails, the second serves
    dp.launched[1][0].die()
    assert dp.replicas[1].state == "restarting"
    for i in range(4):  # distinct prompts: the least loaded would alternate
        asyncio.run(served_by(dp, [i + 1] * 40))
    assert len(dp.launched[0][0].served) == 4 and not dp.launched[1][0].served
    dp.restart_gate.set()
    wait_for(lambda: dp.replicas[1].state == "serving")
    assert dp.replicas[1].num_restarts == 1 and len(dp.launched[1]) == 2
    asyncio.run(served_by(dp, [9] * 3))  # it took fewer so far: it takes the next
    assert dp.launched[1][1].served
    dp.shutdown()
