"""The trainer of the lab's chat model for real vLLM: a Llama that has learned its lessons.

The smoke test (sparkdeploy.steps.smoke_test) and the quality gate's built-in evals ask fixed
questions at temperature 0 and check the answers. lab.chat_lessons pairs each of those prompts
with the one answer to teach; this module trains, deterministically on two CPU cores, a 2-layer
LlamaForCausalLM with its own byte-level BPE tokenizer to answer exactly those prompts and then
stop with EOS.

Training sees the exact token sequences the engine sees: the chat template of tokenizer_config
.json applied by transformers' tokenizer to one user message with add_generation_prompt, then
the answer and EOS; the loss is on the answer tokens only. It stops when every answer token,
EOS included, wins greedy decoding by MIN_MARGIN logits (the engine computes with other kernels
and a tensor-parallel split, so a near tie could flip), then the saved files are reloaded with
AutoTokenizer / AutoModelForCausalLM and greedy generation must give each answer then EOS.

It runs (`python -m lab.chat_trainer LESSONS_JSON OUT_DIR`) under the vLLM runtime's Python,
which has torch, transformers and tokenizers, imported where used, and not the project's
dependencies; lab.chat_model writes the lessons, runs it and caches the result.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# Tokenizer and chat format. EOS closes every turn, so the model's answer ends the same way.
EOS_TOKEN = "<|end|>"
PAD_TOKEN = "<|pad|>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, "<|system|>", "<|user|>", "<|assistant|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MAX_CONTEXT = 2048

# Model: the shape checked on vLLM 0.32 CPU. head_dim must be one the engine's attention
# supports (32 here; 16 crashes at the first request); heads divisible by 2 for TP 2.
VOCAB_SIZE = 1024
HIDDEN = 128
HEADS = 4
KV_HEADS = 4
LAYERS = 2
INTERMEDIATE = 256

# Training.
SEED = 20260
THREADS = 2  # fixed, not the machine's core count: the float sums, so the bytes, depend on it
LEARNING_RATE = 3e-3
MIN_MARGIN = 8.0  # logits by which each answer token must beat the runner-up
CHECK_EVERY = 10
# Rows go in groups of similar length, each padded to its own longest: the long prompt and the
# short questions padded to one length would cost three times the compute.
GROUP_LENGTH_RATIO = 1.5
MAX_STEPS = 3000

MODEL_FILES = (
    ".gitattributes",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "special_tokens_map.json",
    "tokenizer.json",
    "tokenizer_config.json",
)

# A few lines of plain prose beside the prompts, so the BPE vocabulary is not only them.
_EXTRA_CORPUS = (
    "The quick brown fox jumps over the lazy dog. A ship sails along the coast at night, and "
    "the sailors watch the sea, the wind and the stars. Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100.",
    "Hello! How can I help you today? Here is the answer. Thank you, that is all.",
)


@dataclass(frozen=True)
class Lesson:
    name: str
    prompt: str
    answer: str


def lessons_json(todo: Sequence[Lesson]) -> str:
    """The lessons as the trainer reads them (and the trained model's cache is keyed on)."""
    return json.dumps([asdict(lesson) for lesson in todo], indent=1) + "\n"


def read_lessons(path: Path) -> tuple[Lesson, ...]:
    return tuple(Lesson(**lesson) for lesson in json.loads(path.read_text()))


# ---------------------------------------------------------------------------------------------
# Trainer (runtime side: torch, transformers, tokenizers, safetensors; imported where used)


def train_chat_model(out_dir: Path, todo: Sequence[Lesson]) -> dict[str, Any]:
    """Train the model on `todo` and write its repo files into out_dir; returns a summary.

    Raises RuntimeError naming the lesson when the saved model, reloaded with transformers,
    does not answer its prompt exactly (then EOS) by greedy decoding.
    """
    started = time.monotonic()
    import torch
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    transformers_logging.set_verbosity_error()
    torch.manual_seed(SEED)
    torch.set_num_threads(THREADS)
    torch.use_deterministic_algorithms(True)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_tokenizer(out_dir, todo)
    tokenizer = _load_tokenizer(out_dir)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    examples = [_example(tokenizer, lesson, eos_id) for lesson in todo]
    longest = max(len(prompt) + len(answer) for prompt, answer in examples)
    if longest > MAX_CONTEXT:
        raise RuntimeError(f"a lesson is {longest} tokens, over the {MAX_CONTEXT} context")

    model = _new_model(eos_id, pad_id)
    batches = [_batch(group, pad_id) for group in _length_groups(examples)]
    answer_tokens = sum(len(answer) for _, answer in examples)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0)
    model.train()
    step, loss_value, margin = 0, float("nan"), float("-inf")
    while True:
        # One step over every example: the mean loss over all answer tokens, summed by group.
        optimizer.zero_grad(set_to_none=True)
        loss_sum, margins = 0.0, []
        for inputs, targets, attention in batches:
            logits = model(input_ids=inputs, attention_mask=attention).logits
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]),
                targets.reshape(-1),
                ignore_index=-100,
                reduction="sum",
            )
            if step % CHECK_EVERY == 0:
                margins.append(_min_margin(logits.detach(), targets))
            (loss / answer_tokens).backward()
            loss_sum += float(loss.detach())
        if margins:
            loss_value = loss_sum / answer_tokens
            margin = min(margins)
            if margin >= MIN_MARGIN:
                break
            if step >= MAX_STEPS:
                raise RuntimeError(
                    f"no convergence in {MAX_STEPS} steps: loss {loss_value:.4g}, "
                    f"smallest answer-token margin {margin:.3g} < {MIN_MARGIN}"
                )
        optimizer.step()
        step += 1

    model.eval()
    model.save_pretrained(out_dir, safe_serialization=True)
    _write_small_files(out_dir, eos_id, pad_id)
    answers = verify_chat_model(out_dir, todo)
    return {
        "steps": step,
        "loss": loss_value,
        "min_margin": round(margin, 3),
        "seconds": round(time.monotonic() - started, 1),
        "answers": answers,
        "bytes": sum((out_dir / name).stat().st_size for name in MODEL_FILES),
    }


def verify_chat_model(model_dir: Path, todo: Sequence[Lesson]) -> dict[str, str]:
    """Greedy answers of the saved model (reloaded with transformers) to every lesson's prompt.

    Raises RuntimeError naming the lesson whose answer is not exactly the taught one then EOS,
    or whose tokens win by less than MIN_MARGIN / 2.
    """
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = _load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    if tokenizer.eos_token_id != eos_id or model.generation_config.eos_token_id != eos_id:
        raise RuntimeError(f"{model_dir}: EOS is not {EOS_TOKEN} everywhere")
    answers: dict[str, str] = {}
    for lesson in todo:
        prompt, expected = _example(tokenizer, lesson, eos_id)
        tokens = list(prompt)
        generated: list[int] = []
        weakest = float("inf")
        with torch.no_grad():
            while len(generated) < len(expected) + 1:
                logits = model(input_ids=torch.tensor([tokens])).logits[0, -1]
                top = torch.topk(logits, 2)
                weakest = min(weakest, float(top.values[0] - top.values[1]))
                token = int(top.indices[0])
                generated.append(token)
                tokens.append(token)
                if token == eos_id:
                    break
        text = tokenizer.decode([t for t in generated if t != eos_id], skip_special_tokens=True)
        problem = None
        if generated != expected:
            ended = "then EOS" if generated[-1:] == [eos_id] else "without EOS"
            problem = f"greedy answer {text!r} ({ended}), expected {lesson.answer!r} then EOS"
        elif weakest < MIN_MARGIN / 2:
            problem = f"a token wins by only {weakest:.3g} logits (< {MIN_MARGIN / 2})"
        if problem:
            raise RuntimeError(f"the chat model fails the lesson {lesson.name}: {problem}")
        answers[lesson.name] = text
    return answers


def _corpus(todo: Sequence[Lesson]) -> list[str]:
    texts = [text for lesson in todo for text in (lesson.prompt, lesson.answer)]
    return [*texts, *_EXTRA_CORPUS]


def _write_tokenizer(out_dir: Path, todo: Sequence[Lesson]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(todo), trainer)
    if tokenizer.get_vocab_size() > VOCAB_SIZE:
        raise RuntimeError(f"tokenizer has {tokenizer.get_vocab_size()} tokens > {VOCAB_SIZE}")
    tokenizer.save(str(out_dir / "tokenizer.json"))
    _write_json(
        out_dir / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": EOS_TOKEN,
            "pad_token": PAD_TOKEN,
            "model_max_length": MAX_CONTEXT,
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _write_json(
        out_dir / "special_tokens_map.json", {"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN}
    )


def _load_tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _example(tokenizer: Any, lesson: Lesson, eos_id: int) -> tuple[list[int], list[int]]:
    """(prompt ids as the engine builds them, answer ids then EOS)."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": lesson.prompt}], tokenize=False, add_generation_prompt=True
    )
    prompt = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    answer = list(tokenizer(lesson.answer, add_special_tokens=False)["input_ids"])
    if tokenizer.decode(answer) != lesson.answer:
        raise RuntimeError(f"{lesson.name}: the tokenizer does not round-trip the answer")
    return prompt, [*answer, eos_id]


def _new_model(eos_id: int, pad_id: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HIDDEN // HEADS,
        max_position_embeddings=MAX_CONTEXT,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        torch_dtype="float32",
        attn_implementation="eager",
    )
    return LlamaForCausalLM(config)


def _length_groups(
    examples: Sequence[tuple[list[int], list[int]]],
) -> list[list[tuple[list[int], list[int]]]]:
    """The examples by length, in groups whose longest is at most GROUP_LENGTH_RATIO times
    their shortest."""

    def length(example: tuple[list[int], list[int]]) -> int:
        return len(example[0]) + len(example[1])

    groups: list[list[tuple[list[int], list[int]]]] = []
    for example in sorted(examples, key=length):
        if groups and length(example) <= GROUP_LENGTH_RATIO * length(groups[-1][0]):
            groups[-1].append(example)
        else:
            groups.append([example])
    return groups


def _batch(examples: Sequence[tuple[list[int], list[int]]], pad_id: int) -> tuple[Any, Any, Any]:
    """Right-padded inputs, next-token targets (-100 outside the answers), attention mask."""
    import torch

    length = max(len(prompt) + len(answer) for prompt, answer in examples) - 1
    inputs = torch.full((len(examples), length), pad_id, dtype=torch.long)
    targets = torch.full((len(examples), length), -100, dtype=torch.long)
    attention = torch.zeros((len(examples), length), dtype=torch.long)
    for row, (prompt, answer) in enumerate(examples):
        sequence = prompt + answer
        inputs[row, : len(sequence) - 1] = torch.tensor(sequence[:-1])
        attention[row, : len(sequence) - 1] = 1
        targets[row, len(prompt) - 1 : len(sequence) - 1] = torch.tensor(answer)
    return inputs, targets, attention


def _min_margin(logits: Any, targets: Any) -> float:
    """The smallest lead of the target token's logit over the best other, at answer positions."""
    import torch

    mask = targets != -100
    chosen = logits[mask]
    wanted = targets[mask]
    target_logit = chosen.gather(1, wanted[:, None])[:, 0]
    others = chosen.scatter(1, wanted[:, None], float("-inf"))
    return float(torch.min(target_logit - others.max(dim=1).values))


def _write_small_files(out_dir: Path, eos_id: int, pad_id: int) -> None:
    config = json.loads((out_dir / "config.json").read_text())
    config["torch_dtype"] = "float32"
    config.pop("attn_implementation", None)
    _write_json(out_dir / "config.json", config)
    # No sampling defaults: vLLM takes them from here, and the smoke sets only temperature.
    _write_json(
        out_dir / "generation_config.json", {"eos_token_id": eos_id, "pad_token_id": pad_id}
    )
    (out_dir / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")


def _write_json(path: Path, content: Any) -> None:
    path.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lab.chat_trainer",
        description="Train the lab's tiny chat model on its lessons (needs torch).",
    )
    parser.add_argument("lessons", type=Path, help="JSON: [{name, prompt, answer}, ...]")
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    try:
        summary = train_chat_model(args.out_dir, read_lessons(args.lessons))
    except RuntimeError as error:
        print(f"lab.chat_trainer: {error}", file=sys.stderr)
        return 1
    print(
        f"trained the lab chat model in {summary['seconds']} s: {summary['steps']} steps, "
        f"final loss {summary['loss']:.3g}, smallest margin {summary['min_margin']} logits, "
        f"{summary['bytes']} bytes; answers {json.dumps(summary['answers'])}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
