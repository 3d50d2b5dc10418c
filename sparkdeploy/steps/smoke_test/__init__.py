"""The smoke test: does the endpoint answer, and answer well?

One module per job:
  checks.py     run_smoke(): the requests in their order, each reply's check
  prompts.py    what it asks and the answers it must get (the lab's chat model learns them)
  image.py      the picture it shows an engine that takes images, drawn as a PNG here
  detectors.py  token loops, garbled text, a copy with changes: pure functions of a text
  client.py     the HTTP chat client (chat, chat_stream) and its Reply
  report.py     the checks' verdict and the error naming the failed ones
"""

from sparkdeploy.steps.smoke_test.checks import run_smoke
from sparkdeploy.steps.smoke_test.client import (
    Reply,
    SmokeSettings,
    StreamedReply,
    chat,
    chat_stream,
)
from sparkdeploy.steps.smoke_test.detectors import FUNCTION_WORDS
from sparkdeploy.steps.smoke_test.prompts import CANARIES, COPY_PROMPT, COPY_SENTENCE
from sparkdeploy.steps.smoke_test.report import SmokeCheck, SmokeReport

__all__ = [
    "CANARIES",
    "COPY_PROMPT",
    "COPY_SENTENCE",
    "FUNCTION_WORDS",
    "Reply",
    "SmokeCheck",
    "SmokeReport",
    "SmokeSettings",
    "StreamedReply",
    "chat",
    "chat_stream",
    "run_smoke",
]
