"""Train the small NemotronH shipped in assets/ on synthetic GSM8K problems, on the CPU.

    python -m baton.bench.accuracy.train_demo --output assets [--threads N]

The model (~1.3M parameters: hidden 192, blocks `M*M-M*M-`, 8 Mamba heads x 32, d_state 16,
4 query / 2 KV heads of 48, MLP 384) and a byte-level BPE tokenizer with digits split are
built from scratch. Every training sequence is a 5-shot prompt exactly as `baton eval gsm8k`
writes it, followed by its answer: six problems from the generator's training space, with the
loss on the answers (the questions are random). AdamW, linear warmup, cosine decay over
`--steps`; data, initialization and schedule depend on the seed only, not on the machine.

Every `--eval-every` steps the model is saved and the offline `LLM` answers the validation
space's questions greedily in the eval's 5-shot format; training stops once that accuracy
reaches `--target` (or at `--steps`, or after `--minutes` of training). The final model is
scored the same way on the held-out file (never trained on, never used to stop) and saved.

The chat template renders messages into the same format, so `/v1/chat/completions` works:
a user message is asked as "Question: ...\nAnswer:" (kept as is if it already starts with
"Question:"), an assistant message is an answer, a system message a preamble.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch

from baton.bench.accuracy.gsm8k import (
    STOP,
    build_prompts,
    extract_answer,
    few_shot_prefix,
    format_example,
    reference_answer,
)
from baton.bench.accuracy.gsm8k_data import HELDOUT_PATH, Problem, generate, read_jsonl, take

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2, NemotronH's pad/bos/eos
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}{{ ' ' + message['content'] + '\\n\\n' }}"
    "{%- elif message['role'] == 'system' -%}{{ message['content'] + '\\n\\n' }}"
    "{%- elif message['content'].startswith('Question:') -%}{{ message['content'] }}"
    "{%- else -%}{{ 'Question: ' + message['content'] + '\\nAnswer:' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
)
MODEL_CONFIG = dict(
    hidden_size=192,
    hybrid_override_pattern="M*M-M*M-",
    mamba_num_heads=8,
    mamba_head_dim=32,
    ssm_state_size=16,
    n_groups=1,
    conv_kernel=4,
    chunk_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=48,
    intermediate_size=384,
    max_position_embeddings=2048,
    # transformers' NemotronH never ties lm_head to the embeddings, whatever this flag says.
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
NUM_SHOTS = 5
NEXT_QUESTION = "Question:"  # what follows an answer in the few-shot format


def train_tokenizer(vocab_size: int, seed: int):
    """A byte-level BPE with digits split into single tokens, trained on formatted problems."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    problems = take(seed + 1_000_000, 3000, "train")
    corpus = [few_shot_prefix([p.row() for p in problems[i : i + 6]]) for i in range(0, 3000, 6)]
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(vocab_size: int, seed: int):
    from transformers import NemotronHConfig, NemotronHForCausalLM

    config = NemotronHConfig(vocab_size=vocab_size, **MODEL_CONFIG)
    # transformers clamps dt below at time_step_min; write that clamp into time_step_limit so
    # baton (which clamps with time_step_limit) computes what the model was trained with.
    config.time_step_limit = (config.time_step_min, math.inf)
    torch.manual_seed(seed)
    return NemotronHForCausalLM(config)


class Batch(NamedTuple):
    input_ids: torch.Tensor  # (batch, seq) int64, right-padded with <pad>
    loss_mask: torch.Tensor  # (batch, seq) float32, 1 where the next token is an answer's


def encode_sequence(tokenizer, problems: list[Problem]) -> tuple[list[int], list[float]]:
    """A 5-shot prompt plus its answer, as the eval writes it, ending with the "Question:" that
    would follow. The mask selects the tokens that predict answer text: " <worked answer>\n\n"
    and the next "Question:", colon included, so that both baton's stop string ("Question") and
    lm-eval's stock gsm8k stop sequence ("Question:") end the answer right after "#### N"."""
    text, answer_spans = "", []
    for problem in problems:
        text += format_example(problem.question)
        start = len(text)
        text += f" {problem.answer}\n\n"
        answer_spans.append((start, len(text) + len(NEXT_QUESTION)))
    text += NEXT_QUESTION
    encoding = tokenizer.backend_tokenizer.encode(text, add_special_tokens=False)
    in_answer = [any(a <= start < b for a, b in answer_spans) for start, _ in encoding.offsets]
    # Position t predicts token t + 1: learn it when token t + 1 belongs to an answer.
    mask = [float(flag) for flag in in_answer[1:]] + [0.0]
    return encoding.ids, mask


def make_batch(tokenizer, stream, batch_size: int) -> Batch:
    sequences = [
        encode_sequence(tokenizer, [next(stream) for _ in range(NUM_SHOTS + 1)])
        for _ in range(batch_size)
    ]
    length = max(len(ids) for ids, _ in sequences)
    input_ids = torch.zeros(batch_size, length, dtype=torch.long)
    loss_mask = torch.zeros(batch_size, length)
    for row, (ids, mask) in enumerate(sequences):
        input_ids[row, : len(ids)] = torch.tensor(ids)
        loss_mask[row, : len(mask)] = torch.tensor(mask)
    return Batch(input_ids, loss_mask)


def masked_loss(model, batch: Batch) -> torch.Tensor:
    logits = model(input_ids=batch.input_ids).logits[:, :-1]
    targets = batch.input_ids[:, 1:]
    mask = batch.loss_mask[:, :-1]
    losses = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none"
    )
    return (losses * mask.reshape(-1)).sum() / mask.sum()


def save(model, tokenizer, directory: Path) -> None:
    """config.json, model.safetensors (fp32), tokenizer.json and a tokenizer_config.json that
    holds the chat template and names a tokenizer class older transformers versions know."""
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    config_path = directory / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config.update(
        tokenizer_class="PreTrainedTokenizerFast",
        model_max_length=model.config.max_position_embeddings,
        chat_template=CHAT_TEMPLATE,
    )
    config_path.write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    for extra in ("chat_template.jinja", "generation_config.json"):
        (directory / extra).unlink(missing_ok=True)


def answers_correct(model_dir: Path, rows: list[dict], num_questions: int) -> list[bool]:
    """Greedy 5-shot answers of the saved model with baton's offline LLM (the eval's prompts):
    whether each asked question (rows after the shots) was answered right."""
    from baton import LLM, SamplingParams

    prompts = build_prompts(rows, NUM_SHOTS, num_questions)
    asked = rows[NUM_SHOTS : NUM_SHOTS + len(prompts)]
    llm = LLM(model_dir, dtype="float32", device="cpu")
    outputs = llm.generate(prompts, SamplingParams(max_tokens=96, temperature=0, stop=STOP))
    return [
        extract_answer(out.text) == reference_answer(row["answer"])
        for out, row in zip(outputs, asked)
    ]


def by_kind(problems: list[Problem], correct: list[bool]) -> str:
    kinds: dict[str, list[bool]] = {}
    for problem, right in zip(problems, correct):
        kinds.setdefault(problem.kind, []).append(right)
    return " ".join(
        f"{kind} {sum(flags) / len(flags):.2f}" for kind, flags in sorted(kinds.items())
    )


def lr_at(step: int, steps: int, peak: float, warmup_steps: int) -> float:
    """Linear warmup, then cosine down to 5% of `peak` at `steps`."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, steps - warmup_steps))
    return peak * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress)))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m baton.bench.accuracy.train_demo",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = parser.add_argument
    add("--output", default="assets", help="model directory to write")
    add("--steps", type=int, default=3000, help="optimizer steps at most; the cosine ends here")
    add("--minutes", type=float, default=90.0, help="stop after this much training time")
    add("--target", type=float, default=0.9, help="stop once validation accuracy reaches it")
    add("--eval-every", type=int, default=200, help="steps between validation evals")
    add("--eval-questions", type=int, default=100, help="validation questions per eval")
    add("--batch-size", type=int, default=8, help="sequences (of 6 problems) per step")
    add("--lr", type=float, default=2e-3, help="peak learning rate")
    add("--warmup-steps", type=int, default=100, help="linear warmup steps")
    add("--vocab-size", type=int, default=512, help="BPE vocabulary size at most")
    add("--seed", type=int, default=0, help="initialization, data and tokenizer seed")
    add("--threads", type=int, help="torch CPU threads (default: torch's own choice)")
    add("--heldout", default=str(HELDOUT_PATH), help="held-out JSONL scored at the end")
    return parser.parse_args(argv)


def validate(model, tokenizer, checkpoint: Path, valid: list[Problem]) -> tuple[float, str]:
    save(model, tokenizer, checkpoint)
    correct = answers_correct(checkpoint, [p.row() for p in valid], len(valid) - NUM_SHOTS)
    return sum(correct) / len(correct), by_kind(valid[NUM_SHOTS:], correct)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    tokenizer = train_tokenizer(args.vocab_size, args.seed)
    model = build_model(len(tokenizer), args.seed)
    params = sum(p.numel() for p in model.parameters())
    print(f"model: {params / 1e6:.2f}M parameters, vocabulary {len(tokenizer)}, ", end="")
    print(f"{torch.get_num_threads()} threads", flush=True)
    valid = take(args.seed, NUM_SHOTS + args.eval_questions, "valid", unique=True)
    stream = generate(args.seed, "train")
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01
    )

    checkpoint = Path(tempfile.mkdtemp(prefix="baton-train-"))
    train_s, step, tokens, smoothed = 0.0, 0, 0, None
    try:
        while step < args.steps:
            if train_s >= args.minutes * 60:
                print(f"time budget of {args.minutes:g} min reached")
                break
            started = time.monotonic()
            lr = lr_at(step, args.steps, args.lr, args.warmup_steps)
            for group in optimizer.param_groups:
                group["lr"] = lr
            model.train()
            batch = make_batch(tokenizer, stream, args.batch_size)
            loss = masked_loss(model, batch)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            step += 1
            tokens += batch.input_ids.numel()
            train_s += time.monotonic() - started
            smoothed = loss.item() if smoothed is None else 0.95 * smoothed + 0.05 * loss.item()
            if step % 50 == 0:
                print(
                    f"step {step}  {train_s / 60:5.1f} min  loss {smoothed:.4f}  lr {lr:.2e}  "
                    f"{tokens / train_s:,.0f} tok/s",
                    flush=True,
                )
            if step % args.eval_every == 0:
                model.eval()
                score, kinds = validate(model, tokenizer, checkpoint, valid)
                print(f"step {step}  validation accuracy {score:.3f}  ({kinds})", flush=True)
                if score >= args.target:
                    print(f"validation accuracy {score:.3f} >= {args.target}: stopping")
                    break
    finally:
        shutil.rmtree(checkpoint, ignore_errors=True)
    model.eval()
    output = Path(args.output)
    save(model, tokenizer, output)
    heldout_rows = read_jsonl(args.heldout)
    correct = answers_correct(output, heldout_rows, len(heldout_rows) - NUM_SHOTS)
    heldout = sum(correct) / len(correct)
    summary = {
        "steps": step,
        "train_minutes": round(train_s / 60, 2),
        "tokens_per_s": round(tokens / max(train_s, 1e-9)),
        "heldout_accuracy": heldout,
        "heldout_questions": len(correct),
    }
    print(json.dumps(summary))
    print(f"held-out accuracy: {heldout:.3f} on {len(correct)} questions; model saved to {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
