"""The benchmark client's own cost (sparkdeploy.steps.benchmark): CPU per streamed request, against
a bare reader of the same streams measured in the same run, and the share of one core the
client uses at the highest level (the check the benchmark prints: under CLIENT_BOUND_CORES the
client is not what limits the figures).

The engine is the stand-in on loopback with a short delay per chunk, so requests come as fast
as this machine serves them: the client's hardest case. The bare reader sends the same requests
and reads the bytes without parsing them: no client can do less.

    .venv/bin/python -m bench.benchmark_client [--requests 64] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

from lab.testing.standin_process import SERVED, local_standin
from sparkdeploy.steps.benchmark import CLIENT_BOUND_CORES, BenchmarkSettings, run_benchmark
from sparkdeploy.steps.benchmark_requests import synthetic_prompt
from sparkdeploy.steps.smoke_test import SmokeSettings

OUTPUT_TOKENS = 64
INPUT_TOKENS = 256
DELAY_S = "0.002"


def bare_request(endpoint: str, prompt: str) -> float:
    """CPU seconds of this thread to send one streamed request and read its bytes unparsed."""
    started = time.thread_time()
    parts = urlsplit(endpoint)
    connection = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=60)
    body = {
        "model": SERVED,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": OUTPUT_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        connection.request("POST", "/v1/chat/completions", json.dumps(body).encode())
        response = connection.getresponse()
        while response.read(65536):
            pass
    finally:
        connection.close()
    return time.thread_time() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    options = parser.parse_args()
    settings = BenchmarkSettings(
        concurrency=[options.concurrency],
        input_tokens=INPUT_TOKENS,
        output_tokens=OUTPUT_TOKENS,
        requests_per_level=options.requests,
        repeats=3,
        decode_depths=[],
    )
    with local_standin(env={"STANDIN_DECODE_DELAY_S": DELAY_S}) as endpoint:
        result = run_benchmark(SmokeSettings(endpoint, SERVED), settings)
        words = result.prompt.words
        with ThreadPoolExecutor(max_workers=options.concurrency) as pool:
            bare = list(
                pool.map(
                    lambda index: bare_request(endpoint, synthetic_prompt(words, index)),
                    range(options.requests),
                )
            )
    figures = result.figures()[options.concurrency]
    ours_ms = figures["client_cpu_ms_per_request"].value
    bare_ms = 1000 * statistics.fmean(bare)
    check = result.client_check
    print(
        f"{options.requests} streamed requests of {OUTPUT_TOKENS} tokens at concurrency "
        f"{options.concurrency}, stand-in at {DELAY_S} s per chunk, "
        f"{figures['output_tok_s'].value:.0f} output tok/s"
    )
    print(f"client CPU per request: {ours_ms:.2f} ms; bare reader: {bare_ms:.2f} ms")
    print(f"ratio client / bare reader: {ours_ms / bare_ms:.2f}")
    print(
        f"share of one core at concurrency {check.concurrency}: {check.cores:.3f} "
        f"(bound {CLIENT_BOUND_CORES}): "
        + ("the client may be the bottleneck" if check.client_bound else "not the bottleneck")
    )


if __name__ == "__main__":
    main()
