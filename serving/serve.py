"""`qwen-jax serve`: build the engine, print a start-up report, serve until SIGTERM/SIGINT,
then drain: stop accepting, let in-flight requests finish within the timeout, abort the
rest, exit 0."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time

from aiohttp import web

from serving.server import STATE, ServerConfig, build_app

logger = logging.getLogger("qwen_jax.server")


def startup_report(llm, seconds: float) -> str:
    engine = llm.engine
    stats = llm.stats()
    pairs = engine.bucket_pairs
    compiled = (f"compiled {len(pairs)} (tokens, seqs) buckets in {engine.compile_seconds:.1f} s"
                if engine.config.precompile else f"{len(pairs)} buckets compile on first use "
                                                 "(--no-precompile)")
    return (f"model {engine.model_path} loaded in {engine.load_seconds:.1f} s; {compiled}; "
            f"KV cache: {stats['kv_capacity_tokens']:,} tokens in {stats['num_total_pages']:,} "
            f"pages of {engine.block_size}; max_model_len {engine.max_model_len}; "
            f"ready in {seconds:.1f} s")


async def serve(llm, config: ServerConfig) -> int:
    app = build_app(llm, config)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           shutdown_timeout=5.0)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    logger.info("serving %s on http://%s:%d", app[STATE].model_name, config.host, config.port)
    print(f"serving on http://{config.host}:{config.port}", flush=True)
    await stop.wait()
    await drain(app, runner, site, llm, config.shutdown_timeout)
    return 0


async def drain(app, runner, site, llm, timeout: float) -> None:
    logger.info("shutting down: no new requests; waiting up to %.0f s for in-flight ones", timeout)
    app[STATE].draining = True
    await site.stop()
    if not await llm.wait_until_idle(timeout):
        logger.warning("shutdown timeout: aborting %d unfinished requests",
                       len(llm.engine.request_ids()))
        await llm.abort_all()
    await runner.cleanup()
    logger.info("shut down cleanly")


def run(args, engine_kwargs: dict) -> int:
    from serving.async_llm import AsyncLLM
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
                          default_chat_template_kwargs=args.default_chat_template_kwargs)
    started = time.perf_counter()
    llm = AsyncLLM(args.model, **engine_kwargs)
    print(startup_report(llm, time.perf_counter() - started), flush=True)
    try:
        return asyncio.run(serve(llm, config))
    finally:
        llm.shutdown()
