"""Prompts from data: JSONL and Parquet files, Hugging Face datasets, chat messages, a held-out eval set,
and how any prompt becomes token ids.

    task, eval_examples = build_task_and_eval(config)   # what GRPOTrainer does with an RLConfig

A record's prompt column holds a string or a list of chat messages ({"role", "content"}); its answer
column the reference answer (any JSON value; missing -> None); every other column travels to the reward
functions (`Example.meta`). Parquet needs `pyarrow` and Hugging Face datasets need `datasets`; both are
optional and imported only when used.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from detinfer.rl.tasks import Example, Task, generated_eval_examples, get_task

FILE_SUFFIXES = (".jsonl", ".parquet")


def load_records(source: str, *, config_name: str | None = None, split: str = "train") -> list[dict]:
    """Rows of a *.jsonl / *.parquet file, or of split `split` of Hugging Face dataset `source`."""
    suffix = Path(source).suffix.lower()
    if suffix in FILE_SUFFIXES:
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"dataset file {source} not found")
        return _read_jsonl(path) if suffix == ".jsonl" else _read_parquet(path)
    try:
        import datasets
    except ImportError:
        raise ImportError(f"dataset {source!r} is not a *.jsonl or *.parquet file, so it is read as a Hugging "
                          "Face dataset, which needs the `datasets` package: pip install datasets") from None
    try:
        ds = datasets.load_dataset(source, config_name, split=split)
    except Exception as e:  # noqa: BLE001 - datasets raises many types; report them as one clear error
        raise ValueError(f"cannot load Hugging Face dataset {source!r} (config {config_name!r}, split "
                         f"{split!r}): {type(e).__name__}: {e}") from None
    return [dict(row) for row in ds]


def _read_jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{n}: each line must be a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


def _read_parquet(path: Path) -> list[dict]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(f"reading {path} needs the `pyarrow` package: pip install pyarrow") from None
    return pq.read_table(path).to_pylist()


def _check_messages(messages: Any, where: str) -> tuple[dict, ...]:
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise ValueError(f"{where}: chat messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: message {i} must be {{'role': str, 'content': str}}, got {m!r}")
        out.append(dict(m))
    return tuple(out)


def records_to_examples(records: Sequence[Mapping], prompt_column: str, answer_column: str,
                        source: str = "dataset") -> list[Example]:
    """Examples from rows: the prompt column (text or messages), the answer column, the rest as meta."""
    out = []
    for i, row in enumerate(records):
        where = f"{source} row {i}"
        if prompt_column not in row:
            raise ValueError(f"{where}: no column {prompt_column!r} (prompt_column); columns: {sorted(row)}")
        prompt = row[prompt_column]
        if not isinstance(prompt, str):
            prompt = _check_messages(prompt, where)
        elif not prompt:
            raise ValueError(f"{where}: empty prompt")
        meta = {k: v for k, v in row.items() if k not in (prompt_column, answer_column)}
        out.append(Example(prompt, row.get(answer_column), meta))
    return out


def _source_name(source: str) -> str:
    return Path(source).name if Path(source).suffix.lower() in FILE_SUFFIXES else source


def build_task_and_eval(config, task: Task | None = None) -> tuple[Task, list[Example]]:
    """The run's task (a given Task, config.dataset's examples, or the built-in config.task) and its eval
    examples (config.eval_dataset, else eval_size held out of the dataset / generated)."""
    eval_examples: list[Example] = []
    if task is None and config.dataset is not None:
        rows = load_records(config.dataset, config_name=config.dataset_config, split=config.dataset_split)
        examples = records_to_examples(rows, config.prompt_column, config.answer_column, _source_name(config.dataset))
        if config.eval_dataset is None and config.eval_size:
            if config.eval_size >= len(examples):
                raise ValueError(f"eval_size={config.eval_size} leaves no training examples of the "
                                 f"{len(examples)} in {config.dataset}")
            order = list(range(len(examples)))
            random.Random(f"detinfer-rl/holdout/{config.seed}").shuffle(order)
            held = set(order[:config.eval_size])
            eval_examples = [examples[i] for i in sorted(held)]
            examples = [ex for i, ex in enumerate(examples) if i not in held]
        from detinfer.rl.rewards import resolve_reward

        math_reward = resolve_reward("math", None)
        task = Task(f"dataset:{_source_name(config.dataset)}", None,
                    lambda ex, text, ids: math_reward(completions=[text], answers=[ex.answer])[0],
                    examples=tuple(examples), shuffle=config.shuffle)
    else:
        task = get_task(config.task if task is None else task)
        if config.eval_dataset is None and config.eval_size:
            if task.examples is not None:
                raise ValueError("eval_size with a Task holding examples: pass an eval_dataset instead")
            eval_examples = generated_eval_examples(task, config.seed, config.eval_size)
    if config.eval_dataset is not None:
        rows = load_records(config.eval_dataset, config_name=config.dataset_config, split=config.eval_split)
        eval_examples = records_to_examples(rows, config.prompt_column, config.answer_column,
                                            _source_name(config.eval_dataset))
        if config.eval_size:
            eval_examples = eval_examples[:config.eval_size]
    return task, eval_examples


def prompt_messages(prompt: str | tuple[dict, ...], system_prompt: str | None) -> list[dict]:
    """Chat messages of a text or messages prompt, the system prompt first unless one is there already."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    if system_prompt is not None and not (messages and messages[0]["role"] == "system"):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def encode_prompt(tokenizer, prompt, *, chat: bool = True, system_prompt: str | None = None) -> list[int]:
    """Token ids of one prompt. Token ids go as they are; chat messages, and text prompts of a chat task,
    go through the tokenizer's chat template (as the server's /v1/chat/completions does); text without a
    chat template (or of a non-chat task) is encoded as is."""
    if isinstance(prompt, tuple) and all(isinstance(t, int) for t in prompt):
        return list(prompt)
    if tokenizer is None:
        raise ValueError("this engine has no tokenizer; give prompts as token ids")
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if isinstance(prompt, str) and not (chat and has_template):
        if system_prompt is not None:
            raise ValueError("system_prompt needs the model's chat template, and this model has none (or the "
                             "task sends raw text)")
        return list(tokenizer.encode(prompt))
    if not has_template:
        raise ValueError("a prompt given as chat messages needs the model's chat template, and this model has "
                         "none (tokenizer_config.json has no chat_template)")
    return list(tokenizer.apply_chat_template(prompt_messages(prompt, system_prompt), add_generation_prompt=True,
                                              tokenize=True))
