"""The `qwen-jax serve` process around the HTTP server (api_server.py): build the engine,
print the start-up report, serve until SIGTERM/SIGINT, then drain (stop accepting,
let in-flight requests finish within the timeout, abort the rest, exit 0). When a failed
step kills the engine, the handlers in flight send their 500s and the process exits 1, for
its supervisor to restart it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import time

from aiohttp import web

from serving.engine.async_llm import AsyncLLM
from serving.engine.data_parallel import DPAsyncLLM
from serving.engine.process import MPAsyncLLM
from serving.entrypoints.openai import http_policy
from serving.entrypoints.openai.api_server import STATE, build_app
from serving.entrypoints.openai.config import ServerConfig
from serving.entrypoints.openai.lora_routes import LoRAStartupError, runtime_updating_allowed

logger = logging.getLogger("qwen_jax.server")


def startup_report(llm, seconds: float) -> str:
    engine = llm.engine
    stats = llm.stats()
    pairs = engine.bucket_pairs
    compiled = (f"compiled {len(pairs)} (tokens, seqs) buckets in {engine.compile_seconds:.1f} s"
                if engine.config.precompile else f"{len(pairs)} buckets compile on first use "
                                                 "(--no-precompile)")
    replicas = getattr(llm, "replicas", ())
    across = f" across {len(replicas)} data-parallel replicas" if replicas else ""
    return (f"model {engine.model_path} loaded in {engine.load_seconds:.1f} s; {compiled}; "
            f"KV cache: {stats['kv_capacity_tokens']:,} tokens in {stats['num_total_pages']:,} "
            f"pages of {engine.page_size}{across}; max_model_len {engine.max_model_len}; "
            f"ready in {seconds:.1f} s")


async def serve(llm, config: ServerConfig) -> int:
    app = build_app(llm, config)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=5.0)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    stop, dead = asyncio.Event(), asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    llm.dead_listeners.append(lambda exc: loop.call_soon_threadsafe(dead.set))
    if llm.dead is not None:
        dead.set()
    logger.info("serving %s on http://%s:%d", app[STATE].model_name, config.host, config.port)
    print(f"serving on http://{config.host}:{config.port}", flush=True)
    waits = [asyncio.create_task(stop.wait()), asyncio.create_task(dead.wait())]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    for task in waits:
        task.cancel()
    if dead.is_set():
        await exit_dead(app, runner, site, llm, config.shutdown_timeout)
        return 1
    await drain(app, runner, site, llm, config.shutdown_timeout)
    return 0 if llm.dead is None else 1  # it may have died while draining


async def exit_dead(app, runner, site, llm, timeout: float) -> None:
    """The engine died: let the handlers in flight send their 500s (new requests get one
    too), then stop; the caller exits non-zero."""
    logger.critical("engine is dead (%r): answering the requests in flight with 500, then "
                    "exiting with status 1", llm.dead)
    server = app[STATE]
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while server.num_active and loop.time() < deadline:
        await asyncio.sleep(0.05)
    await site.stop()
    await runner.cleanup()


async def drain(app, runner, site, llm, timeout: float) -> None:
    logger.info("shutting down: no new requests; waiting up to %.0f s for in-flight ones", timeout)
    app[STATE].draining = True
    await site.stop()
    if not await llm.wait_until_idle(timeout):
        logger.warning("shutdown timeout: aborting %d unfinished requests",
                       llm.num_streams)
        await llm.abort_all()
    await runner.cleanup()
    logger.info("shut down cleanly")


def start_engine(args, engine_kwargs: dict):
    """The engine behind the server: in a process of its own (`--engine-process`, the
    default), one per replica with --data-parallel-size (serving/engine/data_parallel.py),
    or on a thread of this one (multi-host leaders: the engine must step in the process
    that joined jax.distributed)."""
    dp = engine_kwargs.get("data_parallel_size", 1)
    llm: DPAsyncLLM | MPAsyncLLM
    if dp > 1:
        if args.coordinator_address is not None or not args.engine_process:
            raise ValueError(f"data_parallel_size={dp} runs an engine process per replica "
                             "on one host: it needs --engine-process and no "
                             "--coordinator-address (put hosts behind a load balancer: "
                             "docs/deploy.md)")
        llm = DPAsyncLLM(args.model, data_parallel_routing=args.data_parallel_routing,
                         max_restarts=args.max_replica_restarts,
                         restart_backoff_s=args.replica_restart_backoff, **engine_kwargs)
    elif not args.engine_process or args.coordinator_address is not None:
        return AsyncLLM(args.model, **engine_kwargs)
    else:
        llm = MPAsyncLLM(args.model, **engine_kwargs)
    import jax  # nothing here may take a GPU's memory: the engine process has it
    jax.config.update("jax_platforms", "cpu")
    return llm


def run(args, engine_kwargs: dict) -> int:
    """`qwen-jax serve`: build the engine, report, serve until a signal, drain."""
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = ServerConfig(host=args.host, port=args.port,
                          api_key=args.api_key or os.environ.get("QWEN_JAX_API_KEY") or None,
                          served_model_name=args.served_model_name,
                          max_request_body_mb=args.max_request_body_mb,
                          shutdown_timeout=args.shutdown_timeout, log_interval=args.log_interval,
                          reasoning_parser=args.reasoning_parser,
                          tool_call_parser=args.tool_call_parser,
                          enable_auto_tool_choice=args.enable_auto_tool_choice,
                          chat_template=args.chat_template,
                          default_chat_template_kwargs=args.default_chat_template_kwargs,
                          allowed_origins=http_policy.parse_origins(args.allowed_origins),
                          metrics_prefix=args.metrics_prefix,
                          enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint,
                          lora_modules=args.lora_modules,
                          allow_runtime_lora_updating=runtime_updating_allowed(
                              args.allow_runtime_lora_updating))
    started = time.perf_counter()
    try:
        llm = start_engine(args, engine_kwargs)
    except ValueError as exc:  # an option the model or the devices refuse, named
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    print(startup_report(llm, time.perf_counter() - started), flush=True)
    try:
        return asyncio.run(serve(llm, config))
    except LoRAStartupError as exc:  # raised before the server accepts a request
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        llm.shutdown()
