"""A test quantizer: writes a saved (fp32) model directory as the quantized checkpoints are shipped
(same tensor names, dtypes and config keys), and beside it the same model with the dequantized
values in float32 (the reference transformers and baton load unquantized).

Formats, as published:
  modelopt_fp8    NVIDIA ModelOpt FP8: `weight` F8_E4M3 = round(w / s), `weight_scale` F32 scalar
                  s = amax / 448, `input_scale` F32 scalar; config.json `quantization_config`
                  {quant_method modelopt, quant_algo FP8, ignore, kv_cache_scheme} and
                  hf_quant_config.json {quantization: {quant_algo, exclude_modules,
                  kv_cache_quant_algo}}; `k_proj.k_scale` / `v_proj.v_scale` beside attention
  modelopt_nvfp4  ModelOpt NVFP4: `weight` U8 (N, K/2), even input in the low nibble;
                  `weight_scale` F8_E4M3 (N, K/16) = e4m3(block amax / (6 * s2)) clamped to
                  [2^-9, 448] (an all-zero block: 1); `weight_scale_2` F32 s2 = amax / (6 * 448);
                  values rounded to e2m1 with ties to even; `input_scale`; group_size 16
  modelopt_mixed  quant_algo MIXED_PRECISION with `quantized_layers` {name: {quant_algo, ...}}
                  (NVFP4 or W4A16_NVFP4: the same tensors)
  fp8_block       fine-grained FP8 (DeepSeek / Qwen3-Next / Qwen3.5): `weight` F8_E4M3,
                  `weight_scale_inv` per (bn, bk) block (edge blocks partial: ceil shapes),
                  multiplied, F32 (Qwen's releases: BF16); config {quant_method fp8, fmt e4m3,
                  activation_scheme dynamic, weight_block_size, modules_to_not_convert}, the
                  list naming every module left unquantized where Qwen's releases do
Tensors not quantized are written in bfloat16 (a real checkpoint's dtype) unless keep_dtype; the
router and its bias stay float32 as NVIDIA ships them. An expert stack stored as one (E, N, K)
tensor (Granite) gets scales with E in front (transformers' FP8 writes it so). Qwen3.5-MoE's
experts, which transformers saves stacked without a `.weight` (`mlp.experts.gate_up_proj`,
`mlp.experts.down_proj`), are written one tensor per expert and projection as Qwen's and NVIDIA's
quantized releases store them (`mlp.experts.{e}.gate_proj.weight`, `up_proj`, `down_proj`); the
float32 reference keeps transformers' stacked layout.
"""

from __future__ import annotations

import fnmatch
import json
import math
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

E4M3_MAX = 448.0
E2M1_BOUNDS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
E2M1_VALUES = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6])
NOT_LINEAR = ("embed", "norm", "conv1d", "lm_head", ".gate.", "router", "A_log", "dt_bias")
STACKED_EXPERTS = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
NVFP4_ALGOS = ("NVFP4", "W4A16_NVFP4")


def quantizable(name: str, tensor: torch.Tensor) -> bool:
    """A linear's weight (2-D) or an expert stack (3-D), not the router, head or embeddings."""
    return (
        name.endswith(".weight")
        and tensor.dim() in (2, 3)
        and not any(part in name for part in NOT_LINEAR)
    )


def fp8_tensor(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """ModelOpt FP8 of one (N, K) matrix or an (E, N, K) stack (one scale per matrix)."""
    amax = w.abs().amax(dim=(-2, -1), keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    codes = (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return {"weight": codes, "weight_scale": scale.reshape(w.shape[:-2])}


def fp8_block(
    w: torch.Tensor, block: tuple[int, int], scale_dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Fine-grained FP8: one scale per (bn, bk) block, the edge blocks partial; the scales stored
    in `scale_dtype` and the codes computed from the stored scales."""
    bn, bk = block
    n, k = w.shape[-2:]
    rows, cols = math.ceil(n / bn), math.ceil(k / bk)
    padded = torch.nn.functional.pad(w, (0, cols * bk - k, 0, rows * bn - n))
    blocks = padded.reshape(*w.shape[:-2], rows, bn, cols, bk)
    amax = blocks.abs().amax(dim=(-3, -1))
    scale_inv = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax)).to(scale_dtype)
    full = scale_inv.float().repeat_interleave(bn, -2).repeat_interleave(bk, -1)[..., :n, :k]
    codes = (w / full).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return {"weight": codes, "weight_scale_inv": scale_inv}


def to_e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 value's 4-bit code (bit 3 the sign), ties to the even mantissa."""
    magnitude = x.abs()
    code = torch.searchsorted(E2M1_BOUNDS, magnitude.contiguous())
    tie_up = (magnitude.unsqueeze(-1) == E2M1_BOUNDS[[1, 3, 5]]).any(-1)  # 0.75, 1.75, 3.5
    return (code + tie_up.long() + 8 * (x < 0).long()).to(torch.uint8)


def nvfp4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """ModelOpt NVFP4 of one matrix or a stack (one weight_scale_2 per matrix)."""
    lead, (n, k) = w.shape[:-2], w.shape[-2:]
    scale_2 = w.abs().amax(dim=(-2, -1)) / (6.0 * E4M3_MAX)
    groups = w.reshape(*lead, n, k // 16, 16)
    block_scale = groups.abs().amax(-1) / (6.0 * scale_2[..., None, None])
    block_scale = torch.where(block_scale == 0, torch.ones_like(block_scale), block_scale)
    block_scale = block_scale.clamp(2**-9, E4M3_MAX).to(torch.float8_e4m3fn)
    scaled = groups / (block_scale.float() * scale_2[..., None, None])[..., None]
    codes = to_e2m1_codes(scaled.reshape(*lead, n, k))
    packed = (codes[..., 1::2] << 4) | codes[..., 0::2]
    return {"weight": packed, "weight_scale": block_scale, "weight_scale_2": scale_2}


def dequantized(tensors: dict[str, torch.Tensor], block: tuple[int, int] | None) -> torch.Tensor:
    """The value the format defines for its tensors, in float32."""
    weight = tensors["weight"]
    if "weight_scale_2" in tensors:
        codes = torch.stack([weight & 0xF, weight >> 4], -1).flatten(-2).long()
        values = E2M1_VALUES[codes]
        scale = tensors["weight_scale"].float().repeat_interleave(16, -1)
        return values * scale * tensors["weight_scale_2"][..., None, None]
    if "weight_scale_inv" in tensors:
        n, k = weight.shape[-2:]
        scale = tensors["weight_scale_inv"].float().repeat_interleave(block[0], -2)
        return weight.float() * scale.repeat_interleave(block[1], -1)[..., :n, :k]
    return weight.float() * tensors["weight_scale"][..., None, None]


def quantize_checkpoint(
    src: Path,
    dst: Path,
    ref: Path | None,
    fmt: str,
    *,
    exclude: tuple[str, ...] = (),
    unlisted: tuple[str, ...] = (),
    mixed: dict[str, str] | None = None,
    block: tuple[int, int] = (128, 128),
    scale_dtype: torch.dtype = torch.float32,
    list_every_unquantized: bool = False,
    keep_dtype: bool = False,
) -> None:
    """src (a save_pretrained directory) -> dst (quantized as `fmt`) and ref (its dequantized
    values in float32, no quantization config; None: not written). exclude: on-disk module
    names or fnmatch patterns listed as left unquantized; unlisted: modules left unquantized
    WITHOUT being listed (an exclude list that misses one); mixed: module (or prefix) -> FP8 |
    NVFP4 | W4A16_NVFP4 for modelopt_mixed; scale_dtype: fp8_block's weight_scale_inv;
    list_every_unquantized: fp8_block's modules_to_not_convert names every module (and
    parameter) left unquantized, as Qwen's FP8 releases do, instead of the exclude list."""
    tensors = load_file(str(src / "model.safetensors"))
    stacked = {n: t.shape[0] for n, t in tensors.items() if STACKED_EXPERTS.match(n)}
    tensors = per_expert(tensors)
    quantized: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    listed_layers: dict[str, dict] = {}
    not_converted: list[str] = []
    for name, value in tensors.items():
        module = name.removesuffix(".weight")
        algo = _algo(fmt, module, mixed)
        listed = not quantizable(name, value) or algo is None or _matches(module, exclude)
        if listed:
            not_converted.append(module.removesuffix(".bias"))
        if listed or _matches(module, unlisted):
            router = ".gate." in name or "router" in name
            stored = value if keep_dtype or router else value.to(torch.bfloat16)
            quantized[name], reference[name] = stored, stored.float()
            continue
        parts = (
            nvfp4(value)
            if algo in NVFP4_ALGOS
            else fp8_block(value, block, scale_dtype)
            if algo == "FP8_BLOCK"
            else fp8_tensor(value)
        )
        for suffix, tensor in parts.items():
            quantized[f"{module}.{suffix}"] = tensor.contiguous()
        if fmt.startswith("modelopt"):
            quantized[f"{module}.input_scale"] = torch.tensor(0.02 + 0.001 * len(quantized))
            if module.endswith(("k_proj", "v_proj")):
                kind = "k" if module.endswith("k_proj") else "v"
                quantized[f"{module}.{kind}_scale"] = torch.tensor(0.0125)
        if fmt == "modelopt_mixed":
            listed_layers[module] = {"quant_algo": algo} | (
                {"group_size": 16} if algo in NVFP4_ALGOS else {}
            )
        reference[name] = dequantized(parts, block).contiguous()
    reference = restacked(reference, stacked)
    if list_every_unquantized:
        exclude = tuple(dict.fromkeys(not_converted))
    config = json.loads((src / "config.json").read_text())
    for out, tensors in ((dst, quantized), (ref, reference)):
        if out is None:
            continue
        out.mkdir(parents=True, exist_ok=True)
        for path in src.iterdir():  # config, tokenizer, generation config
            if path.is_file() and path.suffix != ".safetensors":
                shutil.copy(path, out / path.name)
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    if ref is not None:
        ref_config = dict(config, torch_dtype="float32", dtype="float32")
        (ref / "config.json").write_text(json.dumps(ref_config, indent=1))
    config["torch_dtype"] = config["dtype"] = "float32" if keep_dtype else "bfloat16"
    if "text_config" in config:  # a vision checkpoint says it of its language model too
        config["text_config"]["dtype"] = config["dtype"]
    config["quantization_config"], hf_quant = _configs(fmt, exclude, listed_layers, block)
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    if hf_quant is not None:
        (dst / "hf_quant_config.json").write_text(json.dumps(hf_quant, indent=1))


def per_expert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Qwen3.5-MoE's stacked experts (`mlp.experts.gate_up_proj` (E, 2I, H), `down_proj`
    (E, H, I)) as one tensor per expert and projection; every other tensor as it is."""
    out: dict[str, torch.Tensor] = {}
    for name, value in tensors.items():
        match = STACKED_EXPERTS.match(name)
        if match is None:
            out[name] = value
            continue
        gate_up = match["proj"] == "gate_up_proj"
        projections = ("gate_proj", "up_proj") if gate_up else ("down_proj",)
        for e in range(value.shape[0]):
            for projection, part in zip(projections, value[e].chunk(len(projections), dim=0)):
                out[f"{match['prefix']}.{e}.{projection}.weight"] = part.contiguous()
    return out


def restacked(tensors: dict[str, torch.Tensor], stacked: dict[str, int]) -> dict[str, torch.Tensor]:
    """per_expert undone for `stacked` (name -> number of experts): the reference's layout."""
    out = dict(tensors)
    for name, experts in stacked.items():
        match = STACKED_EXPERTS.match(name)
        gate_up = match["proj"] == "gate_up_proj"
        projections = ("gate_proj", "up_proj") if gate_up else ("down_proj",)
        out[name] = torch.stack([
            torch.cat([out.pop(f"{match['prefix']}.{e}.{p}.weight") for p in projections])
            for e in range(experts)
        ]).contiguous()  # fmt: skip
    return out


def _matches(module: str, patterns: tuple[str, ...]) -> bool:
    return any(
        module == p or module.startswith(p + ".") or fnmatch.fnmatchcase(module, p)
        for p in patterns
    )


def _algo(fmt: str, module: str, mixed: dict[str, str] | None) -> str | None:
    if fmt == "modelopt_mixed":
        return next(
            (
                a
                for key, a in (mixed or {}).items()
                if module == key or module.startswith(key + ".")
            ),
            None,
        )
    return {"modelopt_fp8": "FP8", "modelopt_nvfp4": "NVFP4", "fp8_block": "FP8_BLOCK"}[fmt]


def _configs(fmt: str, exclude, layers: dict, block) -> tuple[dict, dict | None]:
    if fmt == "fp8_block":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": list(block),
            "modules_to_not_convert": list(dict.fromkeys(["lm_head", *exclude])),
        }, None
    algo = {"modelopt_fp8": "FP8", "modelopt_nvfp4": "NVFP4", "modelopt_mixed": "MIXED_PRECISION"}
    ignore = ["lm_head", *exclude]
    producer = {"name": "modelopt", "version": "0.47.0"}
    config = {
        "quant_method": "modelopt",
        "quant_algo": algo[fmt],
        "ignore": ignore,
        "kv_cache_scheme": {"dynamic": False, "num_bits": 8, "type": "float"},
        "producer": producer,
    }
    inner = {"quant_algo": algo[fmt], "kv_cache_quant_algo": "FP8", "exclude_modules": ignore}
    if fmt == "modelopt_nvfp4":
        config["group_size"] = inner["group_size"] = 16
    if fmt == "modelopt_mixed":
        config["quantized_layers"] = inner["quantized_layers"] = layers
    return config, {"producer": producer, "quantization": inner}
