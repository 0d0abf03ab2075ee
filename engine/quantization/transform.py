"""The quantization pass, applied to a model once it is built (gpt-fast style: the families and
layers hold plain `nn.Linear`s and expert stacks and know nothing of it):

    quantize_modules   before loading: each linear / expert stack the checkpoint stores quantized
                       becomes a QuantizedLinear / QuantizedWeight with this rank's shapes, its
                       tensors checked against the scheme from the headers alone
    (the loader fills them, checking each tensor's values)
    finalize           after loading: stored tensors -> the kernels' per-row form; a weight its
                       layer reads rather than calls (`read_not_called`: MLA's kv_b_proj) is
                       dequantized into a plain weight
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

import torch
from torch import nn

from baton.engine.checkpoint.weights import ExpertParts, Rename
from baton.engine.parallel import Slices
from baton.engine.quantization.config import QuantConfig
from baton.engine.quantization.modules import (
    QuantizedLinear,
    QuantizedWeight,
    ReadWeight,
    StackPart,
)
from baton.engine.quantization.stored import Header, checked_shape, matrix_rule, stored_scheme
from baton.kernels.quant import concat_rows, quantize_fp8

log = logging.getLogger(__name__)

# Read and not applied: weight-only linears never quantize their inputs (the GPU's w8a8 uses
# dynamic per-token scales), and K/V stay in the model dtype.
UNUSED_SUFFIXES = (".input_scale", ".k_scale", ".v_scale")


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
            read = getattr(child, "read_not_called", False)  # a weight its layer reads
            if (type(child) is not nn.Linear and not read) or id(child.weight) in tied:
                continue
            name = prefix + attr
            scheme = stored_scheme(name, [name], quant, headers, left)
            if scheme is None:
                continue
            rule = matrix_rule(child.weight)
            shape, scale_shape = checked_shape([name], (), child.weight.shape, rule, scheme,
                                                quant, headers)  # fmt: skip
            common = dict(name=name, scheme=scheme, shape=shape, scale_shape=scale_shape,
                          size_word=size_word, device=child.weight.device)  # fmt: skip
            setattr(
                parent, attr, ReadWeight(**common) if read else QuantizedLinear(child, **common)
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
        pieces = [(attr, [name], (experts,), (n, k), matrix_rule(weight))]
    elif parts is not None and f"{prefix}0.{parts.names[0]}.weight" in headers:
        rows = n // len(parts.names)
        rule = None if parts.rule is None else Slices(dim=-2, ranges=parts.rule.ranges)
        pieces = [
            (part, [f"{prefix}{e}.{part}" for e in range(experts)], (), (rows, k), rule)
            for part in parts.names
        ]
    else:
        pieces = [(attr, [f"{prefix}{e}.{attr}" for e in range(experts)], (), (n, k),
                   matrix_rule(weight))]  # fmt: skip
    every = [matrix for _, matrices, *_ in pieces for matrix in matrices]
    scheme = stored_scheme(name, every, quant, headers, left)
    if scheme is None:
        return None
    checked = [checked_shape(m, lead, local, rule, scheme, quant, headers)
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


def finalize(model: nn.Module) -> None:
    """After loading: each quantized weight's stored tensors -> the kernels' per-row form; an
    expert stack stored in parts becomes one weight under the stack's name, the parts' rows in
    order (each keeping its scales)."""
    for module in model.modules():
        if isinstance(module, QuantizedWeight) and module.specs:
            module.finalize()
    for parent in list(model.modules()):
        for attr, child in list(parent.named_children()):
            if isinstance(child, ReadWeight):
                setattr(parent, attr, child.as_float())
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
