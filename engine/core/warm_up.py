"""One short request through the executor before the engine reports ready.

The first forward of a process is the slow one: the C kernels (kernels/cpu_*.c) are compiled on
their first use when $BATON_CACHE_DIR does not hold them yet (cpu/ops.c alone takes 8-28 s on a
busy 2-core machine), a GPU compiles its Triton kernels, oneDNN and the allocator set up on their
first calls. A newcomer's first request paid all of it (13.9 s, the same request again 0.07 s).
`warm_up` runs a prefill and a few decode steps, the path every request takes, so that the
engine process pays that before it sends EngineReady (and `make install` builds the C kernels
beforehand, kernels/cpu/build.py, so that even this is quick).

It runs on a scheduler of its own over the engine's pools: the engine's scheduler, its counters,
the prefix cache and the sampler's generator never see it; its pages and slot are back in the
pools when it returns (the forward writes only the pages and the slot the request holds).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from baton.engine.core.outputs import SampledTokens
from baton.engine.core.request import Request
from baton.engine.core.sampling_params import SamplingParams
from baton.engine.core.scheduler import Scheduler

if TYPE_CHECKING:
    from baton.engine.core.engine import Engine

PROMPT_TOKENS = 8
NEW_TOKENS = 3  # the prefill's token, then two decode steps


def warm_up(engine: Engine) -> int:
    """Run the warm-up request through `engine`'s executor; returns the forwards it ran."""
    vocab = engine.model_config.vocab_size
    scheduler = Scheduler(engine.scheduler.config, engine.pages, engine.slots, engine.pool_ops)
    request = Request(
        request_id="warm-up",
        prompt_ids=[(3 + i) % vocab for i in range(PROMPT_TOKENS)],
        params=SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True),
        arrival=0,
    )
    scheduler.add(request)
    forwards = 0
    while scheduler.has_work():
        sched = scheduler.schedule()
        if sched is None:  # cannot happen with empty pools; never spin
            raise RuntimeError("warm-up request could not be scheduled")
        _, logits = engine.forward(sched)
        forwards += 1
        # greedy; the batch is this one sequence, whose sampled row is the last one
        token = int(logits[-1].argmax())
        sampled = {0: SampledTokens((token,), (None,))} if sched.logits_seqs else {}
        scheduler.update_from_output(sched, sampled, {}, {})
    return forwards
