"""The FastAPI app: generation routers plus models, health, metrics, tokenize and detokenize."""

from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from baton.disagg.address_token import vouch
from baton.server.errors import APIError, error_response, install_error_handlers
from baton.server.middleware import (
    ApiKeyMiddleware,
    RequestBodyMiddleware,
    RequestCounterMiddleware,
)
from baton.server.openai import adapters, chat, completions, sglang_generate
from baton.server.openai.generation import ServerState, check_model
from baton.server.openai.protocol import DetokenizeRequest, TokenizeRequest
from baton.server.openai.responses import endpoint as responses
from baton.server.openai.sampling import check_token_ids
from baton.server.openai.validation import check_continue_final_message
from baton.server.tokenizer_bundle import TokenizerBundle, model_identity
from baton.server.version import baton_version

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/generate")


def build_app(state: ServerState) -> FastAPI:
    app = FastAPI(
        title="baton", description="OpenAI-compatible server for hybrid Mamba2 + attention models"
    )
    app.state.baton = state
    started = int(time.time())
    install_error_handlers(app)
    app.include_router(completions.router)
    app.include_router(chat.router)
    app.include_router(responses.router)
    app.include_router(sglang_generate.router)
    # Outermost last: count every answer, check the key before reading a body, read the body
    # (413 / strict JSON) before any handler parses it.
    app.add_middleware(RequestBodyMiddleware, max_bytes=state.args.max_request_bytes)
    if state.args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=state.args.api_key)
    app.add_middleware(
        RequestCounterMiddleware, counter=state.metrics.requests, paths=GENERATION_PATHS
    )

    @app.get("/health")
    @app.api_route("/ping", methods=["GET", "POST"])  # vLLM's (SageMaker's) liveness route
    async def health() -> Response:
        if not state.client.alive:
            return error_response(503, f"engine unavailable: {state.client.unavailable_reason}")
        return JSONResponse({"status": "ok"})

    served: list[tuple[TokenizerBundle, dict]] = []  # read once, on the router's first ask

    async def served_model() -> tuple[TokenizerBundle, dict]:
        """The tokenizer files this worker serves with, and the model identity they are part of
        (server/tokenizer_bundle.py), read from disk off the event loop."""
        if not served:
            args = state.args

            def read() -> tuple[TokenizerBundle, dict]:
                bundle = TokenizerBundle.from_directory(
                    args.tokenizer_dir, args.chat_template_text()
                )
                return bundle, model_identity(args.model_name, args.model, bundle)

            served.append(await asyncio.to_thread(read))
        return served[0]

    @app.get("/disagg/info")
    async def disagg_info() -> Response:
        """What `baton router` learns of a worker: its role, where decode engines register with a
        prefill worker (and that address's token, disagg/address_token.py), the prefix cache's page size and Mamba checkpoint interval, how the
        pair moves the state (transfer backend: zmq or nixl), and the model it serves (the
        router serves one model: it compares these)."""
        mode = state.args.disaggregation_mode
        if mode is None:
            return error_response(404, "this worker is not part of a disaggregated pair")
        assert state.client.ready is not None
        ready = state.client.ready
        return JSONResponse(
            {
                "role": mode,
                "transfer_addr": ready.transfer_addr or None,
                # The address vouched for under the secret: decode workers dial no other.
                "transfer_addr_token": (
                    vouch(secret, ready.transfer_addr)
                    if (secret := state.args.worker_secret) and ready.transfer_addr
                    else None
                ),
                "rank_transfer_addrs": ready.rank_transfer_addrs,
                "page_size": ready.page_size,
                "track_interval": ready.track_interval,
                "transfer_backend": state.args.disaggregation_transfer_backend,
                "model": (await served_model())[1],
            }
        )

    @app.get("/disagg/tokenizer")
    async def disagg_tokenizer() -> Response:
        """The tokenizer files (and --chat-template) this worker serves with, for a router that
        matches prompts in tokens without a copy of the model directory of its own."""
        if state.args.disaggregation_mode is None:
            return error_response(404, "this worker is not part of a disaggregated pair")
        return JSONResponse((await served_model())[0].to_json())

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def card() -> dict:
        return {
            "id": state.args.model_name,
            "object": "model",
            "created": started,
            "owned_by": "baton",
            "root": state.args.model,
            "max_model_len": state.max_model_len,
        }

    def adapter_card(name: str) -> dict:
        """vLLM's card of a LoRA adapter: its base model as `parent`."""
        path = state.client.adapters[name]
        return card() | {"id": name, "root": path, "parent": state.args.model_name}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [card(), *map(adapter_card, state.client.adapters)]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> dict:
        """OpenAI's retrieve (`client.models.retrieve`); ids may hold slashes (org/name)."""
        check_model(state, model)
        return adapter_card(model) if model in state.client.adapters else card()

    app.include_router(adapters.router)

    @app.get("/version")
    async def version() -> dict:
        return {"version": baton_version()}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        check_model(state, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError.bad_request("give exactly one of prompt and messages", "prompt")
        # Off the event loop: a long text would hold /health and every other client up.
        if body.messages is not None:
            check_continue_final_message(body)
            tokens = await asyncio.to_thread(
                state.tokenizer.encode_chat,
                body.messages,
                body.add_generation_prompt,
                body.chat_template_kwargs,
                body.continue_final_message,
                False,
                [
                    {"type": "function", "function": tool.function.for_template()}
                    for tool in body.tools
                ]
                if body.tools
                else None,
                limit=state.max_model_len,
            )
        else:
            tokens = await asyncio.to_thread(
                state.tokenizer.encode,
                body.prompt,
                body.add_special_tokens,
                state.max_model_len,
            )
        if len(tokens) > state.max_model_len:  # vLLM's rule for /tokenize too
            raise APIError.bad_request(
                f"the prompt has {len(tokens)} tokens, more than max-model-len"
                f" ({state.max_model_len})",
                "prompt" if body.prompt is not None else "messages",
            )
        return {
            "tokens": tokens,
            "count": len(tokens),
            "max_model_len": state.max_model_len,
            # vLLM's: each token as the tokenizer's vocabulary spells it
            "token_strs": state.tokenizer.hf.convert_ids_to_tokens(tokens)
            if body.return_token_strs
            else None,
        }

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        check_model(state, body.model)
        check_token_ids(body.tokens, state.vocab_size, "tokens")
        return {"prompt": await asyncio.to_thread(state.tokenizer.decode, body.tokens)}

    return app
