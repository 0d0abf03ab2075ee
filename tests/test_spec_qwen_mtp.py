"""The Qwen gated DeltaNet hybrids' multi-token-prediction layer (Qwen3.5 dense as its vision
checkpoint, Qwen3.5 MoE, Qwen3-Next): its config keys and weights as published checkpoints hold
them, its forward against a plain torch reference written from its definition
(tests/qwen_mtp_reference.py), the drafts the engine chains from it after every acceptance count,
and greedy output with MTP speculation equal to plain decoding (k = 1, 2, batched, chunked,
verify rows beside prefill chunks, prefix cache hits, through a PD pair)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from baton import LLM, SamplingParams
from baton.engine.checkpoint.loader import load_model
from baton.engine.config import ModelConfig
from baton.engine.config_error import ConfigError
from tests.qwen_mtp_models import add_qwen_mtp_layer, body_prefix
from tests.qwen_mtp_reference import mtp_reference

MODELS = ["qwen3_5_vision", "qwen3_5_moe", "qwen3_next_moe"]
PUBLISHED = Path(__file__).parent / "fixtures" / "published_configs"


@pytest.fixture(scope="module")
def mtp_models(gdn_models, tmp_path_factory):
    """name -> (model dir, transformers model of the target, MTP tensors)."""
    built = {}

    def get(name: str):
        if name not in built:
            source, hf = gdn_models(name)
            dest = tmp_path_factory.mktemp(f"qwen-mtp-{name}") / "model"
            built[name] = (dest, hf, add_qwen_mtp_layer(source, dest))
        return built[name]

    return get


def published(name: str, **changes) -> ModelConfig:
    raw = json.loads((PUBLISHED / name / "config.json").read_text())
    text = raw.get("text_config", raw)
    text.update(changes)
    for key, value in changes.items():
        if value is None:
            text.pop(key)
    return ModelConfig.from_dict(raw)


def test_mtp_layer_counts_read_as_published():
    next_80b = "qwen3_next_80b_a3b_instruct"  # names no MTP key: 1, as vLLM reads it
    assert published(next_80b).num_nextn_predict_layers == 1
    assert published(next_80b, num_nextn_predict_layers=0).num_nextn_predict_layers == 0
    assert published("qwen3_5_0_8b").num_nextn_predict_layers == 1  # text_config's key
    assert published("qwen3_5_35b_a3b").num_nextn_predict_layers == 1
    assert published("qwen3_5_0_8b", mtp_num_hidden_layers=None).num_nextn_predict_layers == 0
    with pytest.raises(ConfigError, match="2 MTP layers are not supported"):
        published("qwen3_5_35b_a3b", mtp_num_hidden_layers=2)


def test_mtp_weights_load_from_the_top_level_only_for_an_mtp_drafter(mtp_models):
    """Every `mtp.*` tensor of a vision checkpoint (body under model.language_model.) finds its
    parameter (the loader refuses unexpected and missing tensors) when the head is built."""
    model_dir, _, tensors = mtp_models("qwen3_5_vision")
    assert load_model(model_dir, torch.float32, "cpu").mtp is None
    head = load_model(model_dir, torch.float32, "cpu", with_mtp=True).mtp
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        torch.testing.assert_close(getattr(head, name).weight, tensors[f"mtp.{name}.weight"])
    torch.testing.assert_close(
        head.layers[0].self_attn.k_norm.weight, tensors["mtp.layers.0.self_attn.k_norm.weight"]
    )


@pytest.mark.parametrize("name", MODELS)
def test_mtp_forward_equals_the_torch_reference(mtp_models, name):
    """A draft forward over 11 positions of a fresh cache (its attention over its own K/V)."""
    from baton.engine.executor.draft_batch import DraftBatch
    from tests.spec_helpers import mtp_prefill_batch

    model_dir, _, tensors = mtp_models(name)
    config = ModelConfig.from_hf(model_dir)
    model = load_model(model_dir, torch.float32, "cpu", with_mtp=True)
    runner, batch = mtp_prefill_batch(model, tokens=list(range(30, 41)))
    g = torch.Generator().manual_seed(1)
    runner.target_hidden = torch.randn(len(batch.input_ids), config.hidden_size, generator=g)
    logits = runner.draft(
        DraftBatch(batch=batch, hidden_from="target", hidden_rows=tuple(range(11)))
    )
    stored = load_file(str(model_dir / "model.safetensors"))
    embedding = stored[body_prefix(stored) + "embed_tokens.weight"]
    want = mtp_reference(
        config, tensors, embedding[list(batch.input_ids)], runner.target_hidden, torch.arange(11)
    )
    torch.testing.assert_close(runner.draft_hidden.double(), want, atol=1e-4, rtol=1e-4)
    lm_head = stored.get("lm_head.weight", embedding).double()
    torch.testing.assert_close(logits[-1].double(), want[-1] @ lm_head.T, atol=1e-4, rtol=1e-4)


def reference_drafts(config, tensors, hf, prompt, k):
    """The MTP chain after a prompt, from transformers' target: the first token is the target's
    greedy one; the layer runs over every prompt position, then chains on its own output."""
    decoder = getattr(hf.model, "language_model", hf.model)
    with torch.no_grad():
        hidden = decoder(input_ids=torch.tensor([prompt])).last_hidden_state[0].double()
    embed = hf.get_input_embeddings().weight.double()
    lm_head = hf.lm_head.weight.double()
    first = int((hidden[-1] @ lm_head.T).argmax())
    tokens_after, states, drafts = prompt[1:] + [first], hidden, []
    for _ in range(k):
        positions = torch.arange(len(tokens_after))
        mtp_out = mtp_reference(config, tensors, embed[tokens_after], states, positions)
        drafts.append(int((mtp_out[-1] @ lm_head.T).argmax()))
        tokens_after = tokens_after + [drafts[-1]]
        states = torch.cat([states, mtp_out[-1:]])
    return first, drafts


class MtpUnderScript:
    """The engine's MTP drafter runs as always (its K/V, its proposals, recorded per request
    with the tokens so far); the drafts verified are a ScriptedDrafter's, so the MTP pass after
    a verify sees every acceptance count."""

    def __init__(self, mtp, scripted):
        self.mtp, self.scripted = mtp, scripted
        self.proposals: list[tuple[str, list[int], tuple[int, ...]]] = []

    def propose(self, sched, reqs, sampled):
        for s, drafts in self.mtp.propose(sched, reqs, sampled).items():
            tokens = list(reqs[s].output_ids) + list(sampled[s].token_ids)
            self.proposals.append((reqs[s].request_id, tokens, drafts))
        return self.scripted.propose(sched, reqs, sampled)

    def propose_from_slots(self, reqs):
        self.mtp.propose_from_slots(reqs)
        return self.scripted.propose_from_slots(reqs)


def test_engine_drafts_at_every_step_are_the_reference_chain(mtp_models):
    """The MTP K/V built over the prompt during its (chunked) prefill and over every position a
    verify step kept (0, 1 or 2 drafts accepted), each pass-1 row and the chain give, after
    every step, the drafts the reference computes over the whole sequence so far."""
    from tests.spec_helpers import ScriptedDrafter

    model_dir, hf, tensors = mtp_models("qwen3_5_vision")
    config = ModelConfig.from_hf(model_dir)
    prompt = [5, 9, 14, 3, 3, 28, 17, 40, 41, 8, 2, 61, 90, 7, 7, 12, 33, 19, 4]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = LLM(model_dir).generate([prompt], params)[0].token_ids
    llm = LLM(
        model_dir,
        chunked_prefill_size=8,
        speculative_config={"method": "mtp", "num_speculative_tokens": 2},
    )
    scripted = ScriptedDrafter({tuple(prompt): want}, 2, config.vocab_size)
    llm.engine.drafter = drafter = MtpUnderScript(llm.engine.drafter, scripted)
    assert llm.generate([prompt], params)[0].token_ids == want
    assert all(n > 0 for n in llm.stats().spec_decode_num_accepted_tokens_per_pos)
    assert len(drafter.proposals) > 3
    for _, tokens, drafts in drafter.proposals:
        first, chain = reference_drafts(config, tensors, hf, prompt + tokens[:-1], 2)
        assert first == tokens[-1]
        assert drafts == tuple(chain), f"after {len(tokens)} tokens"


GREEDY_PROMPTS = [[3, 4, 5, 6, 7, 8, 9, 10, 3, 4, 5], list(range(20, 45)), [40, 41, 40, 41, 42]]
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def plain_outputs(mtp_models):
    """A model's outputs for GREEDY_PROMPTS without speculation, computed once per model."""
    computed = {}

    def get(name: str):
        if name not in computed:
            computed[name] = LLM(mtp_models(name)[0]).generate(GREEDY_PROMPTS, GREEDY)
        return computed[name]

    return get


def assert_same_outputs(want, got) -> None:
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(want, got):  # the accepted tokens' logprobs: as without speculation
        assert all(
            abs(a.logprobs[i][t] - b.logprobs[i][t]) < 1e-4 for i, t in enumerate(a.token_ids)
        )


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("k", [1, 2])
def test_mtp_speculation_keeps_greedy_outputs(mtp_models, plain_outputs, name, k):
    """Three prompts at once, prefilled in chunks of 8: the shortest verifies while the others
    still prefill (mixed steps with verify rows)."""
    model_dir, _, _ = mtp_models(name)
    llm = LLM(
        model_dir,
        chunked_prefill_size=8,
        speculative_config={"method": "mtp", "num_speculative_tokens": k},
    )
    steps = []  # the target's steps (the draft passes run through runner.draft)
    forward = llm.engine.forward
    llm.engine.forward = lambda sched: (steps.append(sched), forward(sched))[1]
    assert_same_outputs(plain_outputs(name), llm.generate(GREEDY_PROMPTS, GREEDY))
    assert any(s.mode == "mixed" and s.num_verify_seqs for s in steps)
    stats = llm.stats()
    assert (
        stats.spec_decode_num_drafts > 0
        and stats.spec_decode_num_draft_tokens == k * stats.spec_decode_num_drafts
    )
    assert stats.kv_pages_used == 0 and stats.mamba_slots_used == 0


def test_mtp_speculation_through_prefix_cache_hits(mtp_models):
    """Prompts past a checkpoint (GDN chunk 64), then the same prompts with their outputs
    appended: the second round resumes from the checkpoints (the MTP K/V of the cached
    positions from the cached pages) and still gives plain decoding's tokens."""
    model_dir, _, _ = mtp_models("qwen3_next_moe")
    args = dict(page_size=4, mamba_track_interval=64)
    g = torch.Generator().manual_seed(3)
    first = [torch.randint(3, 280, (n,), generator=g).tolist() for n in (70, 66)]
    plain = LLM(model_dir, enable_prefix_caching=False, **args)
    spec = LLM(model_dir, speculative_config={"method": "mtp", "num_speculative_tokens": 2}, **args)
    for prompts in (first, [p + o.token_ids for p, o in zip(first, plain.generate(first, GREEDY))]):
        assert_same_outputs(plain.generate(prompts, GREEDY), spec.generate(prompts, GREEDY))
    stats = spec.stats()
    assert stats.prefix_cache_hit_tokens >= 2 * 64 and stats.spec_decode_num_drafts > 0


def test_pd_pair_with_mtp_drafting_matches_colocated_speculation(mtp_models):
    """The prefill worker builds the MTP K/V over the prompt and hands it over with the last
    hidden state; the decode worker drafts before its first step: the same tokens, logprobs and
    verify rows as one engine speculating alone."""
    import zmq

    from baton.engine.core.engine import Engine
    from tests.test_disagg_families import assert_as_colocated, close, pair
    from tests.test_disagg_unit import assert_pools_empty

    model_dir, _, _ = mtp_models("qwen3_5_moe")
    args = dict(page_size=4, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    g = torch.Generator().manual_seed(4)
    items = [("long", torch.randint(3, 280, (41,), generator=g).tolist()), ("short", [5, 9, 14])]
    run = pair(model_dir, zmq.Context(), args | dict(chunked_prefill_size=11), args)
    try:
        run(items, GREEDY)
        colocated = Engine(model_dir, **args)
        assert_as_colocated(run, colocated, items, GREEDY)
        pd, alone = run.decoder.engine.stats(), colocated.stats()
        assert pd.spec_decode_num_drafts == alone.spec_decode_num_drafts > 0
        assert pd.spec_decode_num_accepted_tokens == alone.spec_decode_num_accepted_tokens
        assert_pools_empty(run.prefill, run.decoder)
    finally:
        close(run)


def test_mtp_drafting_from_a_checkpoint_without_mtp_weights_names_them(gdn_models):
    """Qwen3-Next counts one MTP layer when its config names none (as vLLM); a checkpoint saved
    by transformers has no `mtp.*`, and drafting with it is refused naming the missing tensors."""
    from baton.engine.checkpoint.weights import WeightError

    model_dir, _ = gdn_models("qwen3_next_moe")
    with pytest.raises(WeightError, match="missing tensor.*'mtp.fc.weight'"):
        LLM(model_dir, speculative_config={"method": "mtp", "num_speculative_tokens": 1})


def test_a_quantized_checkpoint_drafts_with_its_mtp_layer(mtp_models, tmp_path):
    """As Qwen3.5's NVFP4 releases ship: the body and the MTP layer's decoder in NVFP4, `mtp.fc`
    left in BF16 without being listed. The MTP layer loads quantized as stored (fc plain), and
    speculation on that checkpoint keeps its own plain decoding's tokens."""
    from baton.engine.quantization.modules import QuantizedLinear
    from tests.quant_models import _QWEN_KEEP
    from tests.quantize import quantize_checkpoint

    model_dir, _, _ = mtp_models("qwen3_5_vision")
    quantized = tmp_path / "nvfp4"
    quantize_checkpoint(
        Path(model_dir), quantized, None, "modelopt_nvfp4", exclude=_QWEN_KEEP, unlisted=("mtp.fc",)
    )
    plain = LLM(quantized).generate(GREEDY_PROMPTS, GREEDY)
    llm = LLM(quantized, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    mtp = llm.engine.model.mtp
    assert not isinstance(mtp.fc, QuantizedLinear)
    assert any(isinstance(m, QuantizedLinear) for m in mtp.modules())
    assert_same_outputs(plain, llm.generate(GREEDY_PROMPTS, GREEDY))
    assert llm.stats().spec_decode_num_drafts > 0
