"""The gated DeltaNet layer and what the GDN families add around it, without serving: the state
spec's TP split, each rank's weight slices against transformers' per-head projections, true
states at checkpoint positions in a mixed step (and the seed bug caught when the track mask is
dropped), per-expert checkpoint tensors packed at load, and the config refusals."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from safetensors.torch import load_file, save_file

from baton.engine import parallel
from baton.engine.cache.pools import StateCache
from baton.engine.checkpoint.loader import load_model
from baton.engine.checkpoint.weights import WeightError
from baton.engine.config import ModelConfig
from baton.engine.config_error import ConfigError
from baton.engine.executor.forward_metadata import ScheduledBatch, TrackPoint
from baton.engine.executor.model_runner import ModelRunner
from baton.engine.layers.gated_deltanet import GatedDeltaNet, GDNConfig
from baton.engine.models import qwen_hybrid
from baton.engine.parallel import TensorParallel
from baton.engine.parallel.support import check_tp_supported
from tests.gdn_families import GDN_CONFIGS
from tests.tiny import load_json

HIDDEN = 32


def gdn_config(Hk: int, Hv: int, projections="qkvz_ba") -> GDNConfig:
    return GDNConfig(
        num_k_heads=Hk, num_v_heads=Hv, k_head_dim=8, v_head_dim=6, conv_kernel=4,
        beta_scale=1.0, norm_eps=1e-6, projections=projections, names=("norm", "out_proj"),
    )  # fmt: skip


def test_state_spec_splits_key_heads_replicated_below_the_rank_count():
    spec = GatedDeltaNet.state_spec(gdn_config(1, 2), torch.bfloat16)
    conv, state = spec.tensors
    assert (conv.shape, conv.dtype) == ((2 * 8 + 2 * 6, 3), torch.bfloat16)
    assert (state.shape, state.dtype) == ((2, 8, 6), torch.float32)
    # 2 ranks, one key head: q and k whole on both, v and the state by value head
    assert conv.ranges(2, 1) == ((0, 8), (8, 8), (16 + 6, 6))
    assert conv.local_shape(2, 1) == (8 + 8 + 6, 3) and state.local_shape(2, 1) == (1, 8, 6)


@pytest.mark.parametrize(
    "Hk,Hv,key",
    [(3, 6, "linear_num_key_heads=3"), (1, 3, "linear_num_value_heads=3")],
)
def test_state_spec_refuses_heads_the_ranks_cannot_share(Hk, Hv, key):
    spec = GatedDeltaNet.state_spec(gdn_config(Hk, Hv), torch.float32)
    with pytest.raises(ConfigError, match=key):
        spec.tensors[0].ranges(2, 0)


PROJECTIONS = {"qwen3_next": "qkvz_ba", "qwen3_5": "qkv_z_b_a", "olmo_hybrid": "separate"}


def hf_mixer(family: str, Hk: int, Hv: int):
    """transformers' GDN mixer of `family` (random, fixed seed), its weights as the family's
    checkpoints store them, and its per-head projections x -> q, k, v, z (T, heads, dim), b, a."""
    common = dict(
        hidden_size=HIDDEN, linear_num_key_heads=Hk, linear_num_value_heads=Hv,
        linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4,
        num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
    )  # fmt: skip
    torch.manual_seed(0)
    if family == "qwen3_next":
        from transformers import Qwen3NextConfig
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

        hf = Qwen3NextGatedDeltaNet(Qwen3NextConfig(**common), 0).eval()

        def heads(x):
            return tuple(t[0] for t in hf.fix_query_key_value_ordering(
                hf.in_proj_qkvz(x[None]), hf.in_proj_ba(x[None])))  # fmt: skip

        return hf, hf.state_dict(), heads
    if family == "qwen3_5":
        from transformers import Qwen3_5TextConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

        hf = Qwen3_5GatedDeltaNet(Qwen3_5TextConfig(**common), 0).eval()
        q, k, v = hf.in_proj_qkv.weight.split([Hk * 8, Hk * 8, Hv * 6])
        projections = (q, k, v, hf.in_proj_z.weight, hf.in_proj_b.weight, hf.in_proj_a.weight)
        state = hf.state_dict()
    else:
        from transformers import OlmoHybridConfig
        from transformers.models.olmo_hybrid.modeling_olmo_hybrid import OlmoHybridGatedDeltaNet

        hf = OlmoHybridGatedDeltaNet(OlmoHybridConfig(**common, pad_token_id=0), 0).eval()
        projections = tuple(getattr(hf, f"{p}_proj").weight for p in ("q", "k", "v", "g", "b", "a"))
        state = hf.state_dict()
        conv = state.pop("conv1d.weight")  # the release stores it cut at the q | k | v widths
        for p, part in zip("qkv", conv.split([Hk * 8, Hk * 8, Hv * 6])):
            state[f"{p}_conv1d.weight"] = part

    def heads(x):
        q, k, v, z, b, a = (x @ w.T for w in projections)
        T = x.shape[0]
        return (q.view(T, Hk, 8), k.view(T, Hk, 8), v.view(T, Hv, 6), z.view(T, Hv, 6), b, a)

    return hf, state, heads


def rank_layer(config: GDNConfig, state: dict, rank: int, size: int) -> GatedDeltaNet:
    """The layer as rank `rank` of `size` builds it, each parameter read from the full
    checkpoint tensors through its own slice rule."""
    tp = TensorParallel(rank=rank, size=size, group=None, timeout_s=0.0)
    with parallel.building(tp):
        layer = GatedDeltaNet(HIDDEN, config, 0)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            rule = parallel.shard_rule(param)
            param.copy_(state[name] if rule is None else rule(state[name]))
    return layer


@pytest.mark.parametrize("family", list(PROJECTIONS))
@pytest.mark.parametrize("Hk,Hv", [(2, 4), (1, 2)])
@pytest.mark.parametrize("rank", [0, 1])
@torch.no_grad()
def test_each_rank_projects_transformers_heads_of_its_share(family, Hk, Hv, rank):
    """A rank of 2 (key heads split, or replicated when there is one) must project exactly
    transformers' q, k, v, z, b, a of its heads, whatever layout the family stores them in
    (Qwen3-Next packs them per key head), and hold its heads' conv channels and decays."""
    hf, state, heads = hf_mixer(family, Hk, Hv)
    config = dataclasses.replace(gdn_config(Hk, Hv, PROJECTIONS[family]),
                                 names=("o_norm", "o_proj") if family == "olmo_hybrid"
                                 else ("norm", "out_proj"))  # fmt: skip
    layer = rank_layer(config, state, rank, 2)
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(1))
    q, k, v, z, b, a = heads(x)
    ks = slice(rank * Hk // 2, rank * Hk // 2 + max(1, Hk // 2))
    vs = slice(rank * Hv // 2, (rank + 1) * Hv // 2)
    expected_qkv = torch.cat([q[:, ks].flatten(1), k[:, ks].flatten(1), v[:, vs].flatten(1)], -1)
    got_qkv, got_z, got_b, got_a = layer.project(x)
    torch.testing.assert_close(got_qkv, expected_qkv)
    torch.testing.assert_close(got_z, z[:, vs].flatten(1))
    torch.testing.assert_close(got_b, b[:, vs])
    torch.testing.assert_close(got_a, a[:, vs])
    conv = hf.conv1d.weight[:, 0]
    key = Hk * 8
    q_rows = range(ks.start * 8, ks.stop * 8)
    v_rows = range(2 * key + vs.start * 6, 2 * key + vs.stop * 6)
    rows = [*q_rows, *(r + key for r in q_rows), *v_rows]
    torch.testing.assert_close(layer.mixer_weights().conv_weight, conv[rows])
    torch.testing.assert_close(layer.A_log, hf.A_log[vs])


def scheduled(mode, ids, lens, starts, pages, slots, points) -> ScheduledBatch:
    return ScheduledBatch(
        mode=mode,
        request_ids=tuple(f"r{i}" for i in range(len(lens))),
        num_decode_seqs=1 if mode == "mixed" else 0,
        num_verify_seqs=0,
        input_ids=tuple(ids),
        seq_lens=tuple(lens),
        start_positions=tuple(starts),
        kv_pages=tuple(pages),
        mamba_slots=tuple(slots),
        logits_seqs=tuple(range(len(lens))),
        prompt_logprob_seqs=(),
        has_mamba_track_mask=bool(points),
        track_points=tuple(points),
        lora_slots=(-1,) * len(tuple(f"r{i}" for i in range(len(lens)))),
        verify_slots=(),
    )


@torch.no_grad()
def test_mixed_step_checkpoints_true_states_and_a_dropped_track_mask_is_caught(gdn_models):
    """One mixed step: a decode row checkpointed after its token, a prefill checkpointed at a
    chunk boundary. The checkpoint slots must hold the working state after the decode token and
    the state of a run that stopped at the boundary; the same step with the track mask dropped
    (the seed bug) leaves them stale, and the comparison fails."""
    model_dir, _ = gdn_models("qwen3_5_dense")
    config = ModelConfig.from_hf(model_dir)
    model = load_model(model_dir, torch.float32, "cpu")
    g = torch.Generator().manual_seed(5)
    a, b = (torch.randint(3, config.vocab_size, (n,), generator=g).tolist() for n in (65, 70))
    pages_a, pages_b = tuple(range(1, 20)), tuple(range(20, 40))

    def fresh():
        cache = StateCache.for_model(
            config, num_pages=48, page_size=4, num_slots=8, dtype=torch.float32, device="cpu"
        )
        return cache, ModelRunner(model, cache, "cpu")

    def mixed_step(drop_mask: bool):
        cache, runner = fresh()
        runner.forward(scheduled("extend", a[:64], [64], [0], [pages_a], [1], ()))
        points = (TrackPoint(seq_index=0, token_offset=0, dst_slot=5),
                  TrackPoint(seq_index=1, token_offset=63, dst_slot=6))  # fmt: skip
        sched = scheduled(
            "mixed", [a[64], *b], [1, 70], [64, 0], [pages_a, pages_b], [1, 2], points
        )
        md = runner.build(sched)
        if drop_mask:
            md = dataclasses.replace(md, has_mamba_track_mask=False)
        model(md, cache)
        return cache

    ref_cache, ref_runner = fresh()
    ref_runner.forward(scheduled("extend", b[:64], [64], [0], [pages_b], [2], ()))

    def check(cache):
        for name in ("gdn.conv", "gdn.recurrent"):
            pool, ref = cache.pools[name], ref_cache.pools[name]
            torch.testing.assert_close(pool[:, 5], pool[:, 1], atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(pool[:, 6], ref[:, 2], atol=1e-5, rtol=1e-5)
            assert pool[:, 5].abs().sum() > 0

    check(mixed_step(drop_mask=False))
    with pytest.raises(AssertionError):
        check(mixed_step(drop_mask=True))


def test_a_missing_per_expert_projection_is_named(gdn_models, tmp_path):
    """Qwen's experts are stored per expert (gate_proj and up_proj packed into one [gate | up]
    parameter at load): a checkpoint without one of them is refused by that tensor's name."""
    model_dir, _ = gdn_models("qwen3_5_moe")
    for item in model_dir.iterdir():
        if item.name != "model.safetensors":
            (tmp_path / item.name).write_bytes(item.read_bytes())
    tensors = load_file(str(model_dir / "model.safetensors"))
    missing = "model.layers.2.mlp.experts.5.up_proj.weight"
    del tensors[missing]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightError, match=missing.replace(".", r"\.")):
        load_model(tmp_path, torch.float32, "cpu")


def test_vision_tower_is_skipped_with_one_log_line(gdn_models, caplog):
    model_dir, _ = gdn_models("qwen3_5_vision")
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        assert any(n.startswith("model.visual.") for n in f.keys())
    qwen_hybrid._log_vision_skipped.cache_clear()
    with caplog.at_level(logging.INFO, logger="baton.engine.models.qwen_hybrid"):
        load_model(model_dir, torch.float32, "cpu")
    lines = [r for r in caplog.records if "vision tower" in r.getMessage()]
    assert len(lines) == 1


def modified(name: str, gdn_models, **changes) -> dict:
    model_dir, _ = gdn_models(name)
    raw = load_json(model_dir / "config.json")
    target = raw.get("text_config", raw)
    target.update(changes)
    return raw


@pytest.mark.parametrize(
    "name,changes,key",
    [
        ("qwen3_next_moe", dict(hidden_act="gelu"), "hidden_act='gelu'"),
        ("qwen3_5_vision", dict(mamba_ssm_dtype="bfloat16"), "mamba_ssm_dtype='bfloat16'"),
        ("olmo_hybrid_nope", dict(linear_num_value_heads=6), "linear_num_value_heads=6"),
        ("qwen3_5_moe", dict(num_experts_per_tok=9), "num_experts_per_tok=9"),
    ],
)
def test_configs_baton_cannot_run_are_refused_by_key(gdn_models, name, changes, key):
    with pytest.raises(ConfigError, match=key):
        ModelConfig.from_dict(modified(name, gdn_models, **changes))


def test_tensor_parallel_refused_naming_the_key(gdn_models):
    model_dir, _ = gdn_models("qwen3_next_mixed")  # 3 key heads, 3 value heads
    with pytest.raises(ConfigError, match="linear_num_key_heads=3"):
        check_tp_supported(ModelConfig.from_hf(model_dir), 2)


@pytest.mark.parametrize("name", [n for n in GDN_CONFIGS if n != "qwen3_next_mixed"])
def test_every_family_supports_tensor_parallelism_where_its_heads_split(gdn_models, name):
    check_tp_supported(ModelConfig.from_hf(gdn_models(name)[0]), 2)


def test_experts_stacked_as_qwen3_5_moe_releases_them_load_alike(gdn_models, tmp_path):
    """The released Qwen3.5-MoE checkpoints stack each layer's experts (`experts.gate_up_proj`
    (E, 2I, H) [gate | up], `experts.down_proj` (E, H, I)); transformers' save_pretrained writes
    them per expert. Both layouts give the same model."""
    model_dir, _ = gdn_models("qwen3_5_moe_vision")
    for item in model_dir.iterdir():
        if item.name != "model.safetensors":
            (tmp_path / item.name).write_bytes(item.read_bytes())
    tensors = load_file(str(model_dir / "model.safetensors"))
    prefixes = sorted({n.split(".experts.")[0] for n in tensors if ".experts." in n})
    for prefix in prefixes:
        per = sorted(n for n in tensors if n.startswith(prefix + ".experts."))
        stacked = {
            proj: torch.stack([tensors[f"{prefix}.experts.{e}.{proj}.weight"]
                               for e in range(len(per) // 3)])
            for proj in ("gate_proj", "up_proj", "down_proj")
        }  # fmt: skip
        for n in per:
            del tensors[n]
        tensors[f"{prefix}.experts.gate_up_proj"] = torch.cat(
            [stacked["gate_proj"], stacked["up_proj"]], dim=1
        )
        tensors[f"{prefix}.experts.down_proj"] = stacked["down_proj"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    per_expert = load_model(model_dir, torch.float32, "cpu").state_dict()
    stacked = load_model(tmp_path, torch.float32, "cpu").state_dict()
    experts = [n for n in per_expert if ".experts." in n]
    assert experts and per_expert.keys() == stacked.keys()
    for name in experts:
        torch.testing.assert_close(stacked[name], per_expert[name], rtol=0, atol=0)
