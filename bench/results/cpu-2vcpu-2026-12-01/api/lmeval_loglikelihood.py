"""lm-evaluation-harness's loglikelihood requests through baton vs transformers (see the .txt)."""

import torch
from lm_eval.api.instance import Instance
from lm_eval.models.openai_completions import LocalCompletionsAPI
from transformers import AutoModelForCausalLM, AutoTokenizer

lm = LocalCompletionsAPI(
    base_url="http://127.0.0.1:8817/v1/completions",
    model="assets",
    tokenizer="/work/main/assets",
    tokenizer_backend="huggingface",
    num_concurrent=2,
)
pairs = [
    ("Question: Sam has 3 apples and buys 4 more. How many apples?\nAnswer:", " 7"),
    ("Question: A pen costs 2 dollars. How much do 5 pens cost?\nAnswer:", " 10 dollars"),
]
reqs = [
    Instance(request_type="loglikelihood", doc={}, arguments=p, idx=i) for i, p in enumerate(pairs)
]
got = lm.loglikelihood(reqs)
tok = AutoTokenizer.from_pretrained("/work/main/assets")
model = AutoModelForCausalLM.from_pretrained("/work/main/assets", dtype=torch.float32).eval()
for (ctx, cont), (ll, greedy) in zip(pairs, got):
    c, w = tok.encode(ctx), tok.encode(ctx + cont)
    # lm-eval splits context / continuation tokens its own way; score the same ids
    ctx_ids, cont_ids = lm.tok_encode(ctx), lm.tok_encode(cont)
    ids = ctx_ids + cont_ids
    with torch.no_grad():
        lp = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    ref = sum(lp[len(ctx_ids) - 1 + i, t].item() for i, t in enumerate(cont_ids))
    print(f"lm-eval via baton: {ll:.5f} greedy={greedy}  transformers: {ref:.5f}")
