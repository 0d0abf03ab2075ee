"""The offline API: `LLM(model_dir, ...).generate(prompts, params)`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from baton.engine.core.detokenizer import OutputDetokenizer
from baton.engine.core.engine import Engine
from baton.engine.core.engine_args import EngineStats
from baton.engine.core.outputs import RequestOutput
from baton.engine.core.sampling_params import SamplingParams
from baton.engine.lora.request import LoRARequest
from baton.engine.structured_output import check_structured_outputs

Prompt = str | list[int]


class LLM:
    """Runs every prompt of a `generate` call together through the continuous-batching engine.

    `engine_args` use the CLI flag names with underscores (max_num_batched_tokens,
    chunked_prefill_size, max_total_tokens, max_mamba_slots, max_running_requests,
    tensor_parallel_size, ...). With tensor_parallel_size > 1 this process is rank 0 and
    starts the other ranks: `close()` (or a `with` block) stops them, as does this process's
    exit.
    """

    def __init__(
        self, model_dir: str | Path, dtype: str = "float32", device: str = "cpu", **engine_args
    ):
        self.engine = Engine(model_dir, dtype=dtype, device=device, **engine_args)
        self.tokenizer = self.engine.lazy_tokenizer.get()
        self._next_id = 0

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """One output per prompt, in order; with n > 1, n consecutive outputs per prompt.
        lora_request: the adapter of every prompt, or one per prompt (None: the base model);
        an adapter not loaded yet is loaded from its path (LLM(..., enable_lora=True))."""
        prompts = _as_prompt_list(prompts)
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_request = [lora_request] * len(prompts)
        if len(lora_request) != len(prompts):
            raise ValueError(f"got {len(lora_request)} LoRARequests for {len(prompts)} prompts")
        for lora in {r for r in lora_request if r is not None}:
            if lora.lora_name not in self.engine.list_loras():
                self.engine.add_lora(lora.lora_name, lora.lora_path)
        params = [
            p if r is None else dataclasses.replace(p, lora_name=r.lora_name)
            for p, r in zip(params, lora_request)
        ]
        # a bad schema, regex or grammar is refused before anything runs (each one once); the
        # engine compiles the checked spec (a JSON schema lowered to what it enforces)
        checked = {
            s: check_structured_outputs(s) for s in {p.structured_outputs for p in params} - {None}
        }
        params = [
            p
            if p.structured_outputs is None
            else dataclasses.replace(p, structured_outputs=checked[p.structured_outputs])
            for p in params
        ]
        order: list[str] = []
        detokenizer = OutputDetokenizer(self.tokenizer) if self.tokenizer is not None else None
        outputs: dict[str, RequestOutput] = {}
        for prompt, p in zip(prompts, params):
            ids = self._encode(prompt)
            for i in range(p.n):
                sample = (
                    p
                    if p.n == 1
                    else dataclasses.replace(p, n=1, seed=None if p.seed is None else p.seed + i)
                )
                rid = str(self._next_id)
                self._next_id += 1
                self.engine.add_request(rid, ids, sample)
                if detokenizer is not None:
                    detokenizer.add_request(
                        rid,
                        ids,
                        sample.stop,
                        sample.skip_special_tokens,
                        sample.include_stop_str_in_output,
                    )
                order.append(rid)
                outputs[rid] = RequestOutput(
                    request_id=rid,
                    prompt_token_ids=ids,
                    token_ids=[],
                    text="",
                    finish_reason=None,
                    stop_reason=None,
                    logprobs=[] if sample.logprobs is not None else None,
                    prompt_logprobs=None,
                    num_cached_tokens=0,
                )
        bar = tqdm(total=len(order), disable=not use_tqdm, desc="Generating")
        while self.engine.has_unfinished_requests():
            deltas = self.engine.step()
            refused = self.engine.take_refused()
            if refused:  # a grammar that admits no output: this call's requests end with it
                for rid in order:
                    self.engine.abort_request(rid)
                raise ValueError(refused[0][1])
            for engine_delta in deltas:
                delta = engine_delta
                if detokenizer is not None:
                    delta = detokenizer.process(engine_delta)
                    if delta is None:
                        continue  # ended by a stop string already
                    if delta.finished and not engine_delta.finished:
                        self.engine.abort_request(delta.request_id)  # a stop string
                out = outputs[delta.request_id]
                out.token_ids.extend(delta.new_token_ids)
                out.text += delta.new_text
                if delta.new_logprobs is not None:
                    out.logprobs.extend(delta.new_logprobs)
                if delta.prompt_logprobs is not None:
                    out.prompt_logprobs = delta.prompt_logprobs
                out.num_cached_tokens = delta.num_cached_tokens
                if delta.finished:
                    out.finish_reason = delta.finish_reason
                    out.stop_reason = delta.stop_reason
                    bar.update(1)
        bar.close()
        return [outputs[rid] for rid in order]

    def chat(
        self,
        messages: list[dict] | Sequence[list[dict]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """`generate` on conversations (OpenAI-style message dicts, one list or several)
        rendered by the model's chat template with `tools` and `chat_template_kwargs` (e.g.
        enable_thinking), as vLLM's LLM.chat. The text comes back as generated: tool calls and
        reasoning are read by the server's parsers; a forced call is a grammar in
        SamplingParams.structured_outputs."""
        if self.tokenizer is None:
            raise ValueError("this model directory has no tokenizer to render a chat with")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            self.tokenizer.encode(
                self.tokenizer.apply_chat_template(
                    conversation,
                    tools=tools,
                    add_generation_prompt=True,
                    tokenize=False,
                    **(chat_template_kwargs or {}),
                ),
                add_special_tokens=False,  # the template holds them
            )
            for conversation in conversations
        ]
        return self.generate(prompts, params, use_tqdm)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do at TP=1)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def stats(self) -> EngineStats:
        """Pool occupancy and counters (KV pages and Mamba slots in use)."""
        return self.engine.stats()

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model directory has no tokenizer; pass token ids")
            return self.tokenizer.encode(prompt)
        return list(prompt)


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int):
        return [prompts]
    return prompts
