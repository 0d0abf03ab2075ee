"""The multi-position state updates of a speculative verify: the conv window and the SSM state
after EACH of q tokens, written to its own slot; the fused C step equals q fused decode steps
and the torch path (the GPU's) equals the token-by-token oracle."""

from __future__ import annotations

import pytest
import torch

from baton.kernels.conv1d import causal_conv1d_update_multi
from baton.kernels.cpu import ops as cpu_ops
from baton.kernels.cpu.verify import mamba_verify_cpu, mamba_verify_supported
from tests.oracles import conv_oracle

needs_cc = pytest.mark.skipif(cpu_ops.library() is None, reason="no C compiler")


@pytest.mark.parametrize("K", [3, 4])
def test_conv_update_multi_keeps_the_window_after_each_token(K):
    q, dim = 3, 6
    g = torch.Generator().manual_seed(K)
    x = torch.randn(2, q, dim, generator=g)
    w, b = torch.randn(dim, K, generator=g), torch.randn(dim, generator=g)
    pool = torch.randn(10, dim, K - 1, generator=g)
    before = pool.clone()
    # request 0 reads slot 2 and writes in place then to 5, 6; request 1 is padding (slot 0)
    slots = torch.tensor([[2, 2, 5, 6], [0, 0, 0, 0]])
    out = causal_conv1d_update_multi(x, w, b, pool, slots)
    ref, _, windows = conv_oracle(x[0], w, b, before[2:3], [q])
    torch.testing.assert_close(out[0].double(), ref, atol=1e-5, rtol=1e-5)
    for i, slot in enumerate((2, 5, 6)):
        torch.testing.assert_close(pool[slot].double(), windows[0][i], atol=1e-6, rtol=1e-6)
    untouched = [s for s in range(10) if s not in (0, 2, 5, 6)]
    assert torch.equal(pool[untouched], before[untouched])


def mamba_inputs(dtype, H=4, P=8, G=2, N=6, K=4, batch=3, q=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    I = H * P
    conv_dim = I + 2 * G * N
    zxbcdt = torch.randn(batch * q, I + conv_dim + H, generator=g).to(dtype)
    conv = torch.randn(12, conv_dim, K - 1, generator=g).to(dtype)
    ssm = torch.randn(12, H, P, N, generator=g)
    params = cpu_ops.MambaDecodeParams(
        conv_weight=torch.randn(conv_dim, K, generator=g),
        conv_bias=torch.randn(conv_dim, generator=g),
        dt_bias=torch.randn(H, generator=g),
        A=-torch.rand(H, generator=g) * 3,
        D=torch.randn(H, generator=g),
        norm_weight=1 + 0.1 * torch.randn(I, generator=g),
    )
    dims = dict(num_heads=H, head_dim=P, n_groups=G, d_state=N, norm_group=I // 2)
    return zxbcdt, conv, ssm, params, dims


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_verify_step_equals_q_fused_decode_steps(dtype):
    """Token i of each request through the fused decode step, one after the other, gives the
    verify step's output row and the state it kept in slot column i + 1."""
    q, batch = 3, 3
    zxbcdt, conv, ssm, params, dims = mamba_inputs(dtype, batch=batch, q=q)
    table = torch.tensor([[1, 1, 4, 5], [2, 2, 6, 7], [3, 3, 8, 9]])
    conv_v, ssm_v = conv.clone(), ssm.clone()
    assert mamba_verify_supported(zxbcdt, conv_v, ssm_v, q)
    out = mamba_verify_cpu(
        zxbcdt, conv_v, ssm_v, table, params, (0.001, 5.0), 1e-5, **dims, norm_mode="gated"
    )
    conv_d, ssm_d = conv.clone(), ssm.clone()
    rows = zxbcdt.view(batch, q, -1)
    for i in range(q):
        step = cpu_ops.mamba_decode_cpu(
            rows[:, i], conv_d, ssm_d, table[:, 0], params, (0.001, 5.0), 1e-5, **dims
        )
        assert torch.equal(out.view(batch, q, -1)[:, i], step)
        assert torch.equal(ssm_v[table[:, i + 1]], ssm_d[table[:, 0]])
        assert torch.equal(conv_v[table[:, i + 1]], conv_d[table[:, 0]])


@needs_cc
def test_fused_verify_step_refuses_a_slot_outside_the_pool():
    zxbcdt, conv, ssm, params, dims = mamba_inputs(torch.float32, batch=1, q=2)
    table = torch.tensor([[1, 1, 12]])
    with pytest.raises(IndexError, match="slot index 12"):
        mamba_verify_cpu(
            zxbcdt[:2], conv, ssm, table, params, (0.0, 1e30), 1e-5, **dims, norm_mode="gated"
        )


def test_mixer_verify_torch_path_equals_the_fused_step(base_model, monkeypatch):
    """The Mamba2 mixer's verify rows: the torch path (multi-token conv, multi-token state
    update, gate: what a GPU runs) and the fused C step agree."""
    from baton.engine.checkpoint.loader import load_model
    from baton.engine.layers import mamba2
    from tests.spec_helpers import verify_metadata

    model_dir, _ = base_model
    model = load_model(model_dir, torch.float32, "cpu")
    mixer = next(m for m in model.modules() if isinstance(m, mamba2.Mamba2Mixer))
    md, cache, hidden = verify_metadata(model, model_dir)
    fused_cache = {name: pool.clone() for name, pool in cache.pools.items()}
    fused = mixer(hidden, md, cache)
    fused_pools = {name: pool.clone() for name, pool in cache.pools.items()}
    for name, pool in cache.pools.items():
        pool.copy_(fused_cache[name])
    monkeypatch.setattr(mamba2, "mamba_verify_supported", lambda *args: False)
    torch_path = mixer(hidden, md, cache)
    torch.testing.assert_close(torch_path, fused, atol=2e-5, rtol=2e-5)
    for name, pool in cache.pools.items():
        torch.testing.assert_close(pool, fused_pools[name], atol=2e-5, rtol=2e-5)
