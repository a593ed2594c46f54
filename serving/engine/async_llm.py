"""AsyncLLM: the engine loop in a background thread, asyncio streams for callers
(`EngineClient` is what it shares with MPAsyncLLM, whose engine steps in a process of its
own: serving/engine/process.py).

Only the engine thread touches the engine: callers submit commands (add, abort) through a
queue and await their result, and outputs come back on per-request asyncio queues.

Failures come in two kinds. A step that raises leaves the device state untrusted (the KV
cache was donated to the failed call) and the scheduler mid-step, so the engine is dead:
every stream and every later call gets `EngineDeadError` and `dead_listeners` are told, so
a server can report it and exit for its supervisor to restart it (vLLM's behaviour). A
failure confined to one request's output (the engine ends it with finish_reason "error")
raises `RequestFailedError` in that request's stream only.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from serving.core.lora_request import LoRARequest
from serving.core.request import RequestMetrics, RequestOutput, RequestOutputKind, SamplingParams
from serving.engine.config import one_replica_config
from serving.engine.exceptions import EngineDeadError, RequestFailedError
from serving.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


class RequestStream:
    """A request's reader: its event loop and queue (and, for MPAsyncLLM, what its outputs
    are rebuilt around)."""

    __slots__ = ("loop", "queue", "prompt", "prompt_token_ids", "metrics")

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue):
        self.loop, self.queue = loop, queue
        self.prompt: str | None = None
        self.prompt_token_ids: list[int] = []
        self.metrics: RequestMetrics | None = None

    def put(self, item) -> None:
        """From any thread: `item` onto the queue, on its loop."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # its event loop has closed: nobody is left to read it
            pass


class EngineClient:
    """What AsyncLLM (engine on a thread) and MPAsyncLLM (engine in a process) share:
    a stream per request, the calls the server makes, and how a dead engine reads.
    Subclasses run an engine method by name (`_request`) and deliver step outputs."""

    engine: Any
    dead: BaseException | None = None
    _streams: dict[str, RequestStream]
    _stats: dict

    def _request(self, name: str, *args, **kwargs) -> concurrent.futures.Future:
        """The engine's method `name` called with the arguments; its result as a future."""
        raise NotImplementedError

    def _final_output(self, stream: RequestStream, value) -> RequestOutput:
        """An abort's reply as the output its stream ends with."""
        return value

    # ---- public API ---------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def stats(self) -> dict:
        """The engine's stats as of its last step or call (a snapshot; never blocks)."""
        return dict(self._stats)

    @property
    def num_streams(self) -> int:
        """Requests with a reader (their `generate` not left)."""
        return len(self._streams)

    async def generate(self, prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, priority: int = 0,
                       lora_request: LoRARequest | None = None
                       ) -> AsyncIterator[RequestOutput]:
        """Stream the request's RequestOutputs until it finishes, each as its
        `output_kind` says (cumulative by default; the server asks for DELTA); what waited
        for a reader that fell behind comes as one (`RequestOutput.add`). Leaving the
        loop early (or cancelling the task) aborts the request and frees its pages.
        `lora_request`: the adapter it runs with (registered on first use; None: the base)."""
        request_id = request_id or uuid.uuid4().hex
        # The stream is registered before the engine sees the request (its first output
        # must find it), so a second one must not replace it: the engine's check is too late.
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream = RequestStream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        # A reader that fell behind gets what is waiting as one output (vLLM's collector):
        # DELTA outputs added up, a CUMULATIVE one replaced by the latest. The server then
        # writes one chunk for them, not one each: under load it catches up.
        aggregate = (sampling_params is not None
                     and sampling_params.output_kind == RequestOutputKind.DELTA)
        queue = stream.queue
        finished = False
        later = None  # an error taken from the queue behind outputs: raised after them
        try:
            await asyncio.wrap_future(self._request("add_request", request_id, prompt,
                                                    sampling_params, priority=priority,
                                                    lora_request=lora_request))
            while True:
                if later is None:
                    item = await queue.get()
                else:
                    item, later = later, None
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.error is not None:
                    finished = True
                    raise RequestFailedError(f"request {request_id} failed: {item.error}")
                while not item.finished and not queue.empty():
                    waiting = queue.get_nowait()
                    if isinstance(waiting, BaseException) or waiting.error is not None:
                        later = waiting
                        break
                    item.add(waiting, aggregate)
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._request("abort", request_id)

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with a final output (finish_reason "abort")."""
        final = await asyncio.wrap_future(self._request("abort", request_id))
        stream = self._streams.get(request_id)
        if final is not None and stream is not None:
            stream.put(self._final_output(stream, final))

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Register an adapter (loaded and checked by the engine; ValueError naming the
        field if it is bad). False if it already was."""
        return await asyncio.wrap_future(self._request("add_lora", lora_request))

    async def remove_lora(self, lora_name: str) -> bool:
        """Unregister an adapter (requests using it finish with it); False if unknown."""
        return await asyncio.wrap_future(self._request("remove_lora", lora_name))

    async def list_loras(self) -> list[LoRARequest]:
        return await asyncio.wrap_future(self._request("list_loras"))

    async def wait_until_idle(self, timeout: float) -> bool:
        """True when no request is left within `timeout` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            try:
                if not await asyncio.wrap_future(self._request("has_unfinished_requests")):
                    return True
            except EngineDeadError:  # never idle; its streams have had the error
                return False
            await asyncio.sleep(0.05)
        return False

    async def abort_all(self) -> None:
        for request_id in list(self._streams):
            try:
                await self.abort(request_id)
            except EngineDeadError:  # its streams have had the error already
                return

    def _dead_error(self) -> EngineDeadError:
        return EngineDeadError(f"engine is dead after a failed step or exit ({self.dead!r}); "
                               "the server must be restarted")


class AsyncLLM(EngineClient):
    def __init__(self, model: str | None = None, *, engine: LLMEngine | None = None, **kwargs):
        if engine is None:
            engine = LLMEngine(one_replica_config(model, **kwargs))
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams = {}
        self._running = True
        self.dead = None
        # Called on the engine thread after every step with (step stats, outputs).
        self.step_listeners: list[Callable[[dict, list[RequestOutput]], None]] = []
        # Called once, on the engine thread, with the exception that killed the engine.
        self.dead_listeners: list[Callable[[BaseException], None]] = []
        self._stats = self.engine.stats()
        self._thread = threading.Thread(target=self._loop, name="qwen-jax-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._running = False
        self._wake.set()
        self._thread.join(timeout=10)

    def _request(self, name: str, *args, **kwargs) -> concurrent.futures.Future:
        return self._submit(getattr(self.engine, name), *args, **kwargs)

    # ---- engine thread -----------------------------------------------------------------
    def _submit(self, fn, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self.dead is not None:
            future.set_exception(self._dead_error())
            return future
        self._commands.put((fn, args, kwargs, future))
        self._wake.set()
        return future

    def _call(self, fn, *args, **kwargs):
        return asyncio.wrap_future(self._submit(fn, *args, **kwargs))

    def _loop(self) -> None:
        while self._running:
            self._wake.clear()
            try:
                self._run_commands()
                if self.dead is not None or not self.engine.has_unfinished_requests():
                    self._wake.wait(timeout=1.0)
                    continue
                outputs = self.engine.step()
            except Exception as exc:  # a failed step, or any other: never a silent death
                self._die(exc)
                continue
            # Listeners first: once a caller has a step's output or sees the engine idle,
            # that step is in the metrics.
            for listener in self.step_listeners if self.engine.last_step else ():
                try:
                    listener(self.engine.last_step, outputs)
                except Exception:  # an observer's bug must not stop the engine
                    logger.exception("step listener %r failed", listener)
            self._stats = self.engine.stats()
            deliver_step(self._streams, ((o.request_id, o) for o in outputs))

    def _run_commands(self) -> None:
        while True:
            try:
                fn, args, kwargs, future = self._commands.get_nowait()
            except queue.Empty:
                break
            if not future.set_running_or_notify_cancel():
                continue  # its caller went away (a client disconnect) before it ran
            if self.dead is not None:  # queued before the engine died: nothing will run
                future.set_exception(self._dead_error())
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except Exception as exc:
                future.set_exception(exc)
        self._stats = self.engine.stats()

    def _die(self, exc: Exception) -> None:
        if self.dead is not None:
            logger.exception("engine loop error after its death", exc_info=exc)
            return
        logger.critical("engine step failed; the engine is dead", exc_info=exc)
        self.dead = exc
        for listener in self.dead_listeners:  # told before any stream sees the error
            listener(exc)
        for stream in list(self._streams.values()):
            stream.put(self._dead_error())


def deliver_step(streams: dict[str, RequestStream], outputs) -> None:
    """(request id, output) pairs to their streams: one call into each event loop for all
    of them (a `call_soon_threadsafe` per output costs ~4 us of the calling thread, a lock
    and a write to the loop's self-pipe each: ~1 ms a step at 256 streams)."""
    by_loop: dict[asyncio.AbstractEventLoop, list] = {}
    for request_id, output in outputs:
        stream = streams.get(request_id)
        if stream is not None:
            items = by_loop.get(stream.loop)
            if items is None:
                items = by_loop[stream.loop] = []
            items.append((stream.queue, output))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # its event loop has closed: nobody is left to read them
            pass


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    """On the streams' event loop: each output onto its stream, in step order."""
    for stream, item in items:
        stream.put_nowait(item)
