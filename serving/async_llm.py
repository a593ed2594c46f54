"""AsyncLLM: the engine loop in a background thread, asyncio streams for callers.

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

from serving.engine import LLMEngine
from serving.llm import engine_config_from_kwargs
from serving.request import RequestOutput, SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped after a failed step; nothing more will run."""


class RequestFailedError(RuntimeError):
    """The engine failed this one request; it goes on serving the others."""


class AsyncLLM:
    def __init__(self, model: str | None = None, *, engine: LLMEngine | None = None, **kwargs):
        if engine is None:
            config = engine_config_from_kwargs(model, **kwargs)
            if config.parallel.data_parallel_size > 1:
                raise ValueError(
                    f"data_parallel_size={config.parallel.data_parallel_size}: a server runs "
                    "one replica; start one per replica and put a load balancer in front")
            engine = LLMEngine(config)
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._running = True
        self.dead: BaseException | None = None
        # Called on the engine thread after every step with (step stats, outputs).
        self.step_listeners: list[Callable[[dict, list[RequestOutput]], None]] = []
        # Called once, on the engine thread, with the exception that killed the engine.
        self.dead_listeners: list[Callable[[BaseException], None]] = []
        self._stats = self.engine.stats()
        self._thread = threading.Thread(target=self._loop, name="qwen-jax-engine", daemon=True)
        self._thread.start()

    # ---- public API ---------------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def stats(self) -> dict:
        """The engine's stats as of its last step (a snapshot; never blocks)."""
        return dict(self._stats)

    @property
    def num_streams(self) -> int:
        """Requests with a reader (their `generate` not left)."""
        return len(self._streams)

    async def generate(self, prompt, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, priority: int = 0
                       ) -> AsyncIterator[RequestOutput]:
        """Stream the request's RequestOutputs until it finishes, each as its
        `output_kind` says (cumulative by default; the server asks for DELTA). Leaving the
        loop early (or cancelling the task) aborts the request and frees its pages."""
        request_id = request_id or uuid.uuid4().hex
        # The stream is registered before the engine sees the request (its first output
        # must find it), so a second one must not replace it: the engine's check is too late.
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        finished = False
        try:
            await self._call(self.engine.add_request, request_id, prompt, sampling_params,
                             priority=priority)
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                if item.error is not None:
                    finished = True
                    raise RequestFailedError(f"request {request_id} failed: {item.error}")
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self._submit(self.engine.abort, request_id)

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with a final output (finish_reason "abort")."""
        final = await self._call(self.engine.abort, request_id)
        if final is not None:
            self._deliver(request_id, final)

    async def wait_until_idle(self, timeout: float) -> bool:
        """True when no request is left within `timeout` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while loop.time() < deadline:
            try:
                if not await self._call(self.engine.has_unfinished_requests):
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

    def shutdown(self) -> None:
        self._running = False
        self._wake.set()
        self._thread.join(timeout=10)

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
            self._deliver_step(outputs)

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

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs to their streams: one call into each event loop for all of them
        (a `call_soon_threadsafe` per output costs ~4 us of this thread, a lock and a
        write to the loop's self-pipe each: ~1 ms a step at 256 streams)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        streams = self._streams
        for output in outputs:
            target = streams.get(output.request_id)
            if target is not None:
                loop, stream = target
                items = by_loop.get(loop)
                if items is None:
                    items = by_loop[loop] = []
                items.append((stream, output))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # its event loop has closed: nobody is left to read them
                pass

    def _deliver(self, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            try:
                loop.call_soon_threadsafe(stream.put_nowait, item)
            except RuntimeError:  # its event loop has closed: nobody is left to read it
                pass

    def _dead_error(self) -> EngineDeadError:
        return EngineDeadError(f"engine is dead after a failed step ({self.dead!r}); the "
                               "server must be restarted")

    def _die(self, exc: Exception) -> None:
        if self.dead is not None:
            logger.exception("engine loop error after its death", exc_info=exc)
            return
        logger.critical("engine step failed; the engine is dead", exc_info=exc)
        self.dead = exc
        for listener in self.dead_listeners:  # told before any stream sees the error
            listener(exc)
        for request_id in list(self._streams):
            self._deliver(request_id, self._dead_error())


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    """On the streams' event loop: each output onto its stream, in step order."""
    for stream, item in items:
        stream.put_nowait(item)
