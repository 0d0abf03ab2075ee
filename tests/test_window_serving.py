"""The sliding-window families on the serving paths that follow the state spec (nothing in the
pools, prefix cache, handover, wire or TP planning names LFM3, RecurrentGemma or the window),
each for the models that release pages: the two whose only paged kind is windowed (LFM3 with
sliding layers only, RecurrentGemma: one page table) and LFM3 with sliding and full attention
(two page tables, interleaved in each request's page list: the sliding one is released, the
full one kept; ModelStateSpec.page_tables):

    prefix cache on     == off, with hits: the model releases the pages behind its window
                        while decoding, so the block its decode closes is cached with the dummy
                        page where pages were released; a later prompt that extends prompt +
                        output resumes there and reads only the window (RecurrentGemma resumes
                        its RG-LRU and conv from the checkpoint of that block)
    PD pair             == colocated, TP 1 -> 1 and 2 -> 1, twice: the second round's prompts
                        extend the first's, so both workers resume from their caches
    colocated TP = 2    == TP = 1 (LFM3: query heads and the attention gate split, KV heads
                        split; RecurrentGemma: query and KV heads, the RG-LRU's gate blocks)
    speculative verify  == plain decoding at every acceptance count (RecurrentGemma: its conv
                        window and LRU state kept after each drafted position)

Greedy, fp32; tokens and their logprobs compared (1e-4).
"""

from __future__ import annotations

import pytest
import zmq

from baton import LLM, SamplingParams
from baton.disagg.decode import DecodeWorker
from baton.disagg.prefill import PrefillWorker
from baton.disagg.tp_transfer import SECRET_ENV, connector_spec
from baton.engine.core.engine import Engine
from tests.same_outputs import assert_same_outputs
from tests.spec_helpers import scripted_llm
from tests.test_gdn_serving import (
    ARGS,
    assert_same_runs,
    disagg_config,
    prompts,
    run,
    run_pair,
)

SECRET = "window-s3cret"
# windows of 10: every paged kind is windowed; lfm3_mixed: a window of 16 beside full attention
RELEASING = ["lfm3_sliding", "rgemma_local", "lfm3_mixed"]


@pytest.mark.parametrize("name", RELEASING)
def test_prefix_cache_on_matches_off_with_hits_on_blocks_closed_after_a_release(
    window_models, name
):
    model_dir, hf = window_models(name)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    first = prompts(hf.config.vocab_size, 1, (60,))[0]
    off = LLM(model_dir, **ARGS, enable_prefix_caching=False)
    on = LLM(model_dir, **ARGS, cpu_padded_decode=True)
    (want,) = off.generate([first], greedy)
    (got,) = on.generate([first], greedy)  # its decode crosses 64: block 0 closes there
    assert_same_outputs([got], [want])
    (block,) = on.engine.prefix_cache.blocks.values()
    tables = on.engine.state_spec.page_tables
    released = block.pages.count(0)
    # the pages behind the window were given back before the block closed at 64: the last
    # step before it fed position 63 and read back to 54 (window 10), so pages 0..12
    # (positions 0..51) went; or, beside full attention, to 48 (window 16): the sliding
    # table's pages 0..11, the full table's all kept
    assert released == (12 if tables == 2 else 13)
    assert len(block.pages) == 16 * tables  # 64 positions in pages of 4, each table's
    if tables == 2:
        assert all(block.pages[0::2])  # the full table's
    items = [first + got.token_ids[:8] + p for p in prompts(hf.config.vocab_size, 2, (3, 9))]
    outs = on.generate(items, greedy)
    assert [o.num_cached_tokens for o in outs] == [64, 64]
    assert_same_outputs(outs, off.generate(items, greedy))
    for llm in (on, off):
        stats = llm.stats()
        assert stats.kv_pages_used == 0 and stats.mamba_slots_used == 0


@pytest.fixture(scope="module")
def workers(window_models):
    """(model, role, tp size) -> its worker, built on first use."""
    patch = pytest.MonkeyPatch()
    patch.setenv(SECRET_ENV, SECRET)
    context = zmq.Context()
    built: dict[tuple[str, str, int], PrefillWorker | DecodeWorker] = {}

    def get(name: str, role: str, size: int):
        if (name, role, size) not in built:
            model_dir, _ = window_models(name)
            engine = Engine(
                model_dir,
                tensor_parallel_size=size,
                handover_connector=connector_spec(role, "127.0.0.1"),
                **ARGS,
            )
            cls = PrefillWorker if role == "prefill" else DecodeWorker
            built[name, role, size] = cls(engine, disagg_config(role), context)
        return built[name, role, size]

    yield get
    for worker in built.values():
        worker.close()
        worker.engine.close()
    patch.undo()


@pytest.fixture(scope="module")
def colocated(window_models):
    """model -> (first round's prompts, second round's, what a colocated TP=1 engine answers to
    each), computed on first use."""
    done = {}

    def get(name: str):
        if name not in done:
            model_dir, hf = window_models(name)
            items = prompts(hf.config.vocab_size, 3, (9, 70, 131))
            again = [p + [7, 8, 9] for p in items]
            engine = Engine(model_dir, **ARGS, enable_prefix_caching=False)
            done[name] = items, again, run(engine, items), run(engine, again)
        return done[name]

    return get


@pytest.mark.parametrize("name", RELEASING)
@pytest.mark.parametrize("sizes", [(1, 1), (2, 1)])
def test_pd_pair_matches_colocated(workers, colocated, sizes, name):
    items, again, expected, expected_again = colocated(name)
    prefill, decoder = workers(name, "prefill", sizes[0]), workers(name, "decode", sizes[1])
    hits = [w.stats().prefix_cache_hit_tokens for w in (prefill, decoder)]
    assert_same_runs(run_pair(prefill, decoder, items, f"a{sizes}"), expected)
    assert_same_runs(run_pair(prefill, decoder, again, f"b{sizes}"), expected_again)
    assert all(w.stats().prefix_cache_hit_tokens > h for w, h in zip((prefill, decoder), hits))


@pytest.mark.parametrize("name", ["lfm3_mixed", "rgemma_gqa"])
def test_tensor_parallel_matches_one_rank(window_models, name):
    """Query heads, the attention gate's rows (LFM3), the RG-LRU's gate blocks (RecurrentGemma),
    conv channels and the MLP split over 2 ranks."""
    model_dir, hf = window_models(name)
    items = prompts(hf.config.vocab_size, 4, (11, 80))
    expected = run(Engine(model_dir, **ARGS), items)
    engine = Engine(model_dir, tensor_parallel_size=2, **ARGS)
    try:
        assert_same_runs(run(engine, items), expected)
    finally:
        engine.close()


@pytest.mark.parametrize("name", ["rgemma_local", "lfm3_mixed"])
def test_speculative_verify_keeps_plain_outputs_at_every_acceptance_count(window_models, name):
    """A scripted drafter (tests/spec_helpers.py) makes every acceptance count from 0 to k
    happen: the RG-LRU keeps its window and state after each drafted position in that
    position's slot, windowed attention reads the verify rows (LFM3: over its own page table,
    beside full attention's); greedy output and its logprobs are plain decoding's."""
    model_dir, hf = window_models(name)
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    items = prompts(hf.config.vocab_size, 6, (9, 50, 61))
    want = LLM(model_dir, **ARGS).generate(items, greedy)
    reference = {tuple(p): o.token_ids for p, o in zip(items, want)}
    spec = scripted_llm(model_dir, reference, 2, **ARGS)
    assert_same_outputs(spec.generate(items, greedy), want)
    stats = spec.stats()
    assert all(n > 0 for n in stats.spec_decode_num_accepted_tokens_per_pos)
    assert stats.kv_pages_used == 0 and stats.mamba_slots_used == 0
