"""The engine in its own process (vLLM's engine-core process): `MPAsyncLLM` is `AsyncLLM`'s
interface over an engine that steps in a child process, so the server's event loop (its
handlers, SSE chunks, metrics) and the engine's step loop each have an interpreter, and
a GIL, of their own.

In one process the engine thread and the event loop take turns on one GIL: at 256
streams the server's per-output Python (~10 us a chunk) delays every step, and a short
device step waits for it (docs/benchmarks.md, "The server's way at 256 streams").

The wire: one duplex pipe of pickled messages. The API process sends calls (add a
request, abort, queries) and the engine answers each in order, then sends one message
per step holding the step's stats, the engine's stats and its outputs. An output travels
as a tuple of what changes per step (`wire_output`, which the engine's output processor
builds in place of the RequestOutput): the client keeps each request's prompt, prompt
ids and `RequestMetrics` and rebuilds the `RequestOutput` around them, as pickling whole
outputs would copy every prompt each step (~4 ms a step at 256 streams, against ~0.2 ms
for the tuples).

A step that raises, or an engine process that exits, makes the client dead as
`AsyncLLM` does: every stream and later call gets `EngineDeadError` and `dead_listeners`
are told. The child ignores SIGINT and SIGTERM (the server drains and then stops it) and
exits when the pipe closes, so it never outlives the API process.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import itertools
import logging
import multiprocessing.connection
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path

from serving.core.request import RequestOutput
from serving.engine.async_llm import EngineClient, RequestStream, deliver_step
from serving.engine.config import one_replica_config
from serving.engine.exceptions import EngineDeadError
from serving.engine.wire import (
    EngineInfo,
    completion_fields,
    decode_output,
    engine_info,
    wire_output,
)

logger = logging.getLogger(__name__)

# Calls the API process may make; anything else is refused by the engine process.
CALLS = ("add_request", "abort", "has_unfinished_requests", "add_lora", "remove_lora",
         "list_loras")
STARTUP_TIMEOUT_S = 3600.0  # a large checkpoint loads and compiles within this


class MPAsyncLLM(EngineClient):
    """`AsyncLLM` with the engine in a child process (same public interface: generate,
    abort, stats, tokenizer, engine, step and dead listeners, shutdown). `engine` is an
    `EngineInfo`: the engine's settings, not the engine."""

    def __init__(self, model: str | None = None, *, engine_hook: tuple | None = None,
                 env: dict[str, str] | None = None, **kwargs):
        """`kwargs`: AsyncLLM's engine arguments. `engine_hook`: (module, function, args),
        called as function(engine, *args) in the engine process once the engine is built
        (the benchmarks put a fake device in with it). `env`: variables set in the engine
        process (a data-parallel replica's CUDA_VISIBLE_DEVICES)."""
        config = one_replica_config(model, **kwargs)  # bad arguments fail here
        # A fresh interpreter (no forked jax state, no re-import of the caller's __main__),
        # one end of a socket pair as its pipe, the config as its first message.
        self._send_lock = threading.Lock()
        parent, child = socket.socketpair()
        env = {**os.environ, **(env or {})}
        root = str(Path(__file__).resolve().parent.parent)  # serving/ importable there too
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (root, env.get("PYTHONPATH"))))
        self._process = subprocess.Popen(
            [sys.executable, "-m", "serving.engine.process", str(child.fileno())],
            pass_fds=(child.fileno(),), env=env)
        child.close()
        self._conn = multiprocessing.connection.Connection(parent.detach())
        self._send(("start", config, logging.getLogger().level, engine_hook))
        self._streams: dict[str, RequestStream] = {}
        self._calls: dict[int, tuple[str, concurrent.futures.Future]] = {}
        self._call_ids = itertools.count()
        self.dead: BaseException | None = None
        self.step_listeners: list[Callable[[dict, list[RequestOutput]], None]] = []
        self.dead_listeners: list[Callable[[BaseException], None]] = []
        self._stats: dict = {}
        self.engine: EngineInfo = self._wait_ready()
        self.engine.tokenizer  # noqa: B018 -- loaded now, not at a first request
        self._reader = threading.Thread(target=self._read, name="qwen-jax-engine-reader",
                                        daemon=True)
        self._reader.start()

    def _wait_ready(self) -> EngineInfo:
        waited = 0.0
        while not self._conn.poll(1.0):
            waited += 1.0
            if self._process.poll() is not None or waited > STARTUP_TIMEOUT_S:
                self._process.kill()
                raise RuntimeError(f"the engine process exited while starting (exit code "
                                   f"{self._process.returncode}); its log says why")
        try:
            kind, payload, stats = pickle.loads(self._conn.recv_bytes())
        except EOFError:
            raise RuntimeError(f"the engine process exited while starting (exit code "
                               f"{self._process.wait(10)}); its log says why") from None
        if kind == "failed":
            self._process.wait(10)
            raise payload
        self._stats = stats
        return payload

    @property
    def pid(self) -> int:
        """The engine process's id."""
        return self._process.pid

    def shutdown(self) -> None:
        if self._process.poll() is None:
            try:
                self._send(("shutdown",))
                self._process.wait(10)
            except (OSError, subprocess.TimeoutExpired):
                self._process.kill()
                self._process.wait(10)
        self._reader.join(timeout=10)
        self._conn.close()

    # ---- the pipe ------------------------------------------------------------------------
    def _send(self, message: tuple) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._send_lock:
            self._conn.send_bytes(data)

    def _request(self, name: str, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self.dead is not None:
            future.set_exception(self._dead_error())
            return future
        call_id = next(self._call_ids)
        self._calls[call_id] = name, future
        try:
            self._send(("call", call_id, name, args, kwargs))
        except (OSError, ValueError) as exc:  # the pipe is closed: the engine is gone
            self._calls.pop(call_id, None)
            future.set_exception(EngineDeadError(f"engine process unreachable: {exc!r}"))
        return future

    def _final_output(self, stream: RequestStream, value) -> RequestOutput:
        return decode_output(stream, value)

    def _read(self) -> None:
        """The reader thread: the engine's answers and steps, in the order it sent them."""
        while True:
            try:
                message = pickle.loads(self._conn.recv_bytes())
            except (EOFError, OSError):
                try:
                    code = self._process.wait(5)
                except subprocess.TimeoutExpired:
                    code = None
                self._die(RuntimeError(f"the engine process exited (exit code {code})"))
                return
            kind = message[0]
            try:
                if kind == "step":
                    self._on_step(*message[1:])
                elif kind == "reply":
                    self._on_reply(*message[1:])
                elif kind == "dead":
                    self._die(message[1])
                elif kind == "stopped":
                    self._die(RuntimeError("the engine process was shut down"), quiet=True)
                    return
            except Exception as exc:  # a bug here: never a silent hang of every stream
                logger.exception("engine process message %r failed", kind)
                self._die(exc)
                return

    def _on_reply(self, call_id: int, ok: bool, value, stats: dict) -> None:
        self._stats = stats
        name, future = self._calls.pop(call_id, (None, None))
        if future is None or not future.set_running_or_notify_cancel():
            return
        if not ok:
            future.set_exception(value)
            return
        if name == "add_request":  # its prompt, before its first output is decoded
            request_id, prompt, prompt_ids = value
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.prompt, stream.prompt_token_ids = prompt, prompt_ids
            value = None
        future.set_result(value)

    def _on_step(self, step_info: dict | None, stats: dict, encoded: list) -> None:
        streams = self._streams
        outputs: list[RequestOutput] = []
        for item in encoded:
            stream = streams.get(item[0])
            if stream is not None:  # else its reader has gone (an abort is on its way)
                outputs.append(decode_output(stream, item))
        if step_info is not None:  # None: the call read no step's tokens
            for listener in self.step_listeners:
                try:
                    listener(step_info, outputs)
                except Exception:  # an observer's bug must not stop the outputs
                    logger.exception("step listener %r failed", listener)
        self._stats = stats
        deliver_step(streams, ((o.request_id, o) for o in outputs))

    def _die(self, exc: BaseException, quiet: bool = False) -> None:
        if self.dead is not None:
            return
        if not quiet:
            logger.critical("the engine process failed; the engine is dead: %r", exc)
        self.dead = exc
        for listener in () if quiet else self.dead_listeners:  # told before any caller
            listener(exc)
        error = self._dead_error()
        for _, future in list(self._calls.values()):
            if future.set_running_or_notify_cancel():
                future.set_exception(error)
        self._calls.clear()
        for stream in list(self._streams.values()):
            stream.put(error)


# ---- the engine process --------------------------------------------------------------------
def _engine_main(fd: int) -> None:
    """The child: build the engine, answer calls, step while there is work."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API process decides when to stop
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn = multiprocessing.connection.Connection(fd)
    try:
        _, config, log_level, hook = pickle.loads(conn.recv_bytes())
    except EOFError:
        return
    logging.basicConfig(level=log_level,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from serving.engine.llm_engine import LLMEngine

    def send(message) -> None:
        conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))

    try:
        engine = LLMEngine(config)
        # outputs built as what crosses the pipe, not as objects taken apart to send
        engine.output_processor.make_output = wire_output
        engine.output_processor.make_completion = completion_fields
        if hook is not None:
            module, function, args = hook
            getattr(importlib.import_module(module), function)(engine, *args)
        send(("ready", engine_info(engine), engine.stats()))
    except BaseException as exc:  # the API process raises it
        send(("failed", _picklable(exc), None))
        return
    _EngineLoop(engine, conn, send).run()


class _EngineLoop:
    def __init__(self, engine, conn, send):
        self.engine, self.conn, self.send = engine, conn, send
        self.dead: BaseException | None = None

    def run(self) -> None:
        engine, conn = self.engine, self.conn
        while True:
            busy = self.dead is None and engine.has_unfinished_requests()
            try:
                ready = conn.poll(0 if busy else 1.0)
                while ready:
                    message = pickle.loads(conn.recv_bytes())
                    if message[0] == "shutdown":
                        self.send(("stopped",))
                        return
                    self._call(*message[1:])
                    ready = conn.poll(0)
            except (EOFError, OSError):  # the API process is gone
                return
            if self.dead is not None or not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
                self.send(("step", engine.last_step or None, engine.stats(), outputs))
            except (EOFError, OSError):
                return
            except Exception as exc:  # the step failed: the engine's state is untrusted
                logger.critical("engine step failed; the engine is dead", exc_info=exc)
                self.dead = exc
                self.send(("dead", _picklable(exc)))

    def _call(self, call_id: int, name: str, args: tuple, kwargs: dict) -> None:
        engine = self.engine
        try:
            if self.dead is not None:
                raise EngineDeadError(f"engine is dead after a failed step ({self.dead!r})")
            if name not in CALLS:
                raise ValueError(f"unknown engine call {name!r}")
            value = getattr(engine, name)(*args, **kwargs)
            if name == "add_request":
                value = (args[0], *engine.request_prompt(args[0]))
            reply = (True, value)
        except Exception as exc:
            reply = (False, _picklable(exc))
        self.send(("reply", call_id, *reply, engine.stats()))


def _picklable(exc: BaseException) -> BaseException:
    """`exc` if it pickles (its type and message reach the API process), else a
    RuntimeError with its text and traceback."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        text = "".join(traceback.format_exception(exc))
        return RuntimeError(f"{type(exc).__name__}: {exc}\n{text}")


if __name__ == "__main__":  # the module itself, not __main__: its classes pickle by name
    from serving.engine.process import _engine_main as engine_main
    engine_main(int(sys.argv[1]))
