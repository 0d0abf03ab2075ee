"""vLLM's run-time LoRA routes: `POST /v1/load_lora_adapter` {"lora_name", "lora_path"} and
`POST /v1/unload_lora_adapter` {"lora_name"} (behind --api-key like every /v1 route). A refused
adapter is a 400 naming what is wrong (the engine's reason); an unknown name to unload, 404."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from baton.server.engine_client import EngineRejected, EngineUnavailable
from baton.server.errors import APIError
from baton.server.openai.protocol import OpenAIModel

router = APIRouter()


class LoadLoRAAdapterRequest(OpenAIModel):
    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(OpenAIModel):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's; baton keys adapters by name


def _state(raw: Request):
    state = raw.app.state.baton
    if not state.args.enable_lora:
        raise APIError.bad_request("LoRA adapters need --enable-lora", "lora_name")
    return state


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, raw: Request) -> PlainTextResponse:
    state = _state(raw)
    name = body.lora_name
    if not name or not body.lora_path:
        raise APIError.bad_request("lora_name and lora_path must not be empty", "lora_name")
    if name in state.client.adapters or name in (state.args.model_name, state.args.model):
        raise APIError.bad_request(f"the name {name!r} is already taken", "lora_name")
    await _call(state, "load", name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, raw: Request) -> PlainTextResponse:
    state = _state(raw)
    if body.lora_name not in state.client.adapters:
        raise APIError(
            404, f"The lora adapter '{body.lora_name}' cannot be found.", "lora_name", "not_found"
        )
    await _call(state, "unload", body.lora_name, "")
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


async def _call(state, action: str, name: str, path: str) -> None:
    try:
        await state.client.adapter(action, name, path)
    except EngineRejected as refused:
        raise APIError.bad_request(str(refused), "lora_path" if path else "lora_name") from None
    except (EngineUnavailable, TimeoutError) as error:
        raise APIError(503, f"engine unavailable: {error}") from None
