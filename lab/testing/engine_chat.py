"""One user message to a deployment's OpenAI chat API, as the lab tests, the demo and bench/ ask
it (not the smoke test: sparkdeploy.steps.smoke_test has its own client and checks)."""

from __future__ import annotations

from sparkdeploy.remote.engine_http import HttpReply, request


def chat(endpoint: str, model: str, prompt: str, *, timeout_s: float, **body: object) -> HttpReply:
    """POST /v1/chat/completions with `prompt` as the one user message (`body`: more of the
    request, such as temperature); OSError (refused, reset, timed out) propagates."""
    return request(
        "POST",
        f"{endpoint}/v1/chat/completions",
        timeout=timeout_s,
        json_body={"model": model, "messages": [{"role": "user", "content": prompt}], **body},
    )


def answer_text(reply: HttpReply) -> str:
    """The text of a chat reply's first choice."""
    return str(reply.json()["choices"][0]["message"]["content"])
