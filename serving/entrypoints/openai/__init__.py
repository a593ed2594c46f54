"""The OpenAI-compatible HTTP server (aiohttp): routes (`api_server`), the `qwen-jax serve`
process around it (`serve_process`), request parsing (`protocol`, `structured_requests`),
response bodies (`outputs`), CORS and API keys (`http_policy`), errors, and the
server's config.

Same imports as `serving.entrypoints`.
"""
