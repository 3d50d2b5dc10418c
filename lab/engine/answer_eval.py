"""The lab's external quality eval (docs/quality.md, "The external contract"): asks the endpoint
multiplication questions and scores the percent it answers right, from real requests.

    python3 lab/engine/answer_eval.py --base-url URL --model NAME [--json-file PATH] [-n N]

Prints `{"score": ..., "samples": ...}` on stdout (and writes it to --json-file when given);
the API key comes from env OPENAI_API_KEY. Exit 0 once scored, 2 when the endpoint cannot be
asked. Standard library only: it runs on the ops host, and in the stand-in image (which holds
lab/engine/, flat in /opt/standin) as an image eval on the head node.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import urllib.error
import urllib.request

REQUEST_TIMEOUT_S = 60.0


def questions(count: int) -> list[tuple[str, int]]:
    """`count` multiplication questions, the same ones every run."""
    pairs = [(12 + 7 * index, 31 + 11 * index) for index in range(count)]
    return [(f"What is {a}*{b}? Answer with the number only.", a * b) for a, b in pairs]


def ask(base_url: str, model: str, api_key: str, prompt: str) -> str:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": 2048,  # room for a reasoning parser's thinking before the answer
    }
    request = urllib.request.Request(
        base_url.rstrip("/") + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"},
    )
    with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
        reply = json.load(response)
    return str(reply["choices"][0]["message"].get("content") or "")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--json-file")
    parser.add_argument("-n", "--questions", type=int, default=8)
    args = parser.parse_args(argv)
    api_key = os.environ.get("OPENAI_API_KEY", "EMPTY")
    right = 0
    asked = questions(args.questions)
    for index, (prompt, expected) in enumerate(asked, start=1):
        try:
            content = ask(args.base_url, args.model, api_key, prompt)
        except (OSError, urllib.error.URLError, ValueError, KeyError) as error:
            print(f"question {index}: {type(error).__name__}: {error}", file=sys.stderr)
            return 2
        found = [int(number) for number in re.findall(r"-?\d+", content.replace(",", ""))]
        right += expected in found
        print(f"question {index}: expected {expected}, got {content!r}", file=sys.stderr)
    result = json.dumps({"score": 100 * right / len(asked), "samples": len(asked)})
    if args.json_file:
        with open(args.json_file, "w") as file:
            file.write(result + "\n")
    print(result)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
