"""Train the small NemotronH shipped in assets/ on synthetic GSM8K problems, on the CPU.

    python -m bench.train_demo --output assets

The model (~1.3M parameters: hidden 192, blocks `M*M-M*M-`, 8 Mamba heads x 32, d_state 16,
4 query / 2 KV heads of 48, MLP 384) and a byte-level BPE tokenizer with digits split are
built from scratch. Every training sequence is a 5-shot prompt exactly as `baton eval gsm8k`
writes it, followed by its answer: six problems from the generator's training space, with the
loss on the answers (the questions are random). AdamW with a warmup and a cosine decay over
the time budget (`--minutes`), so a faster machine simply takes more steps.

Every `--eval-every` seconds the model is saved and the offline `LLM` answers the validation
space's questions greedily in the eval's 5-shot format; training stops once that accuracy
reaches `--target`. The final model is then scored on the held-out file (never trained on,
never used to stop) and that accuracy is printed.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch

from bench.gsm8k import (
    STOP,
    build_prompts,
    extract_answer,
    few_shot_prefix,
    format_example,
    reference_answer,
)
from bench.gsm8k_data import HELDOUT_PATH, Problem, generate, read_jsonl, take

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]  # ids 0, 1, 2, NemotronH's pad/bos/eos
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
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
    """A 5-shot prompt plus its answer, as the eval writes it, ending with the "Question" that
    would follow. The mask selects the tokens that predict answer text: " <worked answer>\n\n"
    and the next "Question", which the eval's stop string needs to see to end the answer."""
    text, answer_spans = "", []
    for problem in problems:
        text += format_example(problem.question)
        start = len(text)
        text += f" {problem.answer}\n\n"
        answer_spans.append((start, len(text) + len(STOP[0])))
    text += STOP[0]
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
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory))
    tokenizer.save_pretrained(str(directory))
    (directory / "generation_config.json").unlink(missing_ok=True)


def answers_correct(model_dir: Path, rows: list[dict], num_questions: int) -> list[bool]:
    """Greedy 5-shot answers of the saved model with baton's offline LLM (the eval's prompts):
    whether each asked question (rows after the shots) was answered right."""
    from engine import LLM, SamplingParams

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


def lr_at(progress: float, peak: float, warmup: float) -> float:
    """Linear warmup over the first `warmup` of the run, then cosine to 5% of `peak`."""
    if progress < warmup:
        return peak * progress / warmup
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, (progress - warmup) / (1 - warmup))))
    return peak * (0.05 + 0.95 * cosine)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.train_demo", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--output", default="assets", help="model directory to write (default: assets)"
    )
    parser.add_argument(
        "--minutes", type=float, default=30.0, help="training time budget (default: 30)"
    )
    parser.add_argument(
        "--target",
        type=float,
        default=0.9,
        help="stop once validation accuracy reaches this (default: 0.9)",
    )
    parser.add_argument(
        "--eval-every",
        type=float,
        default=180.0,
        help="seconds between validation evals (default: 180)",
    )
    parser.add_argument(
        "--eval-questions", type=int, default=100, help="validation questions (default: 100)"
    )
    parser.add_argument(
        "--batch-size", type=int, default=8, help="sequences of 6 problems per step (default: 8)"
    )
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (default: 2e-3)")
    parser.add_argument(
        "--vocab-size", type=int, default=512, help="BPE vocabulary size at most (default: 512)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="initialization and data seed (default: 0)"
    )
    parser.add_argument(
        "--threads", type=int, help="torch CPU threads (default: torch's own choice)"
    )
    parser.add_argument(
        "--heldout", default=str(HELDOUT_PATH), help="held-out JSONL scored at the end"
    )
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    tokenizer = train_tokenizer(args.vocab_size, args.seed)
    model = build_model(len(tokenizer), args.seed)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {params / 1e6:.2f}M parameters, vocabulary {len(tokenizer)}, {torch.get_num_threads()} threads"
    )
    valid = take(args.seed, NUM_SHOTS + args.eval_questions, "valid", unique=True)
    valid_rows = [p.row() for p in valid]
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.01
    )
    stream = generate(args.seed, "train")
    random.seed(args.seed)

    budget_s = args.minutes * 60
    checkpoint = Path(tempfile.mkdtemp(prefix="baton-train-"))
    start = last_eval = time.monotonic()
    eval_s = 0.0  # validation time, left out of the training clock
    step, tokens, smoothed = 0, 0, None
    try:
        while True:
            elapsed = time.monotonic() - start - eval_s
            if elapsed >= budget_s:
                print(f"time budget of {args.minutes:g} min reached")
                break
            lr = lr_at(elapsed / budget_s, args.lr, warmup=0.03)
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
            smoothed = loss.item() if smoothed is None else 0.95 * smoothed + 0.05 * loss.item()
            if step % 50 == 0:
                elapsed = time.monotonic() - start - eval_s
                print(
                    f"step {step}  {elapsed / 60:5.1f} min  loss {smoothed:.4f}  lr {lr:.2e}  {tokens / elapsed:,.0f} tok/s",
                    flush=True,
                )
            if time.monotonic() - last_eval >= args.eval_every:
                eval_start = time.monotonic()
                model.eval()
                save(model, tokenizer, checkpoint)
                correct = answers_correct(checkpoint, valid_rows, args.eval_questions)
                score = sum(correct) / len(correct)
                print(
                    f"step {step}  validation accuracy {score:.3f}  ({by_kind(valid[NUM_SHOTS:], correct)})",
                    flush=True,
                )
                last_eval = time.monotonic()
                eval_s += last_eval - eval_start
                if score >= args.target:
                    print(f"validation accuracy {score:.3f} >= {args.target}: stopping")
                    break
    finally:
        shutil.rmtree(checkpoint, ignore_errors=True)
    train_s = time.monotonic() - start - eval_s
    model.eval()
    output = Path(args.output)
    save(model, tokenizer, output)
    heldout_rows = read_jsonl(args.heldout)
    correct = answers_correct(output, heldout_rows, len(heldout_rows) - NUM_SHOTS)
    heldout = sum(correct) / len(correct)
    summary = {
        "steps": step,
        "train_minutes": round(train_s / 60, 2),
        "tokens_per_s": round(tokens / train_s),
        "heldout_accuracy": heldout,
        "heldout_questions": len(heldout_rows) - NUM_SHOTS,
    }
    print(json.dumps(summary))
    print(
        f"held-out accuracy: {heldout:.3f} on {summary['heldout_questions']} questions; model saved to {output}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
