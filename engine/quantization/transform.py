"""The quantization pass, applied to a model once it is built (gpt-fast style: the families and
layers hold plain `nn.Linear`s and expert stacks and know nothing of it):

    quantize_modules   before loading: each linear / expert stack the checkpoint stores quantized
                       becomes a QuantizedLinear / QuantizedWeight with this rank's shapes, its
                       tensors checked against the scheme from the headers alone
    (the loader fills them, checking each tensor's values)
    finalize           after loading: stored tensors -> the kernels' per-row form
    quantize_online    `--quantization fp8` on an unquantized checkpoint, after loading

Which weights are quantized is what the checkpoint holds, checked against its config: a layer
with scale tensors must be one the config quantizes (else an error naming the tensor and the
key); a layer the config would quantize but stored in a float dtype without scales (an exclude
list that misses one, as Qwen3.5 NVFP4's `mtp.fc`) stays in that dtype, with a log line.
Expert stacks are the attributes a layer lists in `quantizable_stacks` ((E, N, K) weights); one a
checkpoint stores in parts per expert (Qwen3.5-MoE's gate_proj / up_proj) is quantized part by
part and joined after loading (modules.py).
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from engine.checkpoint.weights import ExpertParts, Rename, checkpoint_files
from engine.parallel import Slices, shard_rule
from engine.quantization.config import LayerScheme, QuantConfig
from engine.quantization.modules import QuantizedLinear, QuantizedWeight, StackPart
from engine.quantization.schemes import WeightError, WeightShape, check_header, tensor_specs
from kernels.quant import concat_rows, quantize_fp8

log = logging.getLogger(__name__)

SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv", "weight_scale_2")
# Read and not applied: weight-only linears never quantize their inputs (the GPU's w8a8 uses
# dynamic per-token scales), and K/V stay in the model dtype.
UNUSED_SUFFIXES = (".input_scale", ".k_scale", ".v_scale")
QUANTIZED_DTYPES = ("F8_E4M3", "U8")


@dataclass(frozen=True, kw_only=True, slots=True)
class Header:
    dtype: str  # safetensors' code: F32, BF16, F8_E4M3, U8, ...
    shape: tuple[int, ...]


def checkpoint_headers(model_dir: str | Path, rename: Rename) -> dict[str, Header]:
    """Every tensor's dtype and shape by model name (headers only, nothing read)."""
    headers: dict[str, Header] = {}
    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt") as shard:
            for name in shard.keys():
                renamed = rename(name)
                if renamed is not None:
                    part = shard.get_slice(name)
                    headers[renamed] = Header(dtype=part.get_dtype(), shape=tuple(part.get_shape()))
    return headers


def skip_unused(rename: Rename) -> Rename:
    """`rename`, also skipping the tensors the pass reads from the headers and does not apply."""

    def renamed(name: str) -> str | None:
        return None if name.endswith(UNUSED_SUFFIXES) else rename(name)

    return renamed


def quantize_modules(
    model: nn.Module, quant: QuantConfig, headers: dict[str, Header], tp_size: int
) -> None:
    """Replace, in place, every linear and expert stack the checkpoint stores quantized."""
    size_word = f"tensor-parallel size {tp_size}"
    tied = tied_parameters(model)
    counts: Counter[str] = Counter()
    left: list[str] = []
    for parent_name, parent in list(model.named_modules()):
        prefix = f"{parent_name}." if parent_name else ""
        for attr, child in list(parent.named_children()):
            if type(child) is not nn.Linear or id(child.weight) in tied:
                continue
            name = prefix + attr
            scheme = _scheme(name, [name], quant, headers, left)
            if scheme is None:
                continue
            rule = _matrix_rule(child.weight)
            shape, scale_shape = _checked_shape([name], (), child.weight.shape, rule, scheme,
                                                quant, headers)  # fmt: skip
            setattr(
                parent,
                attr,
                QuantizedLinear(
                    child,
                    name=name,
                    scheme=scheme,
                    shape=shape,
                    scale_shape=scale_shape,
                    size_word=size_word,
                    device=child.weight.device,
                ),
            )
            counts[scheme.algo] += 1
        for attr in getattr(parent, "quantizable_stacks", ()):
            algo = _quantize_stack(parent, prefix, attr, quant, headers, left, size_word)
            if algo is not None:
                counts[f"{algo} expert stack"] += 1
    _log_summary(quant, counts, left, headers)


def _quantize_stack(
    parent: nn.Module,
    prefix: str,
    attr: str,
    quant: QuantConfig,
    headers: dict[str, Header],
    left: list[str],
    size_word: str,
) -> str | None:
    """The (E, N, K) expert stack `attr` of `parent` as the checkpoint stores it: one tensor
    (transformers' Granite), one per expert (Nemotron 3), or one per expert and part (Qwen3.5-MoE's
    gate_proj and up_proj, the stack's [gate | up] rows, as the layer declares with ExpertParts):
    a QuantizedWeight per stored kind of matrix. Returns its algorithm, None if left as it is."""
    name = prefix + attr
    value = getattr(parent, attr)
    weight = value if isinstance(value, torch.Tensor) else value.weight
    experts, (n, k) = weight.shape[0], weight.shape[-2:]
    parts: ExpertParts | None = getattr(weight, "_baton_expert_parts", None)
    # (attribute, checkpoint matrices, lead dims on disk, this rank's (n, k), its slice)
    pieces: list[tuple[str, list[str], tuple[int, ...], tuple[int, int], Slices | None]]
    if f"{name}.weight" in headers:
        pieces = [(attr, [name], (experts,), (n, k), _matrix_rule(weight))]
    elif parts is not None and f"{prefix}0.{parts.names[0]}.weight" in headers:
        rows = n // len(parts.names)
        rule = None if parts.rule is None else Slices(dim=-2, ranges=parts.rule.ranges)
        pieces = [
            (part, [f"{prefix}{e}.{part}" for e in range(experts)], (), (rows, k), rule)
            for part in parts.names
        ]
    else:
        pieces = [(attr, [f"{prefix}{e}.{attr}" for e in range(experts)], (), (n, k),
                   _matrix_rule(weight))]  # fmt: skip
    every = [matrix for _, matrices, *_ in pieces for matrix in matrices]
    scheme = _scheme(name, every, quant, headers, left)
    if scheme is None:
        return None
    checked = [_checked_shape(m, lead, local, rule, scheme, quant, headers)
               for _, m, lead, local, rule in pieces]  # fmt: skip
    part_of = StackPart(stack=attr, parts=tuple(p[0] for p in pieces)) if len(pieces) > 1 else None
    if isinstance(value, torch.Tensor):
        delattr(parent, attr)
    for (part, *_), (shape, scale_shape) in zip(pieces, checked):
        setattr(
            parent,
            part,
            QuantizedWeight(
                name=prefix + part,
                scheme=scheme,
                shape=shape,
                lead=(experts,),
                scale_shape=scale_shape,
                size_word=size_word,
                device=weight.device,
                part_of=part_of,
            ),
        )
    return scheme.algo


def tied_parameters(model: nn.Module) -> set[int]:
    """Parameters held under two names (an lm_head tied to the embeddings): never quantized."""
    seen = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    return {key for key, uses in seen.items() if uses > 1}


def _scheme(
    name: str,
    matrices: list[str],
    quant: QuantConfig,
    headers: dict[str, Header],
    left: list[str],
) -> LayerScheme | None:
    """The scheme of the weight `name` whose checkpoint tensors are `matrices` (one, or one per
    expert and part), None to leave it as it is (stored unquantized: noted in `left` when the
    config would quantize it). WeightError when its matrices are stored unlike each other or
    unlike the config."""
    stored = [m for m in matrices if f"{m}.weight" in headers]
    if not stored:
        return None  # not in the checkpoint: the loader reports it missing
    quantized = [
        m
        for m in stored
        if headers[f"{m}.weight"].dtype in QUANTIZED_DTYPES
        or any(f"{m}.{s}" in headers for s in SCALE_SUFFIXES)
    ]
    per_matrix = [quant.scheme_for(m) for m in stored]
    schemes = {None if s is None else (s.algo, s.block) for s in per_matrix}
    if not quantized:
        if schemes != {None}:
            left.append(name)
        return None
    if len(quantized) != len(stored):
        raise WeightError(
            f"tensor {quantized[0]}.weight is quantized but {sorted(set(stored) - set(quantized))[0]}"
            f".weight is not: the experts of {name} must be stored alike"
        )
    if len(schemes) != 1 or None in schemes:
        first = next((m for m in stored if quant.scheme_for(m) is None), None)
        if first is None:
            raise WeightError(
                f"{quant.source}: the experts of {name} are listed with different quant_algo "
                f"({sorted(a for a, _ in schemes)}); one stack is stored one way"
            )
        pattern = quant.excluded(first)
        why = (
            f"{quant.exclude_key} lists {pattern!r}"
            if pattern is not None
            else ("it is not in quantized_layers")
        )
        raise WeightError(
            f"tensor {first}.weight is stored quantized, but {quant.source} leaves {first} "
            f"unquantized ({why})"
        )
    return per_matrix[0]


def _checked_shape(
    matrices: list[str],
    lead: tuple[int, ...],
    local: tuple[int, int],
    rule: Slices | None,
    scheme: LayerScheme,
    quant: QuantConfig,
    headers: dict[str, Header],
) -> tuple[WeightShape, tuple[int, ...] | None]:
    """The shape of a weight this rank holds as (n, k) = `local`, sliced by `rule`, and its FP8
    scale shape, once every stored tensor's dtype and shape is checked against `scheme`
    (WeightError naming tensor and key)."""
    stored = [m for m in matrices if f"{m}.weight" in headers]
    shape = _weight_shape(local, rule, headers[f"{stored[0]}.weight"], scheme)
    scale = headers.get(f"{stored[0]}.weight_scale")
    scale_shape = scale.shape[len(lead) :] if scale is not None else None
    for matrix in stored:
        for spec in tensor_specs(scheme, shape, scale_shape):
            tensor = f"{matrix}.{spec.suffix}"
            if tensor not in headers:
                raise WeightError(
                    f"tensor {tensor!r} is missing: {quant.source} {scheme.key} ({scheme.algo}) "
                    f"stores it beside {matrix}.weight"
                )
            found = headers[tensor]
            check_header(tensor, spec, found.dtype, found.shape, lead, scheme, quant.source)
    return shape, scale_shape


def _matrix_rule(weight: torch.Tensor) -> Slices | None:
    """The weight's tensor-parallel slice on its last two dims (-2: rows, -1: inputs)."""
    rule = shard_rule(weight)
    if not isinstance(rule, Slices):
        return None
    on_rows = rule.dim % weight.dim() == weight.dim() - 2
    return Slices(dim=-2 if on_rows else -1, ranges=rule.ranges)


def _weight_shape(
    local: tuple[int, int], rule: Slices | None, header: Header, scheme: LayerScheme
) -> WeightShape:
    """The whole model's (N, K) (the checkpoint's along the sliced axis) and this rank's."""
    n, k = local
    stored_n, stored_cols = header.shape[-2:]
    stored_k = stored_cols * 2 if scheme.algo == "NVFP4" else stored_cols
    if rule is None:
        return WeightShape(full=(n, k), local=(n, k), rule=None)
    full = (stored_n, k) if rule.dim == -2 else (n, stored_k)
    return WeightShape(full=full, local=(n, k), rule=rule)


def finalize(model: nn.Module) -> None:
    """After loading: each quantized weight's stored tensors -> the kernels' per-row form; an
    expert stack stored in parts becomes one weight under the stack's name, the parts' rows in
    order (each keeping its scales)."""
    for module in model.modules():
        if isinstance(module, QuantizedWeight) and module.specs:
            module.finalize()
    for parent in list(model.modules()):
        for attr, child in list(parent.named_children()):
            part_of = getattr(child, "part_of", None)
            if part_of is None or attr != part_of.parts[0]:
                continue
            parts = [getattr(parent, part).quantized for part in part_of.parts]
            for part in part_of.parts:
                delattr(parent, part)
            setattr(parent, part_of.stack, QuantizedWeight.of(concat_rows(parts)))


def quantize_online(model: nn.Module) -> None:
    """`--quantization fp8` on an unquantized checkpoint (after loading): every linear but the
    lm_head, and every expert stack, to FP8 with one scale per matrix (per expert), as vLLM's
    online dynamic FP8. At TP > 1 each rank scales its own slice."""
    tied = tied_parameters(model)
    count = 0
    for parent in list(model.modules()):
        for attr, child in list(parent.named_children()):
            if type(child) is nn.Linear and attr != "lm_head" and id(child.weight) not in tied:
                setattr(
                    parent, attr, QuantizedLinear.of_parts(quantize_fp8(child.weight), child.bias)
                )
                count += 1
        for attr in getattr(parent, "quantizable_stacks", ()):
            value = getattr(parent, attr)
            weight = value if isinstance(value, torch.Tensor) else value.weight
            if isinstance(value, torch.Tensor):
                delattr(parent, attr)
            setattr(parent, attr, QuantizedWeight.of(quantize_fp8(weight.detach())))
            count += 1
    log.info(
        "--quantization fp8: %d linears and expert stacks quantized at load (FP8, one scale "
        "per matrix; weight-only on the CPU)",
        count,
    )


def _log_summary(
    quant: QuantConfig, counts: Counter[str], left: list[str], headers: dict[str, Header]
) -> None:
    kinds = ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items())) or "nothing"
    log.info("quantization %s (%s): %s quantized", quant.method, quant.source, kinds)
    if left:
        log.info(
            "%d weights the config would quantize are stored unquantized and stay so: %s",
            len(left),
            ", ".join(left[:8]) + (" ..." if len(left) > 8 else ""),
        )
    unused = Counter(n.rsplit(".", 1)[1] for n in headers if n.endswith(UNUSED_SUFFIXES))
    if unused.get("input_scale"):
        log.info(
            "%d input_scale tensors read and not applied: quantized linears are weight-only on "
            "the CPU (W8A16 / W4A16) and quantize activations per token on the GPU",
            unused["input_scale"],
        )
    kv = unused.get("k_scale", 0) + unused.get("v_scale", 0)
    if kv or quant.kv_cache:
        log.info(
            "KV cache scales (%s, %d k_scale/v_scale tensors) read and unused: K/V stay in the "
            "model dtype",
            quant.kv_cache or "no kv_cache algorithm",
            kv,
        )
