"""The async HTTP client of one SGLang server, and the errors it raises.

Every call names the endpoint; every failure says which endpoint, which status (or that
the server did not answer in time, or answered something that is not the JSON SGLang
sends), and what the server said. Knows nothing about generation, weights or Ray: it posts
JSON and returns parsed JSON.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

__all__ = ["SGLangHTTP", "SGLangHTTPError", "SGLangRequestRejected"]


class SGLangHTTPError(RuntimeError):
    """The server failed a call: a 5xx, a 4xx on a control endpoint, a body that is not
    what SGLang sends, a timeout or a refused connection. `status` is the HTTP status, or
    None when no response came."""

    def __init__(self, endpoint: str, status: int | None, detail: str) -> None:
        self.endpoint = endpoint
        self.status = status
        self.detail = detail
        what = f"HTTP {status}" if status is not None else "no response"
        super().__init__(f"SGLang {endpoint}: {what}: {detail}")


class SGLangRequestRejected(SGLangHTTPError, ValueError):
    """SGLang refused a generate request as invalid (a 4xx from `/generate`): the request's
    fault, not the replica's."""


def _message(body: bytes) -> str:
    """SGLang's error bodies are {"error": {"message": ...}} or {"message": ...} or text."""
    text = body.decode("utf-8", "replace").strip()
    try:
        data = json.loads(text)
    except ValueError:
        return text[:500] or "(empty body)"
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])[:500]
        if "message" in data:
            return str(data["message"])[:500]
    return text[:500]


class SGLangHTTP:
    """One `httpx.AsyncClient` on `base_url`, created on first use (so the object can be
    built outside an event loop). `timeout_s` bounds every call; `generate` calls may run
    longer (`generate_timeout_s`, None: no bound)."""

    def __init__(
        self, base_url: str, *, timeout_s: float = 60.0, generate_timeout_s: float | None = None
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.generate_timeout_s = generate_timeout_s
        self._client: httpx.AsyncClient | None = None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            # No connection cap: every in-flight generate holds one connection.
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
            self._client = httpx.AsyncClient(
                base_url=self.base_url, timeout=self.timeout_s, limits=limits
            )
        return self._client

    async def call(
        self,
        endpoint: str,
        payload: dict[str, Any] | None = None,
        *,
        method: str = "POST",
        timeout_s: float | None = -1.0,
        expect_json: bool = True,
        rejected_is_request_error: bool = False,
    ) -> Any:
        """`method endpoint` with `payload` as JSON; returns the parsed body (None when
        `expect_json` is False). `timeout_s=-1` means the client's default."""
        timeout = self.timeout_s if timeout_s == -1.0 else timeout_s
        try:
            r = await self._http().request(method, endpoint, json=payload, timeout=timeout)
        except httpx.TimeoutException as e:
            raise SGLangHTTPError(
                endpoint, None, f"no answer within {timeout}s ({type(e).__name__})"
            ) from e
        except httpx.HTTPError as e:
            raise SGLangHTTPError(endpoint, None, f"{type(e).__name__}: {e}") from e
        if r.status_code >= 400:
            cls = (
                SGLangRequestRejected
                if rejected_is_request_error and 400 <= r.status_code < 500
                else SGLangHTTPError
            )
            raise cls(endpoint, r.status_code, _message(r.content))
        if not expect_json:
            return None
        try:
            return r.json()
        except ValueError as e:
            raise SGLangHTTPError(
                endpoint, r.status_code, f"malformed body (not JSON): {r.text[:200]!r}"
            ) from e

    async def get_ok(self, endpoint: str, timeout_s: float | None = -1.0) -> None:
        """GET `endpoint` and require a 2xx (health checks)."""
        await self.call(endpoint, method="GET", timeout_s=timeout_s, expect_json=False)

    async def aclose(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()
