"""Which recipe values are secret, and the one way they are shown: `***`.

A secret is the value of a secret flag (is_secret_flag: `--api-key`, `--hf-token`, the flags
vLLM's own log redaction masks, and any flag whose last word is or ends in TOKEN, SECRET, KEY or
PASSWORD), of an env variable one of whose words (the name split at
`_`, `-` and `.`, any case) is or ends in TOKEN, SECRET, KEY or PASSWORD (VLLM_API_KEY, HF_TOKEN,
OPENAI_APIKEY, ...; not TOKENIZERS_PARALLELISM or VLLM_MAX_TOKENS, whose values the operators
need to read), or of one the recipe lists in `secret_env`. The plan carries secrets as `Secret`
(pydantic's SecretStr, shown as `***` in JSON and `**********` in repr), never as plain strings, so
printing a plan, a settings object or an error built from them shows no value. They reach a node
only through an env file written over the SSH connection's stdin (sparkdeploy.steps.boot), never
through an argv: `ps` on a node shows every process's argv to every user. So the plan passes a
secret flag's value as the env variable vLLM reads in its place (FLAG_ENV), and a recipe may set
no other secret flag with a value (sparkdeploy.spec.recipe_loading refuses it).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import re
from collections.abc import Collection, Iterable, Mapping
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
HF_TOKEN_FLAG = "--hf-token"
# vLLM's --hf-token defaults to None, and then huggingface_hub reads HF_TOKEN from the env
# (huggingface_hub/utils/_auth.py, get_token); vLLM does not redact hf_token in its
# "non-default args" log line, so the flag would put the token in the engine's log as well as
# in `ps`.
HF_TOKEN_ENV = "HF_TOKEN"
# The secret flags vLLM reads from an env variable too: the plan passes the value that way.
FLAG_ENV = {API_KEY_FLAG: API_KEY_ENV, HF_TOKEN_FLAG: HF_TOKEN_ENV}
# vLLM's own list of flags whose values it never logs (vllm-project/vllm,
# vllm/entrypoints/utils.py: `SENSITIVE_ARGS = {"vault_token", "api_key"}`).
VLLM_SENSITIVE_FLAGS = frozenset({"--vault-token", API_KEY_FLAG})
# What docker's --env-file cannot carry (a line is one VAR=value) and a shell line would cut.
_UNSAFE_CHARS = ("\n", "\r", "\0")

Secret = Annotated[SecretStr, PlainSerializer(lambda _: MASK, return_type=str, when_used="json")]


def is_secret_name(name: str, marked: Collection[str] = ()) -> bool:
    """Whether the env variable `name` holds a secret (module docstring)."""
    words = _NAME_WORD_SEPARATORS.split(name.upper())
    return name in marked or any(word.endswith(SECRET_NAME_PARTS) for word in words)


def is_secret_flag(flag: str) -> bool:
    """Whether vLLM flag `flag` (any spelling vLLM reads: `--hf_token`, `--hf-token=...`) takes
    a secret: a flag of FLAG_ENV or VLLM_SENSITIVE_FLAGS, or one whose last word is or ends in
    TOKEN, SECRET, KEY or PASSWORD (`--db-password`; not `--max-num-batched-tokens` or
    `--ssl-keyfile`, whose values are figures and paths)."""
    name = flag.partition("=")[0].replace("_", "-").lower()
    last_word = name.rsplit("-", 1)[-1].upper()
    return name in FLAG_ENV or name in VLLM_SENSITIVE_FLAGS or last_word.endswith(SECRET_NAME_PARTS)


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


def keyed_digest(values: Mapping[str, SecretStr], key: bytes) -> str:
    """HMAC-SHA256 under `key` of the named secret values (in name order), 32 hex digits: it
    changes when any value does, and tells nothing of one to whoever lacks the key. An unkeyed
    hash of a short token or password on a container label could be tested against guesses
    offline by anyone who can `docker inspect` on the node."""
    named = {name: secret.get_secret_value() for name, secret in values.items()}
    message = json.dumps(named, sort_keys=True).encode()
    return hmac.new(key, message, hashlib.sha256).hexdigest()[:32]
