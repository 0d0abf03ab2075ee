"""The eval's HTTP side: greedy completions from any OpenAI-compatible server, retried the way a
client of a busy server should (429, 503 and dropped connections, with backoff that honours
Retry-After)."""

from __future__ import annotations

import time
from typing import Literal, NamedTuple

STOP = ["Question"]


class Completion(NamedTuple):
    text: str
    completion_tokens: int
    retries: int  # attempts after the first one (429, 503 or a dropped connection)
    error: str | None  # why the request still failed after its retries; None when it answered


class Answer(NamedTuple):
    response: object | None  # the httpx.Response answered 200, or None
    retries: int
    failure: str | None


# Answers worth retrying: the server is busy (429) or has no worker for it right now (503), or the
# connection dropped. Any other status is the request's own fault and is not retried.
RETRY_STATUSES = (429, 503)
MAX_BACKOFF_S = 8.0


class OpenAIClient:
    """Greedy completions from an OpenAI-compatible server over a pooled httpx client."""

    def __init__(
        self,
        base_url: str,
        api: Literal["completions", "chat"],
        model: str | None,
        max_tokens: int,
        parallel: int,
        api_key: str | None = None,
        timeout_s: float = 600,
        retries: int = 4,
    ):
        import httpx

        root = base_url.rstrip("/")
        root = root if root.endswith("/v1") else root + "/v1"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        limits = httpx.Limits(max_connections=parallel, max_keepalive_connections=parallel)
        self.http = httpx.Client(base_url=root, headers=headers, timeout=timeout_s, limits=limits)
        self.api = api
        self.max_tokens = max_tokens
        self.retries = retries
        self.model = model or self._first_model()

    def _first_model(self) -> str:
        answer = self._request("GET", "/models")
        if answer.response is None:
            raise RuntimeError(answer.failure)
        models = answer.response.json()["data"]
        if not models:
            raise RuntimeError(f"{self.http.base_url}/models lists no model; pass --model")
        return models[0]["id"]

    def complete(self, request: str | list[dict]) -> Completion:
        """One greedy answer to a prompt (completions) or a list of messages (chat)."""
        body = {"model": self.model, "max_tokens": self.max_tokens, "temperature": 0, "stop": STOP}
        if self.api == "chat":
            body["messages"] = request
        else:
            body["prompt"] = request
        path = "/chat/completions" if self.api == "chat" else "/completions"
        answer = self._request("POST", path, body)
        if answer.response is None:
            return Completion("", 0, answer.retries, answer.failure)
        payload = answer.response.json()
        choice = payload["choices"][0]
        text = choice["message"]["content"] if self.api == "chat" else choice["text"]
        usage = payload.get("usage") or {}
        return Completion(
            text or "", int(usage.get("completion_tokens") or 0), answer.retries, None
        )

    def _request(self, method: str, path: str, body: dict | None = None) -> Answer:
        """The 200 answer to one request, retried with exponential backoff (honouring
        Retry-After) on 429, 503 and dropped connections; or why it failed."""
        import httpx

        attempt = 0
        while True:
            wait_s = min(MAX_BACKOFF_S, 0.5 * 2**attempt)
            try:
                response = self.http.request(method, path, json=body)
            except httpx.TransportError as error:
                failure = f"{self.http.base_url}{path}: {type(error).__name__}: {error}"
            else:
                if response.status_code == 200:
                    return Answer(response, attempt, None)
                text = response.text[:500]
                failure = f"{response.request.url} answered {response.status_code}: {text}"
                if response.status_code not in RETRY_STATUSES:
                    return Answer(None, attempt, failure)
                wait_s = _retry_after(response, wait_s)
            if attempt == self.retries:
                return Answer(None, attempt, failure)
            attempt += 1
            time.sleep(wait_s)

    def close(self) -> None:
        self.http.close()


def _retry_after(response, default_s: float) -> float:
    """The server's Retry-After in seconds (the delta-seconds form), else `default_s`."""
    try:
        return min(MAX_BACKOFF_S, max(0.0, float(response.headers["retry-after"])))
    except (KeyError, ValueError):
        return default_s
