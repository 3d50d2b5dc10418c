"""vLLM's OpenAI-compatible HTTP API, as far as the pipeline's gate and smoke test use it.

GET /health (200, 503 once the engine died), /v1/models, /version, /load, /metrics, /ping;
POST /v1/chat/completions (plain and SSE streaming with a usage chunk) and /v1/completions.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import socketserver
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

try:
    from lab.engine import standin_answers as answers
    from lab.engine.standin_log import VLLM_VERSION, Logger
except ImportError:  # copied flat into the engine image
    import standin_answers as answers  # type: ignore[no-redef]
    from standin_log import VLLM_VERSION, Logger  # type: ignore[no-redef]

LONG_PROMPT_TOKENS = 64
# vLLM 0.32's default buckets (vllm/v1/metrics/loggers.py, histogram_buckets; as a real engine
# exports them in tests/fixtures/vllm-0.32-cpu/metrics.txt).
TTFT_BUCKETS: tuple[float, ...] = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5)
TTFT_BUCKETS += (0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS: tuple[float, ...] = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5)
ITL_BUCKETS += (0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS: tuple[float, ...] = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0)
E2E_BUCKETS += (30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
GUARDED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")  # vLLM 0.32's, behind an API key
# Cap on generated tokens when a request sets no max_tokens (a loop must end somewhere).
DEFAULT_MAX_TOKENS = 512


@dataclass(frozen=True)
class ServingConfig:
    served_names: tuple[str, ...]
    model: str
    max_model_len: int
    reasoning_parser: str | None
    tool_call_parser: str | None
    auto_tool_choice: bool
    api_keys: tuple[str, ...]  # empty: /v1 is open
    block_size: int
    kv_cache_tokens: int
    token_delay_s: float
    prefix_caching: bool = True  # vLLM V1's default; --no-enable-prefix-caching turns it off


@dataclass(frozen=True)
class OutputFaults:
    """Which silent output failures the engine shows (STANDIN_FAULT)."""

    token_loop: bool = False
    garbled: bool = False
    empty_content: bool = False
    bad_after: int | None = None
    hang_long_prompt: bool = False


@dataclass
class Histogram:
    """A Prometheus histogram: one count per bucket (not cumulative here), sum, count."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0

    def observe(self, value: float) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)
        index = next((i for i, le in enumerate(self.bounds) if value <= le), len(self.bounds))
        self.counts[index] += 1
        self.total += value

    def lines(self, name: str, labels: str) -> list[str]:
        counts = self.counts or [0] * (len(self.bounds) + 1)
        cumulative = 0
        out = []
        for le, count in zip((*(f"{b}" for b in self.bounds), "+Inf"), counts, strict=True):
            cumulative += count
            out.append(f'{name}_bucket{{{labels},le="{le}"}} {float(cumulative)}')
        out.append(f"{name}_count{{{labels}}} {float(cumulative)}")
        out.append(f"{name}_sum{{{labels}}} {self.total}")
        return out


@dataclass
class PrefixCache:
    """Full blocks of prompt tokens seen before, as vLLM's prefix cache hashes them (a block's
    hash chains its predecessor's), least recently used first out."""

    block_size: int
    capacity_blocks: int
    blocks: OrderedDict[int, None] = field(default_factory=OrderedDict)

    def lookup(self, prompt_tokens: list[str]) -> int:
        """Tokens of the prompt found cached (whole leading blocks; never the last token, which
        the engine computes anyway); the prompt's blocks are cached afterwards."""
        hits, parent, cached = 0, 0, True
        full = (len(prompt_tokens) - 1) // self.block_size
        for index in range(full):
            block = prompt_tokens[index * self.block_size : (index + 1) * self.block_size]
            parent = hash((parent, *block))
            if cached and parent in self.blocks:
                hits += self.block_size
                self.blocks.move_to_end(parent)
            else:
                cached = False
                self.blocks[parent] = None
                if len(self.blocks) > self.capacity_blocks:
                    self.blocks.popitem(last=False)
        return hits


@dataclass
class EngineState:
    config: ServingConfig
    faults: OutputFaults
    started: float = field(default_factory=time.time)
    dead: bool = False
    requests: int = 0
    running: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    finished: dict[str, int] = field(default_factory=dict)
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    prefix_cache: PrefixCache | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.config.prefix_caching and self.prefix_cache is None:
            blocks = max(1, self.config.kv_cache_tokens // self.config.block_size)
            self.prefix_cache = PrefixCache(self.config.block_size, blocks)


class ApiError(Exception):
    def __init__(self, status: int, kind: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.param = status, kind, message, param

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.status,
            }
        }


@dataclass(frozen=True)
class Generation:
    """One request's output before it is put in an OpenAI response."""

    content: str | None
    reasoning: str
    tool_name: str | None
    tool_arguments: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(part.get("text", "")) for part in content if isinstance(part, Mapping))
    return ""


def generate(
    state: EngineState,
    body: Mapping[str, Any],
    prompt_text: str,
    prompt_tokens: int,
    request_number: int,
) -> Generation:
    """The model's output for a request, the fault switches applied."""
    config, faults = state.config, state.faults
    requested = body.get("max_completion_tokens") or body.get("max_tokens")
    budget = (
        int(requested)
        if requested
        else min(DEFAULT_MAX_TOKENS, max(1, config.max_model_len - prompt_tokens))
    )
    template_kwargs = body.get("chat_template_kwargs") or {}
    thinking = answers.reasoning(
        prompt_text, answers.reasoning_budget(config.reasoning_parser, template_kwargs)
    )
    thinking_tokens = answers.tokens(thinking)[:budget]
    thinking = "".join(thinking_tokens).strip()
    budget_left = budget - len(thinking_tokens)

    tools = body.get("tools") or []
    tool_choice = body.get("tool_choice", "auto" if tools else "none")
    if tools and tool_choice != "none":
        if tool_choice == "auto" and not (config.auto_tool_choice and config.tool_call_parser):
            raise ApiError(400, "BadRequestError", answers.TOOL_CHOICE_NEEDS_FLAGS)
        function = answers.choose_tool(tools, tool_choice, prompt_text)
        arguments = answers.tool_arguments(function, prompt_text)
        return Generation(
            None,
            thinking,
            str(function.get("name")),
            arguments,
            "tool_calls",
            prompt_tokens,
            len(thinking_tokens) + answers.count_tokens(arguments) + 2,
        )

    bad = faults.garbled or (faults.bad_after is not None and request_number > faults.bad_after)
    if faults.token_loop:
        text = answers.token_loop(budget_left)
    elif faults.empty_content:
        text = ""
    else:
        text = answers.answer(prompt_text)
        if bad:
            text = answers.garble(text)
    if body.get("ignore_eos"):
        # vLLM's sampling extra: generate until max_tokens, past the end of the answer
        text = answers.past_eos(text, budget_left)
    pieces = answers.tokens(text)
    finish = "stop"
    if len(pieces) > budget_left:
        pieces, finish = pieces[: max(budget_left, 0)], "length"
    content = "".join(pieces).strip() if pieces or not thinking_tokens else None
    return Generation(
        content, thinking, None, "", finish, prompt_tokens, len(thinking_tokens) + len(pieces)
    )


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
            self._send_text(200, self._metrics(), "text/plain; version=0.0.4; charset=utf-8")
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

    def _metrics(self) -> str:
        state, config = self.state, self.state.config
        label = f'engine="0",model_name="{config.served_names[0]}"'
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{label}}} {float(state.running)}",
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{label}}} 0.0",
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{label}}} 0.0",
            "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of "
            "queried tokens.",
            "# TYPE vllm:prefix_cache_queries_total counter",
            f"vllm:prefix_cache_queries_total{{{label}}} {float(state.prefix_cache_queries)}",
            "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached "
            "tokens.",
            "# TYPE vllm:prefix_cache_hits_total counter",
            f"vllm:prefix_cache_hits_total{{{label}}} {float(state.prefix_cache_hits)}",
            "# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.",
            "# TYPE vllm:num_preemptions_total counter",
            f"vllm:num_preemptions_total{{{label}}} 0.0",  # the stand-in never runs out of KV
            "# HELP vllm:prompt_tokens_total Number of prefill tokens processed.",
            "# TYPE vllm:prompt_tokens_total counter",
            f"vllm:prompt_tokens_total{{{label}}} {float(state.prompt_tokens)}",
            "# HELP vllm:generation_tokens_total Number of generation tokens processed.",
            "# TYPE vllm:generation_tokens_total counter",
            f"vllm:generation_tokens_total{{{label}}} {float(state.generation_tokens)}",
            "# HELP vllm:request_success_total Count of successfully processed requests.",
            "# TYPE vllm:request_success_total counter",
        ]
        for reason in ("stop", "length", "tool_calls"):
            count = float(state.finished.get(reason, 0))
            lines.append(
                f'vllm:request_success_total{{{label},finished_reason="{reason}"}} {count}'
            )
        for name, help_text, histogram in (
            (
                "vllm:time_to_first_token_seconds",
                "Histogram of time to first token in seconds.",
                state.ttft,
            ),
            (
                "vllm:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds.",
                state.itl,
            ),
            (
                "vllm:e2e_request_latency_seconds",
                "Histogram of e2e request latency in seconds.",
                state.e2e,
            ),
        ):
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram"]
            with state.lock:
                lines += histogram.lines(name, label)
        lines += [
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig",
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="{config.block_size}",engine="0",'
            f'num_gpu_blocks="{config.kv_cache_tokens // config.block_size}"}} 1.0',
        ]
        return "\n".join(lines) + "\n"

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
        if state.dead:
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
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise ApiError(400, "BadRequestError", "messages: Field required", "messages")
            texts = [_text(m.get("content")) for m in messages if isinstance(m, Mapping)]
            users = [
                _text(m.get("content"))
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
                    *answers.tokens(_text(message.get("content"))),
                    "<|end|>",
                )
            ] + ["<|assistant|>", "<|message|>"]
        else:
            prompt_text = _text(body.get("prompt"))
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
        generation = generate(state, body, prompt_text, prompt_tokens, number)
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
            self._send_json(200, _response(chat, request_id, str(model), generation, config))
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
        for event, carries_token in _stream_events(
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


def _usage(generation: Generation) -> dict[str, int]:
    return {
        "prompt_tokens": generation.prompt_tokens,
        "completion_tokens": generation.completion_tokens,
        "total_tokens": generation.prompt_tokens + generation.completion_tokens,
    }


def _tool_call(request_id: str, generation: Generation) -> dict[str, Any]:
    return {
        "id": f"chatcmpl-tool-{request_id[:16]}",
        "type": "function",
        "function": {"name": generation.tool_name, "arguments": generation.tool_arguments},
    }


def _response(
    chat: bool, request_id: str, model: str, generation: Generation, config: ServingConfig
) -> dict[str, Any]:
    created = int(time.time())
    if not chat:
        return {
            "id": f"cmpl-{request_id}",
            "object": "text_completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "text": generation.content or "",
                    "logprobs": None,
                    "finish_reason": generation.finish_reason,
                }
            ],
            "usage": _usage(generation),
        }
    message: dict[str, Any] = {"role": "assistant", "content": generation.content}
    if config.reasoning_parser is not None:
        thinking = generation.reasoning or None
        message["reasoning"] = thinking
        message["reasoning_content"] = thinking
    message["tool_calls"] = (
        [_tool_call(request_id, generation)] if generation.tool_name is not None else []
    )
    return {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": generation.finish_reason,
                "stop_reason": None,
            }
        ],
        "usage": _usage(generation),
    }


def _stream_events(
    chat: bool,
    request_id: str,
    model: str,
    generation: Generation,
    config: ServingConfig,
    include_usage: bool,
) -> Iterator[tuple[str, bool]]:
    """The SSE events' data, each with whether it carries a generated token."""
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"
    prefix = "chatcmpl" if chat else "cmpl"

    def chunk(choice: dict[str, Any] | None, usage: dict[str, int] | None = None) -> str:
        event: dict[str, Any] = {
            "id": f"{prefix}-{request_id}",
            "object": kind,
            "created": created,
            "model": model,
            "choices": [] if choice is None else [choice],
        }
        if usage is not None:
            event["usage"] = usage
        return json.dumps(event)

    def delta(fields: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        if not chat:
            return {
                "index": 0,
                "text": fields.get("content", ""),
                "logprobs": None,
                "finish_reason": finish,
            }
        return {"index": 0, "delta": fields, "logprobs": None, "finish_reason": finish}

    if chat:
        yield chunk(delta({"role": "assistant", "content": ""})), False
        for piece in answers.tokens(generation.reasoning):
            yield chunk(delta({"reasoning": piece, "reasoning_content": piece})), True
    if generation.tool_name is not None:
        call = _tool_call(request_id, generation)
        call["function"]["arguments"] = ""
        yield chunk(delta({"tool_calls": [{"index": 0, **call}]})), True
        arguments = {"arguments": generation.tool_arguments}
        yield chunk(delta({"tool_calls": [{"index": 0, "function": arguments}]})), True
    for piece in answers.tokens(generation.content or ""):
        yield chunk(delta({"content": piece})), True
    yield chunk(delta({}, generation.finish_reason)), False
    if include_usage:
        yield chunk(None, _usage(generation)), False
    yield "[DONE]", False
