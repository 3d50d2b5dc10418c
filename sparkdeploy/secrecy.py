"""Which recipe values are secret, and the one way they are shown: `***`.

A secret is the value of `--api-key`, of an env variable one of whose words (the name split at
`_`, `-` and `.`, any case) is or ends in TOKEN, SECRET, KEY or PASSWORD (VLLM_API_KEY, HF_TOKEN,
OPENAI_APIKEY, ...; not TOKENIZERS_PARALLELISM or VLLM_MAX_TOKENS, whose values the operators
need to read), or of one the recipe lists in `secret_env`. The plan carries secrets as `Secret`
(pydantic's SecretStr, shown as `***` in JSON and `**********` in repr), never as plain strings, so
printing a plan, a settings object or an error built from them shows no value. They reach a node
only through an env file written over the SSH connection's stdin (sparkdeploy.steps.boot), never
through an argv: `ps` on a node shows every process's argv to every user.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from typing import Annotated

from pydantic import PlainSerializer, SecretStr

MASK = "***"
SECRET_NAME_PARTS = ("TOKEN", "SECRET", "KEY", "PASSWORD")
_NAME_WORD_SEPARATORS = re.compile(r"[_.-]")
API_KEY_FLAG = "--api-key"
# vLLM reads the API key from this env variable when --api-key is absent
# (vllm-project/vllm, vllm/entrypoints/serve/middleware/register.py in 0.32.0:
# `args.api_key or [envs.VLLM_API_KEY]`), and guards /v1 with it as with the flag.
API_KEY_ENV = "VLLM_API_KEY"
# What docker's --env-file cannot carry (a line is one VAR=value) and a shell line would cut.
_UNSAFE_CHARS = ("\n", "\r", "\0")

Secret = Annotated[SecretStr, PlainSerializer(lambda _: MASK, return_type=str, when_used="json")]


def is_secret_name(name: str, marked: Collection[str] = ()) -> bool:
    """Whether the env variable `name` holds a secret (module docstring)."""
    words = _NAME_WORD_SEPARATORS.split(name.upper())
    return name in marked or any(word.endswith(SECRET_NAME_PARTS) for word in words)


def unsafe_value_problem(value: str) -> str | None:
    """Why `value` cannot travel in a docker env file, or None when it can."""
    if any(char in value for char in _UNSAFE_CHARS):
        return "contains a line break or NUL, which a docker env file cannot carry; remove it"
    return None


def redact(text: str, secrets: Iterable[SecretStr | None]) -> str:
    """`text` with every non-empty secret value replaced by `***`."""
    for secret in secrets:
        value = secret.get_secret_value() if secret is not None else ""
        if value:
            text = text.replace(value, MASK)
    return text
