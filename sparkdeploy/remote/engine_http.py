"""Plain HTTP to an engine's OpenAI-compatible API: stdlib, real timeouts, never a proxy.

http.client rather than urllib: urllib honours http_proxy from the environment, and a proxy
between the flow host and a node's fabric address would make every probe lie. An engine started
with an API key (the plan's api_key) answers /v1 with 401 unless the request carries it as
`Authorization: Bearer KEY`; the key stays a SecretStr up to the header.

The probes ask whether an engine serves: `probe_endpoint` (GET /health, then /v1/models listing
the served name) and `probe_completion` (one token of COMPLETION_PROMPT); like `scrape_metrics`
they answer with what they found, never an exception.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from pydantic import SecretStr

from sparkdeploy.vllm.metrics import EngineMetrics, parse_metrics


@dataclass(frozen=True)
class HttpReply:
    status: int
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def _connection(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str]:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"not an http(s) URL: {url!r}")
    connection_class = (
        http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    )
    connection = connection_class(parts.hostname, parts.port, timeout=timeout)
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return connection, path


def _auth(api_key: SecretStr | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key.get_secret_value()}"} if api_key else {}


def request(
    method: str,
    url: str,
    *,
    timeout: float,
    json_body: Any | None = None,
    api_key: SecretStr | None = None,
) -> HttpReply:
    """One request; OSError (refused, reset, timed out) and HTTPException propagate."""
    connection, path = _connection(url, timeout)
    try:
        body = None if json_body is None else json.dumps(json_body).encode()
        headers = _auth(api_key)
        if body is not None:
            headers["Content-Type"] = "application/json"
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        return HttpReply(response.status, response.read())
    finally:
        connection.close()


class KeepAlive:
    """Requests to one engine over one HTTP/1.1 connection kept open between them: a probe
    every few seconds then costs no TCP handshake (nor the server a new socket). Not
    thread-safe: one caller at a time."""

    def __init__(self, base_url: str, *, timeout: float) -> None:
        self._base_url = base_url.rstrip("/")
        self._timeout = timeout
        self._connection: http.client.HTTPConnection | None = None

    def request(
        self,
        method: str,
        path: str,
        *,
        json_body: Any | None = None,
        api_key: SecretStr | None = None,
    ) -> HttpReply:
        """One request; OSError and HTTPException propagate. A kept connection the server
        closed while idle (its keep-alive timeout) fails the first write or read: then it is
        sent once more on a new connection, and only then (a new one failing is the answer)."""
        reused = self._connection is not None
        try:
            return self._send(method, path, json_body, api_key)
        except (ConnectionError, http.client.RemoteDisconnected, http.client.CannotSendRequest):
            self.close()
            if not reused:
                raise
            return self._send(method, path, json_body, api_key)
        except (OSError, http.client.HTTPException):
            self.close()
            raise

    def _send(
        self, method: str, path: str, json_body: Any | None, api_key: SecretStr | None
    ) -> HttpReply:
        # A new HTTPConnection object does not connect until its first request: cheap.
        fresh, target = _connection(self._base_url + path, self._timeout)
        if self._connection is None:
            self._connection = fresh
        body = None if json_body is None else json.dumps(json_body).encode()
        headers = _auth(api_key)
        if body is not None:
            headers["Content-Type"] = "application/json"
        self._connection.request(method, target, body=body, headers=headers)
        response = self._connection.getresponse()
        reply = HttpReply(response.status, response.read())
        if response.will_close:
            self.close()
        return reply

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()
            self._connection = None


def stream_events(
    url: str, json_body: Any, *, timeout: float, api_key: SecretStr | None = None
) -> Iterator[tuple[float, dict[str, Any]]]:
    """POST and yield (monotonic arrival time, event) for each server-sent `data:` JSON event.

    `timeout` bounds every socket read and the whole stream. A non-200 reply raises
    http.client.HTTPException with the status and the start of the body.
    """
    deadline = time.monotonic() + timeout
    connection, path = _connection(url, timeout)
    try:
        connection.request(
            "POST",
            path,
            body=json.dumps(json_body).encode(),
            headers={
                **_auth(api_key),
                "Content-Type": "application/json",
                "Accept": "text/event-stream",
            },
        )
        response = connection.getresponse()
        if response.status != 200:
            raise http.client.HTTPException(
                f"HTTP {response.status} from {url}: {response.read(500)!r}"
            )
        while True:
            if time.monotonic() > deadline:
                raise TimeoutError(f"stream from {url} still open after {timeout} s")
            raw = response.readline()
            if not raw:
                return
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[len(b"data:") :].strip()
            if data == b"[DONE]":
                return
            yield time.monotonic(), json.loads(data)
    finally:
        connection.close()


SCRAPE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Scrape:
    metrics: EngineMetrics | None
    error: str | None = None  # why there are no metrics (refused, HTTP status)


def scrape_metrics(base_url: str, *, timeout: float = SCRAPE_TIMEOUT_S) -> Scrape:
    """GET /metrics (open even where /v1 needs an API key, as in vLLM 0.32's
    AuthenticationMiddleware); a failure is a Scrape with its error, never an exception."""
    url = base_url.rstrip("/") + "/metrics"
    try:
        reply = request("GET", url, timeout=timeout)
    except (OSError, http.client.HTTPException) as error:
        return Scrape(None, f"GET {url}: {type(error).__name__}: {error}")
    if reply.status != 200:
        return Scrape(None, f"GET {url}: HTTP {reply.status}")
    return Scrape(parse_metrics(reply.body.decode(errors="replace")))


@dataclass(frozen=True)
class ProbeOutcome:
    ready: bool
    detail: str
    served_names: list[str] | None = None  # what /v1/models listed, once it answered


def probe_endpoint(
    endpoint: str, served_model_name: str, *, timeout: float, api_key: SecretStr | None = None
) -> ProbeOutcome:
    """GET /health, then GET /v1/models (with the API key: vLLM guards /v1, never /health);
    ready when the served name is listed."""
    base = endpoint.rstrip("/")
    try:
        health = request("GET", f"{base}/health", timeout=timeout)
        if health.status != 200:
            return ProbeOutcome(False, f"/health answered {health.status}")
        models = request("GET", f"{base}/v1/models", timeout=timeout, api_key=api_key)
    except ConnectionRefusedError:
        return ProbeOutcome(False, "connection refused (the engine is still loading)")
    except (OSError, http.client.HTTPException) as error:
        return ProbeOutcome(False, f"{type(error).__name__}: {error}")
    if models.status == 401:
        # Not ready will never turn ready: say which key is missing or wrong.
        return ProbeOutcome(
            False,
            "/v1/models answered 401: the engine wants an API key "
            + ("other than the recipe's" if api_key else "and the recipe sets none")
            + " (--api-key in args or env.VLLM_API_KEY)",
        )
    if models.status != 200:
        return ProbeOutcome(False, f"/v1/models answered {models.status}")
    try:
        names = [str(entry["id"]) for entry in models.json()["data"]]
    except (ValueError, KeyError, TypeError) as error:
        return ProbeOutcome(False, f"/v1/models is not an OpenAI model list ({error})")
    return ProbeOutcome(served_model_name in names, f"/v1/models lists {names}", names)


COMPLETION_PROMPT = "Hello"


def probe_completion(
    endpoint: str, served_model_name: str, *, timeout: float, api_key: SecretStr | None = None
) -> ProbeOutcome:
    """POST /v1/completions for one token at temperature 0; ready when it answers a choice.

    The first request to a TP > 1 CPU engine builds a kernel (about 20 s): `timeout` should be
    generous, and this is asked once, not polled.
    """
    body = {
        "model": served_model_name,
        "prompt": COMPLETION_PROMPT,
        "max_tokens": 1,
        "temperature": 0,
    }
    url = f"{endpoint.rstrip('/')}/v1/completions"
    try:
        reply = request("POST", url, timeout=timeout, json_body=body, api_key=api_key)
    except (OSError, http.client.HTTPException) as error:
        return ProbeOutcome(False, f"POST /v1/completions: {type(error).__name__}: {error}")
    if reply.status != 200:
        text = reply.body[:300].decode(errors="replace")
        return ProbeOutcome(False, f"POST /v1/completions answered {reply.status}: {text}")
    try:
        choices = reply.json()["choices"]
    except (ValueError, KeyError, TypeError) as error:
        return ProbeOutcome(False, f"POST /v1/completions: not a completion ({error})")
    if not choices:
        return ProbeOutcome(False, "POST /v1/completions answered no choice")
    return ProbeOutcome(True, "POST /v1/completions answered a choice")
