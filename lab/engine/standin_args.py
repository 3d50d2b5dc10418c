"""`vllm serve`'s command line as far as the pipeline uses it: every flag of the seed recipes and
the common ones, with vLLM's spelling rules and its errors (argparse, exit 2).

vLLM's FlexibleArgumentParser accepts `--max_num_seqs` for `--max-num-seqs`; booleans come in
`--x/--no-x` pairs; config-object flags take JSON and report a pydantic validation error naming
the flag; plain dict flags report argparse's `invalid loads value`.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

try:
    from lab.engine.standin_log import VLLM_VERSION
except ImportError:  # copied flat into the engine image
    from standin_log import VLLM_VERSION  # type: ignore[no-redef, import-not-found]

SERVE_USAGE = "vllm serve [model_tag] [options]"
# vLLM 0.32's top-level usage: an unknown flag of `vllm serve` is reported by the top parser.
TOP_USAGE = (
    "usage: vllm [-h] [-v]\n"
    "            {chat,complete,serve,launch,bench,collect-env,download-kernels,preload,"
    "run-batch,snapshot}\n"
    "            ...\n"
)
DEFAULT_MODEL = "Qwen/Qwen3-0.6B"

# Flags whose value is one of vLLM's config dataclasses, given as JSON.
CONFIG_OBJECT_FLAGS: dict[tuple[str, ...], str] = {
    ("--compilation-config", "-cc"): "CompilationConfig",
    ("--speculative-config",): "SpeculativeConfig",
    ("--kv-transfer-config",): "KVTransferConfig",
    ("--kv-events-config",): "KVEventsConfig",
    ("--ec-transfer-config",): "ECTransferConfig",
    ("--structured-outputs-config",): "StructuredOutputsConfig",
    ("--attention-config",): "AttentionConfig",
    ("--eplb-config",): "EPLBConfig",
    ("--profiler-config",): "ProfilerConfig",
    # The DSV4.1 fork's Engram and kernel configs follow the same pattern.
    ("--engram-config",): "EngramConfig",
    ("--kernel-config",): "KernelConfig",
}

# Flags whose value is a plain JSON value (argparse type=json.loads).
JSON_FLAGS = (
    "--override-generation-config",
    "--limit-mm-per-prompt",
    "--hf-overrides",
    "--mm-processor-kwargs",
    "--model-loader-extra-config",
    "--media-io-kwargs",
    "--default-chat-template-kwargs",
    "--additional-config",
    "--allowed-origins",
    "--allowed-methods",
    "--allowed-headers",
)

STRING_FLAGS: tuple[tuple[str, ...], ...] = (
    ("--host",),
    ("--tokenizer",),
    ("--revision",),
    ("--code-revision",),
    ("--tokenizer-revision",),
    ("--tokenizer-mode",),
    ("--dtype",),
    ("--kv-cache-dtype",),
    ("--load-format",),
    ("--safetensors-load-strategy",),
    ("--download-dir",),
    ("--generation-config",),
    ("--reasoning-parser",),
    ("--tool-call-parser",),
    ("--tool-parser-plugin",),
    ("--attention-backend",),
    ("--linear-backend",),
    ("--moe-backend",),
    ("--jit-monitor-mode",),
    ("--quantization", "-q"),
    ("--chat-template",),
    ("--chat-template-content-format",),
    ("--response-role",),
    ("--uvicorn-log-level",),
    ("--root-path",),
    ("--ssl-keyfile",),
    ("--ssl-certfile",),
    ("--master-addr",),
    ("--data-parallel-address", "-dpa"),
    ("--data-parallel-backend", "-dpb"),
    ("--scheduling-policy",),
    ("--otlp-traces-endpoint",),
    ("--runner",),
    ("--convert",),
    ("--model-impl",),
    ("--logprobs-mode",),
    ("--prefix-caching-hash-algo",),
    ("--mamba-ssm-cache-dtype",),
    ("--worker-cls",),
    ("--worker-extension-cls",),
    ("--max-log-len",),
    ("--lora-dtype",),
)

INT_FLAGS: tuple[tuple[str, ...], ...] = (
    ("--port",),
    ("--tensor-parallel-size", "-tp"),
    ("--pipeline-parallel-size", "-pp"),
    ("--data-parallel-size", "-dp"),
    ("--data-parallel-size-local", "-dpl"),
    ("--data-parallel-rank", "-dpn"),
    ("--data-parallel-start-rank", "-dpr"),
    ("--data-parallel-rpc-port", "-dpp"),
    ("--decode-context-parallel-size", "-dcp"),
    ("--prefill-context-parallel-size", "-pcp"),
    ("--nnodes", "-n"),
    ("--node-rank", "-r"),
    ("--master-port",),
    ("--max-num-seqs",),
    ("--block-size",),
    ("--max-cudagraph-capture-size",),
    ("--max-logprobs",),
    ("--seed",),
    ("--max-loras",),
    ("--max-lora-rank",),
    ("--max-cpu-loras",),
    ("--max-parallel-loading-workers",),
    ("--api-server-count", "-asc"),
    ("--num-gpu-blocks-override",),
    ("--max-num-partial-prefills",),
    ("--max-long-partial-prefills",),
    ("--long-prefill-token-threshold",),
    ("--num-lookahead-slots",),
    ("--max-seq-len-to-capture",),
)

# Token counts and byte sizes also take vLLM's human-readable forms (1k = 1000, 1K = 1024).
HUMAN_INT_FLAGS = ("--max-model-len", "--max-num-batched-tokens", "--kv-cache-memory-bytes")

FLOAT_FLAGS = (
    "--gpu-memory-utilization",
    "--prefill-compute-share",
    "--swap-space",
    "--cpu-offload-gb",
)

BOOLEAN_FLAGS: tuple[tuple[str, ...], ...] = (
    ("--trust-remote-code",),
    ("--enable-chunked-prefill",),
    ("--enable-prefix-caching",),
    ("--enable-auto-tool-choice",),
    ("--async-scheduling",),
    ("--disable-custom-all-reduce",),
    ("--language-model-only",),
    ("--enforce-eager",),
    ("--enable-expert-parallel", "-ep"),
    ("--enable-eplb",),
    ("--enable-lora",),
    ("--fully-sharded-loras",),
    ("--disable-log-stats",),
    ("--enable-log-requests",),
    ("--enable-log-outputs",),
    ("--disable-fastapi-docs",),
    ("--enable-sleep-mode",),
    ("--disable-sliding-window",),
    ("--disable-cascade-attn",),
    ("--skip-tokenizer-init",),
    ("--enable-prompt-tokens-details",),
    ("--enable-force-include-usage",),
    ("--enable-server-load-tracking",),
    ("--disable-uvicorn-access-log",),
    ("--return-tokens-as-token-ids",),
    ("--enable-request-id-headers",),
    ("--disable-frontend-multiprocessing",),
    ("--enable-tokenizer-info-endpoint",),
    ("--calculate-kv-scales",),
    ("--enable-dbo",),
    ("--exclude-tools-when-tool-choice-none",),
)

DISTRIBUTED_BACKENDS = ("mp", "ray", "uni", "external_launcher")


def human_readable_int(value: str) -> int:
    """'524288', '512k' (x1000) or '512K' (x1024), as vLLM's CLI reads sizes and lengths."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT]?)", value.strip())
    if not match:
        raise ValueError(value)
    number, suffix = match.groups()
    decimal = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
    binary = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    scale = decimal.get(suffix) or binary.get(suffix) or 1
    if "." in number and suffix not in decimal:
        raise ValueError(value)
    return int(float(number) * scale)


def _config_object(class_name: str) -> Callable[[str], dict[str, Any]]:
    def parse(value: str) -> dict[str, Any]:
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(
                f"1 validation error for {class_name}\n  Invalid JSON: {exc.msg} at line "
                f"{exc.lineno} column {exc.colno} [type=json_invalid, input_value={value!r}, "
                "input_type=str]"
            ) from exc
        if not isinstance(parsed, dict):
            raise argparse.ArgumentTypeError(
                f"1 validation error for {class_name}\n  Input should be an object "
                f"[type=dataclass_type, input_value={parsed!r}, input_type={type(parsed).__name__}]"
            )
        return parsed

    return parse


def loads(value: str) -> Any:
    """json.loads under its own name, so argparse's error reads `invalid loads value`."""
    return json.loads(value)


class ServeArgumentParser(argparse.ArgumentParser):
    """`vllm serve`'s parser: underscores in long flags read as dashes, as in vLLM."""

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: None = None
    ) -> argparse.Namespace:
        raw = list(sys.argv[1:] if args is None else args)
        parsed, extras = super().parse_known_args([_dash_flag(arg) for arg in raw], namespace)
        if extras:
            # vLLM's `vllm` parser, not `vllm serve`'s, reports them (exit 2).
            sys.stderr.write(TOP_USAGE)
            self.exit(2, f"vllm: error: unrecognized arguments: {' '.join(extras)}\n")
        return parsed

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {message}\n")


def _dash_flag(arg: str) -> str:
    if not arg.startswith("--"):
        return arg
    key, sep, value = arg.partition("=")
    return key.replace("_", "-") + sep + value


def build_serve_parser() -> ServeArgumentParser:
    parser = ServeArgumentParser(prog="vllm serve", usage=SERVE_USAGE, allow_abbrev=False)
    parser.add_argument("model_tag", nargs="?", default=None)
    parser.add_argument("--model", default=None)
    parser.add_argument("--served-model-name", nargs="+", default=None)
    parser.add_argument(
        "--distributed-executor-backend", choices=DISTRIBUTED_BACKENDS, default=None
    )
    parser.add_argument("--headless", action="store_true")
    for flags in STRING_FLAGS:
        parser.add_argument(*flags, default=None)
    for flags in INT_FLAGS:
        parser.add_argument(*flags, type=int, default=None)
    for flag in HUMAN_INT_FLAGS:
        parser.add_argument(flag, type=human_readable_int, default=None)
    for flag in FLOAT_FLAGS:
        parser.add_argument(flag, type=float, default=None)
    for flags in BOOLEAN_FLAGS:
        parser.add_argument(*flags, action=argparse.BooleanOptionalAction, default=None)
    for flags, class_name in CONFIG_OBJECT_FLAGS.items():
        parser.add_argument(*flags, type=_config_object(class_name), default=None)
    for flag in JSON_FLAGS:
        parser.add_argument(flag, type=loads, default=None)
    parser.add_argument("--logits-processors", nargs="+", default=None)
    parser.add_argument("--api-key", nargs="+", default=None)  # a list[str] field in vLLM
    parser.add_argument("--middleware", action="append", default=None)
    return parser


def parse_command_line(argv: Sequence[str]) -> argparse.Namespace:
    """`vllm ARGV`: only the `serve` subcommand exists here; anything else errors as vLLM does."""
    if argv and argv[0] in ("-v", "--version"):
        print(VLLM_VERSION)
        raise SystemExit(0)
    if not argv or argv[0] != "serve":
        top = argparse.ArgumentParser(prog="vllm", usage="vllm [-h] [-v] {serve} ...")
        chosen = argv[0] if argv else None
        top.error(
            "the following arguments are required: subparser"
            if chosen is None
            else f"argument subparser: invalid choice: {chosen!r} (choose from 'serve')"
        )
    parser = build_serve_parser()
    args = parser.parse_args(argv[1:])
    if args.model_tag and args.model and args.model_tag != args.model:
        parser.error(
            f"the model is given twice: positional {args.model_tag!r} and --model "
            f"{args.model!r}; give it once, as the positional model_tag"
        )
    args.model = args.model_tag or args.model or DEFAULT_MODEL
    return args


# vLLM 0.32 logs these as "***" (redact_sensitive_args in
# vllm/entrypoints/serve/utils/api_utils.py).
SENSITIVE_ARGS = frozenset({"api_key", "hf_token", "watermark_config"})


def non_default_args(args: argparse.Namespace) -> dict[str, Any]:
    """What vLLM logs as `non-default args: {...}` at startup."""
    return {
        key: "***" if key in SENSITIVE_ARGS else value
        for key, value in vars(args).items()
        if value not in (None, False) and key != "model_tag"
    }
