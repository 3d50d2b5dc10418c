"""vLLM's OpenAI-compatible HTTP API, as far as the pipeline's gate and smoke test use it.

GET /health (200, 503 once the engine died), /v1/models, /version, /load, /metrics, /ping;
POST /v1/chat/completions (plain and SSE streaming with a usage chunk) and /v1/completions.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import socket
import socketserver
import threading
import time
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

try:
    from lab.engine import standin_answers as answers
    from lab.engine import standin_images as images
    from lab.engine.standin_completions import (
        ApiError,
        Generation,
        generate,
        message_text,
        response_body,
        stream_events,
    )
    from lab.engine.standin_log import VLLM_VERSION, Logger
    from lab.engine.standin_state import EngineState, metrics_page
except ImportError:  # copied flat into the engine image
    import standin_answers as answers  # type: ignore[no-redef, import-not-found]
    import standin_images as images  # type: ignore[no-redef, import-not-found]
    from standin_completions import (  # type: ignore[no-redef, import-not-found]
        ApiError,
        Generation,
        generate,
        message_text,
        response_body,
        stream_events,
    )
    from standin_log import VLLM_VERSION, Logger  # type: ignore[no-redef, import-not-found]
    from standin_state import EngineState, metrics_page  # type: ignore[no-redef, import-not-found]

LONG_PROMPT_TOKENS = 64
GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")  # vLLM 0.32's, behind an API key


def seen_colours(messages: list[Any], limit: int | None) -> list[str]:
    """The colour of each picture of the messages; vLLM's 400 for more pictures than the
    engine's --limit-mm-per-prompt allows (none without it), or for one that does not load."""
    urls = images.image_urls(messages)
    refusal = images.limit_refusal(len(urls), limit)
    if refusal is not None:
        raise ApiError(400, "BadRequestError", refusal)
    try:
        return [images.seen_colour(url) for url in urls]
    except ValueError as error:
        raise ApiError(400, "BadRequestError", f"Failed to load the image: {error}") from None


class StandinServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # uvicorn's listen backlog (its --backlog, default 2048), which vLLM's API server keeps;
    # socketserver's 5 resets connections when a benchmark opens many at once.
    request_queue_size = 2048

    def __init__(self, address: tuple[str, int]) -> None:
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self._state: EngineState | None = None
        # Bound now, listened on only when the engine is ready: until then every connection is
        # refused, as vLLM's API port is during loading.
        super().__init__(address, ApiHandler, bind_and_activate=False)
        self.server_bind()

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves its own name (socket.getfqdn), which stalls for
        # seconds on a node without DNS.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)

    @property
    def state(self) -> EngineState:
        assert self._state is not None, "the server listens only once it has a state"
        return self._state

    def start_listening(self, state: EngineState) -> None:
        self._state = state
        self.server_activate()
        threading.Thread(target=self.serve_forever, daemon=True).start()


class ApiHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: StandinServer

    def log_message(self, format: str, *args: Any) -> None:
        Logger("").raw(
            f'INFO:     {self.client_address[0]}:{self.client_address[1]} - "{self.requestline}" '
            f"{args[1] if len(args) > 1 else ''}"
        )

    @property
    def state(self) -> EngineState:
        return self.server.state

    def _send_json(self, status: int, body: Any) -> None:
        payload = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _send_text(self, status: int, text: str, content_type: str = "text/plain") -> None:
        payload = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def _authorized(self) -> bool:
        """vLLM's AuthenticationMiddleware (vllm/entrypoints/serve/middleware/authenticate.py,
        0.32): the guarded prefixes need `Authorization: Bearer` with one of the keys (scheme in
        any case); other paths (/health, /metrics, ...) are open."""
        keys = self.state.config.api_keys
        if not keys or not self.path.startswith(GUARDED_PREFIXES):
            return True
        scheme, _, token = (self.headers.get("Authorization") or "").partition(" ")
        digest = hashlib.sha256(token.encode()).digest()
        matched = [hmac.compare_digest(digest, hashlib.sha256(k.encode()).digest()) for k in keys]
        if scheme.lower() == "bearer" and any(matched):
            return True
        self._send_json(401, {"error": "Unauthorized"})
        return False

    def do_GET(self) -> None:
        if not self._authorized():
            return
        path = self.path.split("?", 1)[0]
        state = self.state
        if path in ("/health", "/ping"):
            self._send_text(503 if state.dead else 200, "")
        elif path == "/version":
            self._send_json(200, {"version": VLLM_VERSION})
        elif path == "/load":
            self._send_json(200, {"server_load": state.running})
        elif path == "/v1/models":
            self._send_json(200, self._models())
        elif path == "/metrics":
            self._send_text(200, metrics_page(state), "text/plain; version=0.0.4; charset=utf-8")
        else:
            self._send_json(404, {"detail": "Not Found"})

    def _models(self) -> dict[str, Any]:
        config = self.state.config
        created = int(self.state.started)
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": created,
                    "owned_by": "vllm",
                    "root": config.model,
                    "parent": None,
                    "max_model_len": config.max_model_len,
                    "permission": [],
                }
                for name in config.served_names
            ],
        }

    def do_POST(self) -> None:
        if not self._authorized():
            return
        path = self.path.split("?", 1)[0]
        if path not in ("/v1/chat/completions", "/v1/completions"):
            self._send_json(404, {"detail": "Not Found"})
            return
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        state = self.state
        with state.lock:
            state.running += 1
        try:
            self._complete(path == "/v1/chat/completions", raw)
        except ApiError as exc:
            self._send_json(exc.status, exc.body())
        except (BrokenPipeError, ConnectionResetError):
            pass
        finally:
            with state.lock:
                state.running -= 1

    def _complete(self, chat: bool, raw: bytes) -> None:
        arrived = time.monotonic()
        state, config = self.state, self.state.config
        failing = state.faults.fail_requests_when
        if state.dead or (failing is not None and os.path.exists(failing)):
            raise ApiError(
                500,
                "InternalServerError",
                "EngineCore encountered an issue. See stack trace (above) for the root cause.",
            )
        try:
            body = json.loads(raw or b"{}")
        except json.JSONDecodeError as exc:
            raise ApiError(400, "BadRequestError", f"Invalid JSON body: {exc}") from exc
        if not isinstance(body, dict):
            raise ApiError(400, "BadRequestError", "The request body must be a JSON object")
        model = body.get("model") or config.served_names[0]
        if model not in config.served_names:
            raise ApiError(404, "NotFoundError", f"The model `{model}` does not exist.", "model")
        colours: list[str] = []
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise ApiError(400, "BadRequestError", "messages: Field required", "messages")
            colours = seen_colours(messages, config.image_limit)
            texts = [message_text(m.get("content")) for m in messages if isinstance(m, Mapping)]
            users = [
                message_text(m.get("content"))
                for m in messages
                if isinstance(m, Mapping) and m.get("role") == "user"
            ]
            prompt_text = users[-1] if users else texts[-1]
            # A chat template's 4 tokens around each message and 2 to open the answer.
            prompt = [
                token
                for message in messages
                if isinstance(message, Mapping)
                for token in (
                    "<|start|>",
                    str(message.get("role")),
                    "<|message|>",
                    *answers.tokens(message_text(message.get("content"))),
                    "<|end|>",
                )
            ] + ["<|assistant|>", "<|message|>"]
        else:
            prompt_text = message_text(body.get("prompt"))
            prompt = answers.tokens(prompt_text)
        prompt_tokens = len(prompt)
        if state.faults.hang_long_prompt and prompt_tokens > LONG_PROMPT_TOKENS:
            while True:
                time.sleep(3600)
        with state.lock:
            state.requests += 1
            number = state.requests
            if state.prefix_cache is not None:
                state.prefix_cache_queries += prompt_tokens
                state.prefix_cache_hits += state.prefix_cache.lookup(prompt)
        generation = generate(state, body, prompt_text, prompt_tokens, number, colours)
        with state.lock:
            state.prompt_tokens += generation.prompt_tokens
            state.generation_tokens += generation.completion_tokens
            reason = generation.finish_reason
            state.finished[reason] = state.finished.get(reason, 0) + 1
        request_id = hashlib.sha256(f"{state.started}-{number}".encode()).hexdigest()[:32]
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            self._stream(chat, request_id, str(model), generation, include_usage, arrived)
        else:
            answered = time.monotonic() - arrived
            self._send_json(200, response_body(chat, request_id, str(model), generation, config))
            with state.lock:
                state.ttft.observe(answered)
                state.e2e.observe(time.monotonic() - arrived)

    def _stream(
        self,
        chat: bool,
        request_id: str,
        model: str,
        generation: Generation,
        usage: bool,
        arrived: float,
    ) -> None:
        state = self.state
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        delay = state.config.token_delay_s
        last_token: float | None = None
        for event, carries_token in stream_events(
            chat, request_id, model, generation, state.config, usage
        ):
            data = f"data: {event}\n\n".encode()
            self.wfile.write(f"{len(data):X}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()
            if carries_token:
                # What vLLM's output processor times: the first token, the gaps after it.
                sent = time.monotonic()
                with state.lock:
                    if last_token is None:
                        state.ttft.observe(sent - arrived)
                    else:
                        state.itl.observe(sent - last_token)
                last_token = sent
            if delay:
                time.sleep(delay)
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()
        with state.lock:
            state.e2e.observe(time.monotonic() - arrived)
