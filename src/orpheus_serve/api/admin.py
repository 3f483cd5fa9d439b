"""Admin endpoints: the custom-voice adapters (LoRA, engines/lora.py) while serving.

    GET  /v1/admin/adapters                 every adapter of voices.adapters_dir and its state
    POST /v1/admin/adapters/{name}/load     read and check it now (400 with the reason if it is refused);
                                            it enters the device pool before the engine's next step
    POST /v1/admin/adapters/{name}/unload   free its pool entry; while sessions use it, once they end

They need an API key: with no `server.api_keys` they answer 403, with keys the usual bearer check
applies (401). Both process modes answer them (the engine core in its own process gets a wire call).
A request for a custom voice loads its adapter anyway: these calls warm the pool up or free it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import FastAPI, HTTPException, Path
from pydantic import BaseModel, Field

from ..engines.lora import AdapterError
from ..request.errors import InvalidRequestError

if TYPE_CHECKING:
    from .gateway import Gateway


class AdapterStatusBody(BaseModel):
    name: str
    state: Literal["available", "loaded", "resident", "unloading"] = Field(
        description="available: on disk only; loaded: read and checked, enters the pool at the next step; "
                    "resident: in the device pool; unloading: leaves the pool when its sessions end.")
    sessions: int = Field(description="Running sessions that use it.")
    rank: int | None = None
    target_modules: list[str] = []
    error: str | None = Field(None, description="Why the last load refused it.")


# An adapter's folder name (engines/lora.valid_adapter_name).
AdapterName = Annotated[str, Path(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$",
                                  description="The adapter's folder name in voices.adapters_dir.")]


class AdapterList(BaseModel):
    adapters: list[AdapterStatusBody]


_RESPONSES: dict[int | str, dict[str, Any]] = {
    400: {"description": "The adapter was refused (the reason in the error message), there is no such adapter, "
                         "or this engine has no adapter pool (custom voices off, or the TensorRT-LLM backend)."},
    401: {"description": "Missing or wrong API key."},
    403: {"description": "The server has no `server.api_keys`: the admin endpoints are off."},
    503: {"description": "The engine core is not answering, has too many adapter reads queued, or did not read the "
                          "adapter within voices.read_timeout_s."},
}


def add_admin_routes(app: FastAPI, gateway: Gateway) -> None:
    async def call(op: str, name: str | None = None) -> list[dict[str, Any]]:
        if not gateway.config.server.api_keys:
            raise HTTPException(403, "the admin endpoints need an API key: set server.api_keys")
        try:
            return await gateway.service.adapters(op, name)
        except AdapterError as exc:
            raise InvalidRequestError(str(exc), param="name") from None

    @app.get("/v1/admin/adapters", response_model=AdapterList, responses=_RESPONSES, tags=["admin"])
    async def list_adapters() -> dict[str, Any]:
        return {"adapters": await call("list")}

    @app.post("/v1/admin/adapters/{name}/load", response_model=AdapterStatusBody, responses=_RESPONSES,
              tags=["admin"])
    async def load_adapter(name: AdapterName) -> dict[str, Any]:
        return (await call("load", name))[0]

    @app.post("/v1/admin/adapters/{name}/unload", response_model=AdapterStatusBody, responses=_RESPONSES,
              tags=["admin"])
    async def unload_adapter(name: AdapterName) -> dict[str, Any]:
        return (await call("unload", name))[0]
