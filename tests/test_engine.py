"""The engine under batching, chunked prefill, mixed batches and preemption vs transformers."""

from __future__ import annotations

import pytest
import torch

from baton import LLM, SamplingParams
from tests.reference import assert_greedy_matches, hf_greedy


def workload(vocab: int, n: int = 24, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.linspace(1, 300, n).round().int().tolist()
    max_tokens = torch.randint(1, 65, (n,), generator=g).tolist()
    prompts = [torch.randint(3, vocab, (length,), generator=g).tolist() for length in lengths]
    return prompts, max_tokens


@pytest.fixture(scope="module")
def references(base_model):
    _, hf = base_model
    prompts, max_tokens = workload(hf.config.vocab_size)
    return prompts, max_tokens, [hf_greedy(hf, p, m) for p, m in zip(prompts, max_tokens)]


def check_against_reference(outs, prompts, references):
    compared = total = 0
    for i, (out, (ref, ref_lp)) in enumerate(zip(outs, references)):
        upto = assert_greedy_matches(
            out.token_ids, ref, ref_lp, f"request {i} (prompt {len(prompts[i])})"
        )
        for step in range(upto):
            token = out.token_ids[step]
            assert abs(out.logprobs[step][token] - float(ref_lp[step, token])) < 1e-4, (i, step)
        compared += upto
        total += len(ref)
        assert out.finish_reason == "length"
    assert compared >= 0.9 * total


def test_batched_chunked_mixed_matches_transformers(base_model, references):
    model_dir, _ = base_model
    prompts, max_tokens, refs = references
    llm = LLM(model_dir, page_size=4, max_num_batched_tokens=96, chunked_prefill_size=40)
    modes = []
    original = llm.engine.forward
    llm.engine.forward = lambda sched: (modes.append(sched.mode), original(sched))[1]
    params = [
        SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, logprobs=1) for m in max_tokens
    ]
    outs = llm.generate(prompts, params)
    assert {"mixed", "decode"} <= set(modes)  # the workload really mixed batches
    check_against_reference(outs, prompts, refs)
    stats = llm.stats()
    assert stats.kv_pages_used == 0 and stats.mamba_slots_used == 0


def test_preemption_keeps_outputs_identical(base_model, references):
    model_dir, _ = base_model
    prompts, max_tokens, refs = references
    llm = LLM(
        model_dir,
        page_size=4,
        max_num_batched_tokens=128,
        chunked_prefill_size=64,
        max_total_tokens=420,
        max_mamba_slots=6,
    )
    params = [
        SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, logprobs=1) for m in max_tokens
    ]
    outs = llm.generate(prompts, params)
    stats = llm.stats()
    assert stats.num_preemptions > 0
    check_against_reference(outs, prompts, refs)
    assert stats.kv_pages_used == 0 and stats.mamba_slots_used == 0


def test_abort_mid_flight_frees_everything(base_model):
    model_dir, _ = base_model
    llm = LLM(
        model_dir,
        page_size=4,
        max_num_batched_tokens=64,
        chunked_prefill_size=32,
        max_running_requests=3,
    )
    engine = llm.engine
    for i in range(6):
        engine.add_request(
            f"r{i}",
            list(range(3, 3 + 20 * (i + 1))),
            SamplingParams(max_tokens=50, ignore_eos=True),
        )
    for _ in range(4):
        engine.step()
    busy = engine.stats()
    assert busy.kv_pages_used > 0 and busy.mamba_slots_used > 0 and busy.num_waiting > 0
    for i in range(6):
        engine.abort_request(f"r{i}")
    assert not engine.has_unfinished_requests()
    stats = engine.stats()
    assert stats.kv_pages_used == 0 and stats.mamba_slots_used == 0
    assert engine.step() == []


def test_seeded_sampling_is_batch_independent(base_model):
    model_dir, _ = base_model
    llm = LLM(model_dir, page_size=4)
    prompt = list(range(5, 30))
    params = SamplingParams(
        max_tokens=20, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True
    )
    (alone,) = llm.generate([prompt], params)
    others = [list(range(40, 40 + n)) for n in (3, 17, 60)]
    batch = llm.generate(
        others[:2] + [prompt] + others[2:],
        [SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)] * 2
        + [params]
        + [SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)],
    )
    assert batch[2].token_ids == alone.token_ids
    (other_seed,) = llm.generate(
        [prompt],
        SamplingParams(
            max_tokens=20, temperature=0.9, top_p=0.9, top_k=50, seed=99, ignore_eos=True
        ),
    )
    assert other_seed.token_ids != alone.token_ids


def test_stop_conditions(base_model):
    model_dir, hf = base_model
    llm = LLM(model_dir, page_size=4)
    prompt = list(range(3, 20))
    (free,) = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    stop_id = free.token_ids[5]
    first = free.token_ids.index(stop_id)
    (by_id,) = llm.generate(
        [prompt],
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=[stop_id]),
    )
    assert by_id.token_ids == free.token_ids[: first + 1]
    assert by_id.finish_reason == "stop" and by_id.stop_reason == stop_id
    # A stop string taken from the free-running text ends the output before it.
    text = free.text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    (by_str,) = llm.generate(
        [prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop])
    )
    assert by_str.finish_reason == "stop" and by_str.stop_reason == stop
    assert by_str.text == text[: text.index(stop)]
    # EOS stops unless ignore_eos.
    eos = hf.config.eos_token_id
    (with_eos,) = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, logprobs=0))
    assert with_eos.finish_reason in ("stop", "length")
    if with_eos.finish_reason == "stop":
        assert with_eos.token_ids[-1] == eos
    assert llm.stats().kv_pages_used == 0


def test_n_samples_and_penalties(base_model):
    model_dir, _ = base_model
    llm = LLM(model_dir, page_size=4)
    prompt = list(range(3, 12))
    outs = llm.generate(
        [prompt], SamplingParams(max_tokens=10, temperature=1.0, n=3, seed=7, ignore_eos=True)
    )
    assert len(outs) == 3 and len({tuple(o.token_ids) for o in outs}) > 1
    (plain,) = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    (penalised,) = llm.generate(
        [prompt],
        SamplingParams(
            max_tokens=24,
            temperature=0,
            ignore_eos=True,
            repetition_penalty=2.0,
            frequency_penalty=2.0,
        ),
    )
    assert len(set(penalised.token_ids)) >= len(set(plain.token_ids))
    assert penalised.token_ids != plain.token_ids


def test_invalid_requests_are_rejected_with_reasons(base_model):
    model_dir, _ = base_model
    llm = LLM(model_dir, page_size=4, max_model_len=64)
    engine = llm.engine
    with pytest.raises(ValueError, match="at least one token"):
        engine.add_request("a", [], SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("b", [5, 100000], SamplingParams())
    with pytest.raises(ValueError, match=r"60 tokens.*max_tokens \(10\).*64"):
        engine.add_request("c", list(range(3, 63)), SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    # ids the sampler would index the logits with: refused here, never an IndexError in a step
    with pytest.raises(ValueError, match=r"stop_token_ids: token id 100000 is outside"):
        engine.add_request("d", [5], SamplingParams(stop_token_ids=[100000], min_tokens=2))
    with pytest.raises(ValueError, match=r"logit_bias: token id 100000 is outside"):
        engine.add_request("e", [5], SamplingParams(logit_bias={100000: 1.0}))
    with pytest.raises(ValueError, match=r"logit_bias: nan for token 5"):
        SamplingParams(logit_bias={5: float("nan")})
    with pytest.raises(ValueError, match=r"logit_bias: key '5' is not a token id"):
        SamplingParams(logit_bias={"5": 1.0})
    assert engine.stats().num_waiting == 0


def test_prompt_logprobs_survive_a_preemption_mid_prompt(base_model):
    """A request preempted half-way through its prompt recomputes the prompt's logprobs from the
    start: the same list as an undisturbed run, one entry per prompt token (echo scores it)."""
    model_dir, _ = base_model
    prompt = [(5 * i) % 200 + 3 for i in range(40)]
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=2)
    (undisturbed,) = LLM(model_dir, page_size=4).generate([prompt], params)
    assert len(undisturbed.prompt_logprobs) == len(prompt)
    llm = LLM(model_dir, page_size=4, chunked_prefill_size=16, max_num_batched_tokens=16)
    engine = llm.engine
    engine.add_request("r", prompt, params)
    engine.step()  # 16 of the 40 prompt tokens
    req = engine.requests["r"]
    assert 0 < len(req.prompt_logprobs) < len(prompt)
    engine.scheduler.preempt(req)
    assert req.prompt_logprobs == [] and req.wants_prompt_logprobs
    deltas = []
    while engine.has_unfinished_requests():
        deltas += engine.step()
    (first,) = [d for d in deltas if d.prompt_logprobs is not None]
    assert len(first.prompt_logprobs) == len(prompt) and first.prompt_logprobs[0] is None
    for got, want in zip(first.prompt_logprobs[1:], undisturbed.prompt_logprobs[1:], strict=True):
        assert got.keys() == want.keys()
        assert all(abs(got[t] - want[t]) < 1e-5 for t in got)
    assert [t for d in deltas for t in d.new_token_ids] == undisturbed.token_ids


def test_prompt_logprobs_in_row_blocks_equal_one_pass(base_model, monkeypatch):
    """The engine walks a chunk's prompt-logprob rows a few at a time (no second copy of a
    chunk's logits): blocks of 3 rows give what blocks of the whole chunk give."""
    import baton.engine.core.sampler as sampler_module

    model_dir, _ = base_model
    prompt = [(7 * i) % 250 + 3 for i in range(37)]
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True, prompt_logprobs=3)
    runs = []
    for rows in (4096, 3):
        monkeypatch.setattr(sampler_module, "PROMPT_LOGPROB_ROWS", rows)
        llm = LLM(model_dir, page_size=4, chunked_prefill_size=16, max_num_batched_tokens=16)
        (out,) = llm.generate([prompt], params)
        runs.append(out.prompt_logprobs)
    whole, blocked = runs
    assert len(whole) == len(blocked) == len(prompt) and whole[0] is blocked[0] is None
    for a, b in zip(whole[1:], blocked[1:], strict=True):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-6 for t in a)
