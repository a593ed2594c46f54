"""Data parallelism behind one server (`qwen-jax serve --data-parallel-size N`, vLLM's
option): `DPAsyncLLM` keeps `AsyncLLM`'s interface over N engine processes (each an
`MPAsyncLLM`, serving/engine/process.py), every one on devices of its own with its own
TP x EP mesh, behind one API server and one port.

Devices: replica i's process sees devices [i * R, (i + 1) * R) of the host (R = TP x EP)
through CUDA_VISIBLE_DEVICES, the slice of the caller's own list when it has one (vLLM sets
it per DP engine core the same way), so each process's jax takes only its GPUs. On a CPU
every process has host devices of its own.

Routing: serving/core/replica_router.py, by the page hashes of the request's prompt (prefix
affinity, balanced by each replica's unfinished requests). Aborts and disconnects go to
the replica that has the request.

Failures: a replica whose engine process exits or whose step fails fails its own
requests (EngineDeadError: 500s, or an error event in a stream) while the others serve;
`health()` (the server's /health) gives each replica's state. The replica is started again
after `restart_backoff_s`, doubled per try, at most `max_restarts` tries in a row (a
replica that dies within STABLE_S seconds of its start continues the count); then it stays
failed. Adapters registered at run time are registered again in a restarted replica. When
every replica has failed, the client is dead (`dead_listeners`: the server exits for its
supervisor).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable

from serving.core.lora_request import LoRARequest
from serving.core.page_pool import lora_seed, prompt_page_hashes
from serving.core.replica_router import ROUTING_POLICIES, ReplicaLoad, ReplicaRouter
from serving.core.request import RequestOutput, SamplingParams, prompt_token_ids
from serving.engine.config import engine_config_from_kwargs
from serving.engine.exceptions import EngineDeadError
from serving.engine.process import MPAsyncLLM

logger = logging.getLogger(__name__)

STABLE_S = 60.0  # a replica serving this long before it dies starts its tries afresh
# Stats that are one replica's setting, not a count to add up across replicas.
_PER_REPLICA = ("bytes_per_page", "max_loras")
# Ratios recomputed from the summed counts: (numerator, denominator).
_RATIOS = {"kv_cache_usage": ("num_used_pages", "num_total_pages"),
           "prefix_cache_hit_rate": ("prefix_cache_hits", "prefix_cache_queries"),
           "swap_space_usage": ("num_used_host_pages", "num_host_pages")}


def visible_devices(data_parallel_size: int, replica_size: int,
                    visible: str | None) -> list[str]:
    """Each replica's CUDA_VISIBLE_DEVICES: consecutive slices of `visible` (the caller's
    list; None: devices 0, 1, ...)."""
    need = data_parallel_size * replica_size
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible else \
        [str(i) for i in range(need)]
    if len(ids) < need:
        raise ValueError(f"data_parallel_size x tensor_parallel_size x expert_parallel_size = "
                         f"{need} devices, but CUDA_VISIBLE_DEVICES={visible!r} lists "
                         f"{len(ids)}")
    return [",".join(ids[i * replica_size:(i + 1) * replica_size])
            for i in range(data_parallel_size)]


def merge_stats(replica_stats: list[dict]) -> dict:
    """The replicas' stats as one engine's: counts summed (lists of counts position by
    position, lists of names joined), ratios recomputed, settings from the first."""
    merged: dict = {}
    for key, first in replica_stats[0].items():
        values = [s[key] for s in replica_stats if key in s]
        if key in _PER_REPLICA or not isinstance(first, (int, float, list)):
            merged[key] = first
        elif isinstance(first, list) and all(isinstance(v, str) for v in sum(values, [])):
            merged[key] = sorted(set().union(*values))
        elif isinstance(first, list):
            merged[key] = [sum(column) for column in itertools.zip_longest(*values, fillvalue=0)]
        else:
            merged[key] = sum(values)
    for key, (num, den) in _RATIOS.items():
        if key in merged and num in merged and den in merged:
            merged[key] = merged[num] / merged[den] if merged[den] else 0.0
    if merged.get("spec_decode_num_drafts"):
        merged["spec_decode_mean_acceptance_length"] = (
            1 + merged["spec_decode_num_accepted_tokens"] / merged["spec_decode_num_drafts"])
    return merged


class Replica:
    """One engine process and what the API process knows of it."""

    def __init__(self, index: int, devices: str):
        self.index, self.devices = index, devices
        self.llm: MPAsyncLLM | None = None
        self.state = "starting"  # serving, restarting, failed
        self.error: str | None = None  # why it last died
        self.started_at = 0.0
        self.tries = 0  # restarts in a row without serving STABLE_S seconds
        self.num_restarts = 0
        self.num_unfinished = 0  # requests routed here and not finished (event loop only)

    def load(self) -> ReplicaLoad:
        llm = self.llm
        usage = llm.stats().get("kv_cache_usage", 0.0) if llm is not None else 1.0
        return ReplicaLoad(self.state == "serving", self.num_unfinished, usage)


class DPAsyncLLM:
    """AsyncLLM's interface over `data_parallel_size` engine processes."""

    def __init__(self, model: str | None = None, *, data_parallel_size: int,
                 data_parallel_routing: str = "prefix", max_restarts: int = 3,
                 restart_backoff_s: float = 2.0, engine_hook: tuple | None = None, **kwargs):
        config = engine_config_from_kwargs(model, data_parallel_size=data_parallel_size,
                                           **kwargs)  # bad arguments fail here, once
        if max_restarts < 0 or restart_backoff_s < 0:
            raise ValueError(f"max_restarts ({max_restarts}) and restart_backoff_s "
                             f"({restart_backoff_s}) must be >= 0")
        self._model, self._kwargs, self._hook = model, kwargs, engine_hook
        self.max_restarts, self.restart_backoff_s = max_restarts, restart_backoff_s
        devices = visible_devices(data_parallel_size, config.parallel.replica_size,
                                  os.environ.get("CUDA_VISIBLE_DEVICES"))
        self.replicas = [Replica(i, d) for i, d in enumerate(devices)]
        self.step_listeners: list[Callable[[dict, list[RequestOutput]], None]] = []
        self.dead_listeners: list[Callable[[BaseException], None]] = []
        self.dead: BaseException | None = None
        self._owner: dict[str, Replica] = {}  # request id -> its replica
        self._loras: dict[str, LoRARequest] = {}  # registered at run time: replayed
        self._lock = threading.Lock()  # replica states; one step listener at a time
        self._closed = threading.Event()
        self._start_all()
        first = self.replicas[0].llm
        assert first is not None
        self.engine = first.engine
        self.router = ReplicaRouter(data_parallel_size, data_parallel_routing,
                                    capacity_pages=first.stats()["num_total_pages"])

    def _start_all(self) -> None:
        """Every replica at once (each loads and compiles in its own process)."""
        with concurrent.futures.ThreadPoolExecutor(len(self.replicas)) as pool:
            futures = [pool.submit(self._launch, r) for r in self.replicas]
        errors = [f.exception() for f in futures if f.exception() is not None]
        if errors:  # the others' processes stop too
            for future in futures:
                if future.exception() is None:
                    future.result().shutdown()
            raise errors[0]  # type: ignore[misc]
        for replica, future in zip(self.replicas, futures):
            self._attach(replica, future.result())

    def _launch(self, replica: Replica) -> MPAsyncLLM:
        env = {"CUDA_VISIBLE_DEVICES": replica.devices}
        return MPAsyncLLM(self._model, engine_hook=self._hook, env=env, **self._kwargs)

    def _attach(self, replica: Replica, llm: MPAsyncLLM) -> None:
        llm.step_listeners.append(lambda info, outputs: self._on_step(info, outputs))
        llm.dead_listeners.append(lambda exc: self._on_dead(replica, llm, exc))
        with self._lock:
            replica.llm, replica.state = llm, "serving"
            replica.started_at = time.monotonic()

    def _on_step(self, step_info: dict, outputs: list[RequestOutput]) -> None:
        with self._lock:  # replicas' reader threads: the listeners have one writer at a time
            for listener in self.step_listeners:
                try:
                    listener(step_info, outputs)
                except Exception:  # an observer's bug must not stop the outputs
                    logger.exception("step listener %r failed", listener)

    # ---- failures and restarts ------------------------------------------------------------
    def _on_dead(self, replica: Replica, llm: MPAsyncLLM, exc: BaseException) -> None:
        """A replica's engine died (its reader thread): restart it after a backoff."""
        with self._lock:
            if replica.llm is not llm or self._closed.is_set():
                return
            replica.error = repr(exc)
            stable = time.monotonic() - replica.started_at >= STABLE_S
            replica.tries = 1 if stable else replica.tries + 1
            replica.state = "restarting"
        logger.error("data-parallel replica %d died (%r); %d of %d restarts in a row",
                     replica.index, exc, replica.tries, self.max_restarts)
        threading.Thread(target=self._restart, args=(replica,), daemon=True,
                         name=f"qwen-jax-replica-{replica.index}-restart").start()

    def _restart(self, replica: Replica) -> None:
        while replica.tries <= self.max_restarts:
            delay = self.restart_backoff_s * 2 ** (replica.tries - 1)
            if self._closed.wait(delay):
                return
            if replica.llm is not None:
                replica.llm.shutdown()
            try:
                llm = self._launch(replica)
                for lora in list(self._loras.values()):
                    llm._request("add_lora", lora).result()
            except Exception as exc:
                replica.error = repr(exc)
                replica.tries += 1
                logger.error("data-parallel replica %d failed to start: %r", replica.index, exc)
                continue
            if self._closed.is_set():
                llm.shutdown()
                return
            self.router.forget(replica.index)
            replica.num_restarts += 1
            self._attach(replica, llm)
            logger.info("data-parallel replica %d serves again", replica.index)
            return
        with self._lock:
            replica.state = "failed"
            failed = all(r.state == "failed" for r in self.replicas)
        logger.critical("data-parallel replica %d failed %d restarts; it stays down",
                        replica.index, self.max_restarts)
        if failed:
            self._die(RuntimeError(f"every data-parallel replica failed ({self.describe()})"))

    def _die(self, exc: BaseException) -> None:
        if self.dead is None:
            self.dead = exc
            for listener in self.dead_listeners:
                listener(exc)

    def describe(self) -> str:
        return ", ".join(f"replica {r.index}: {r.state}" for r in self.replicas)

    def health(self) -> tuple[bool, dict]:
        """(any replica serving, each replica's state): the server's /health."""
        replicas = [{"engine": str(r.index), "state": r.state, "restarts": r.num_restarts,
                     **({"error": r.error} if r.error and r.state != "serving" else {})}
                    for r in self.replicas]
        return any(r.state == "serving" for r in self.replicas), {"replicas": replicas}

    # ---- requests ---------------------------------------------------------------------------
    def _route(self, prompt, lora_request: LoRARequest | None) -> Replica:
        hashes: list[int] = []
        if self.router.policy == "prefix":
            vocab_size = self.engine.model_config.vocab_size  # type: ignore[attr-defined]
            _, ids = prompt_token_ids(prompt, self.tokenizer, vocab_size, self.engine.model_path)
            hashes = prompt_page_hashes(ids, self.engine.page_size, lora_seed(lora_request))
        try:
            return self.replicas[self.router.choose(hashes, [r.load() for r in self.replicas])]
        except ValueError:
            raise EngineDeadError(f"no data-parallel replica is serving ({self.describe()})"
                                  ) from None

    async def generate(self, prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, priority: int = 0,
                       lora_request: LoRARequest | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """AsyncLLM.generate on the replica the router picks."""
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._owner:
            raise ValueError(f"request_id {request_id!r} is already in use")
        replica = self._route(prompt, lora_request)
        llm = replica.llm
        assert llm is not None
        self._owner[request_id] = replica
        replica.num_unfinished += 1
        outputs = llm.generate(prompt, sampling_params, request_id, priority=priority,
                               lora_request=lora_request)
        assert isinstance(outputs, AsyncGenerator)
        try:
            async for output in outputs:
                yield output
        finally:
            await outputs.aclose()  # left early: the abort reaches its replica now
            replica.num_unfinished -= 1
            self._owner.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        replica = self._owner.get(request_id)
        if replica is not None and replica.llm is not None:
            await replica.llm.abort(request_id)

    def _serving(self) -> list[MPAsyncLLM]:
        return [r.llm for r in self.replicas if r.state == "serving" and r.llm is not None]

    def _first_serving(self) -> MPAsyncLLM:
        serving = self._serving()
        if not serving:
            raise EngineDeadError(f"no data-parallel replica is serving ({self.describe()})")
        return serving[0]

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Registered in every serving replica (and in those that start again later)."""
        added = await self._first_serving().add_lora(lora_request)  # a bad adapter: here
        for llm in self._serving()[1:]:
            await llm.add_lora(lora_request)
        self._loras[lora_request.lora_name] = lora_request
        return added

    async def remove_lora(self, lora_name: str) -> bool:
        self._loras.pop(lora_name, None)
        removed = [await llm.remove_lora(lora_name) for llm in self._serving()]
        return any(removed)

    async def list_loras(self) -> list[LoRARequest]:
        return await self._first_serving().list_loras()

    # ---- what the server reads --------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def replica_stats(self) -> list[tuple[int, bool, dict]]:
        """(index, serving, its last stats) per replica: /metrics labels each engine."""
        return [(r.index, r.state == "serving", r.llm.stats() if r.llm is not None else {})
                for r in self.replicas]

    def stats(self) -> dict:
        return merge_stats([s for _, _, s in self.replica_stats() if s])

    @property
    def num_streams(self) -> int:
        return sum(r.llm.num_streams for r in self.replicas if r.llm is not None)

    async def wait_until_idle(self, timeout: float) -> bool:
        deadline = asyncio.get_running_loop().time() + timeout
        for llm in self._serving():
            left = deadline - asyncio.get_running_loop().time()
            if not await llm.wait_until_idle(max(left, 0.0)):
                return False
        return True

    async def abort_all(self) -> None:
        for llm in self._serving():
            await llm.abort_all()

    def shutdown(self) -> None:
        self._closed.set()
        for replica in self.replicas:
            if replica.llm is not None:
                replica.llm.shutdown()


__all__ = ["ROUTING_POLICIES", "DPAsyncLLM", "merge_stats", "visible_devices"]
