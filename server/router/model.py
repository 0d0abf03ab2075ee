"""The model behind the router: one for all of its workers, and its tokenizer for cache_aware.

    a worker's /disagg/info is read (its model: name, config and tokenizer digests)
      ├─> another model than the router's other workers serve: refused, naming both (it stays
      │   out of rotation; GET /workers shows why; POST /workers answers 409)
      └─> the same model, or the first: cache_aware, no --tokenizer, and this model's tokenizer
          not known yet -> learned from this worker in the background (GET /disagg/tokenizer,
          bounded, its digest checked against the announced one, loaded in a thread); the
          worker is put in rotation once the router has it, so the first requests are matched
          in tokens as every later one is

"The router's model" is the one its current workers (not draining, /disagg/info read) serve:
when every one of them has gone, the next worker's model becomes it, so an upgrade to another
model works by replacing the workers. `--tokenizer DIR` overrides what is learned (the router
then tokenizes with it and fetches nothing; the workers are still compared with each other).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable

import httpx

from baton.server.router.answers import TOKENIZER_BODY_BYTES, BadAnswer, get, parse_json
from baton.server.router.info import ModelIdentity
from baton.server.tokenizer import Tokenizer
from baton.server.tokenizer_bundle import TokenizerBundle

logger = logging.getLogger("baton.router")


def model_conflict(
    url: str, model: ModelIdentity, others: Iterable[tuple[str, ModelIdentity]]
) -> str | None:
    """Why the worker at `url` serving `model` cannot join workers serving `others` (their
    URLs and models), or None when it can."""
    for other_url, other in others:
        if other != model:
            return (
                f"worker {url} serves model {model}, but the router's worker {other_url} serves "
                f"{other}: one router serves one model (run a router per model)"
            )
    return None


async def read_tokenizer(client: httpx.AsyncClient, url: str) -> TokenizerBundle:
    """The worker's tokenizer files, read within TOKENIZER_BODY_BYTES and checked (ValueError
    naming what is wrong, or httpx.HTTPError)."""
    what = "/disagg/tokenizer"
    answer = await get(client, f"{url}{what}", TOKENIZER_BODY_BYTES, what)
    if answer.status != 200:
        raise BadAnswer(f"{what} answered {answer.status}")
    return TokenizerBundle.from_json(await parse_json(answer.body, what))


class RouterTokenizer:
    """The tokenizer prompts are matched with: --tokenizer's, else the one learned from a
    worker of the router's model. None where no policy reads tokens."""

    def __init__(self, needs_tokens: bool, override: Tokenizer | None) -> None:
        self.needs_tokens = needs_tokens
        self.override = override
        self._learned: tuple[str, Tokenizer] | None = None  # (tokenizer digest, tokenizer)
        self._learning: dict[str, asyncio.Task] = {}  # tokenizer digest -> its fetch

    @property
    def current(self) -> Tokenizer | None:
        if not self.needs_tokens:
            return None
        return self.override or (self._learned[1] if self._learned is not None else None)

    def has(self, model: ModelIdentity) -> bool:
        """Whether requests to a worker of `model` can be matched in tokens now (or need not)."""
        return (
            not self.needs_tokens
            or self.override is not None
            or (self._learned is not None and self._learned[0] == model.tokenizer_digest)
        )

    def learn(self, url: str, model: ModelIdentity, client: httpx.AsyncClient) -> asyncio.Task:
        """Learn `model`'s tokenizer from the worker at `url` in the background, unless that is
        under way already (its task either way); a failure is logged and the worker's next probe
        tries again."""
        digest = model.tokenizer_digest
        if digest not in self._learning:
            task = asyncio.ensure_future(self._learn(url, model, client))
            self._learning[digest] = task
            task.add_done_callback(lambda _: self._learning.pop(digest, None))
        return self._learning[digest]

    async def _learn(self, url: str, model: ModelIdentity, client: httpx.AsyncClient) -> None:
        try:
            bundle = await read_tokenizer(client, url)
            if bundle.digest != model.tokenizer_digest:
                raise ValueError(
                    f"its files hash to {bundle.digest[:12]}, not to the "
                    f"{model.tokenizer_digest[:12]} its /disagg/info announced"
                )
            tokenizer = await asyncio.to_thread(bundle.load)
        except Exception as error:  # a worker's answer: anything may be wrong with it
            logger.warning(
                "cannot learn the tokenizer of model %s from worker %s: %s", model, url, error
            )
            return
        self._learned = (model.tokenizer_digest, tokenizer)
        logger.info("learned the tokenizer of model %s from worker %s", model, url)

    async def close(self) -> None:
        tasks = list(self._learning.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
