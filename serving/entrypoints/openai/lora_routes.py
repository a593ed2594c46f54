"""The model names a server answers to (vLLM's OpenAIServingModels): the served model, and
its LoRA adapters by name. A request's `"model"` picks one (the served name: no adapter;
an adapter's name: its LoRARequest; anything else: 404 "The model `x` does not exist.");
GET /v1/models lists them; POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's
bodies and replies) exist only when runtime updating is allowed (`--allow-runtime-lora-
updating` or VLLM_ALLOW_RUNTIME_LORA_UPDATING=True). Adapters given at start
(`--lora-modules`) are registered before the server accepts a request."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from aiohttp import web

from serving.core.lora_request import LoRARequest
from serving.entrypoints.openai import protocol as proto
from serving.entrypoints.openai.errors import APIError

logger = logging.getLogger("qwen_jax.server")
RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updating_allowed(flag: bool, environ: Mapping[str, str] = os.environ) -> bool:
    """The flag, or vLLM's environment variable set to 1 / true (any case)."""
    return flag or environ.get(RUNTIME_UPDATING_ENV, "0").strip().lower() in ("1", "true")


class LoRAStartupError(ValueError):
    """An adapter of `--lora-modules` that could not be registered: the server stops."""


class LoRAModels:
    """The adapters the server routes to by name, over `server` (an OpenAIServer: its llm,
    model name and config)."""

    def __init__(self, server):
        self.server = server
        self.adapters: dict[str, LoRARequest] = {}
        self._loading: set[str] = set()  # names being loaded (a second load is refused)
        self._next_id = 1

    @property
    def base_name(self) -> str:
        return self.server.model_name

    def resolve(self, model: str | None) -> LoRARequest | None:
        """A request's `model` -> its adapter (None: the base model), or the 404."""
        if model is None or model == self.base_name:
            return None
        lora = self.adapters.get(model)
        if lora is None:
            raise APIError(404, f"The model `{model}` does not exist.", param="model")
        return lora

    def model_name(self, lora: LoRARequest | None) -> str:
        """What responses name as their model: the adapter's name, or the served one."""
        return self.base_name if lora is None else lora.lora_name

    def routes(self) -> list[web.RouteDef]:
        routes = [web.get("/v1/models", self.models)]
        if self.server.config.allow_runtime_lora_updating:
            routes += [web.post("/v1/load_lora_adapter", self.load),
                       web.post("/v1/unload_lora_adapter", self.unload)]
        return routes

    # ---- start-up ----------------------------------------------------------------------
    async def register_static(self, app: web.Application) -> None:
        """aiohttp on_startup: adapters the engine knows already, then `--lora-modules`;
        a bad one raises LoRAStartupError with its reason."""
        llm = self.server.llm
        for lora in await llm.list_loras() if llm.engine.config.enable_lora else ():
            self._remember(lora)
        for lora in self.server.config.lora_modules:
            try:
                self._check_name(lora.lora_name)
                await llm.add_lora(lora)
            except (ValueError, APIError) as exc:
                raise LoRAStartupError(f"--lora-modules {lora.lora_name}={lora.lora_path}: "
                                       f"{exc}") from None
            self._remember(lora)
            logger.info("LoRA adapter %r from %s", lora.lora_name, lora.lora_path)

    def _remember(self, lora: LoRARequest) -> None:
        self.adapters[lora.lora_name] = lora
        self._next_id = max(self._next_id, lora.lora_int_id + 1)

    def _check_name(self, name: str) -> None:
        if name == self.base_name:
            raise APIError(400, f"lora_name {name!r} is the served model's name; an adapter "
                                "needs a name of its own", param="lora_name")
        if name in self.adapters or name in self._loading:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.",
                           param="lora_name")

    # ---- routes ------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        server = self.server
        base = {"id": self.base_name, "object": "model", "created": server.created,
                "owned_by": "qwen-jax", "root": str(server.llm.engine.model_path),
                "parent": None, "max_model_len": server.max_model_len}
        cards = [{**base, "id": lora.lora_name, "root": lora.lora_path,
                  "parent": lora.base_model_name or self.base_name}
                 for lora in self.adapters.values()]
        return web.json_response({"object": "list", "data": [base, *cards]})

    async def load(self, request: web.Request) -> web.Response:
        """POST /v1/load_lora_adapter {"lora_name", "lora_path"}."""
        body = await self.server._json(request)
        name, path = _required(body, "lora_name"), _required(body, "lora_path")
        self._check_name(name)
        lora = LoRARequest(name, self._next_id, path)
        self._next_id += 1
        self._loading.add(name)
        try:
            await self.server.llm.add_lora(lora)
        except ValueError as exc:
            raise APIError(400, f"LoRA adapter {name!r} from {path!r} cannot be loaded: "
                                f"{exc}", param="lora_path") from None
        finally:
            self._loading.discard(name)
        self._remember(lora)
        logger.info("loaded LoRA adapter %r from %s", name, path)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        """POST /v1/unload_lora_adapter {"lora_name"}: requests using it finish with it."""
        name = _required(await self.server._json(request), "lora_name")
        if name not in self.adapters:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.",
                           param="lora_name")
        await self.server.llm.remove_lora(name)
        del self.adapters[name]
        logger.info("unloaded LoRA adapter %r", name)
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")


def _required(body: dict, field: str) -> str:
    value = proto.read_str(body, field, None)
    if not value:
        raise APIError(400, f"{field} is required (a non-empty string)", param=field)
    return value
