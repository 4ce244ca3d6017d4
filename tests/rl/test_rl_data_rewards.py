"""Data, rewards and the math verifier without a model: JSONL / Parquet / Hugging Face loading, chat
prompts through a chat template, seeded epochs and the held-out eval split, weighted reward functions
with per-sample failure isolation, numeric answer extraction and the word-problem generator."""

import json
import random
import shutil
import sys
import types

import pytest
from hypothesis import given
from hypothesis import strategies as st

from detinfer.rl.config import RLConfig
from detinfer.rl.data import build_task_and_eval, encode_prompt, load_records, prompt_messages, records_to_examples
from detinfer.rl.math_task import answers_match, extract_answer, has_answer_format
from detinfer.rl.rewards import RewardModel, overlong_punishment, parse_reward_config
from detinfer.rl.tasks import TASKS, Example, Task, dataset_indices, examples_for_step

ROWS = [{"prompt": f"Q{i}: what is {i} + {i}?", "answer": 2 * i, "level": i % 3} for i in range(7)]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# -- loading ---------------------------------------------------------------------------------------

def test_jsonl_rows_become_examples_with_meta(tmp_path):
    rows = ROWS + [{"prompt": [{"role": "user", "content": "hi"}], "answer": None}]
    recs = load_records(str(_jsonl(tmp_path / "d.jsonl", rows)))
    assert recs == rows
    exs = records_to_examples(recs, "prompt", "answer")
    assert exs[3] == Example("Q3: what is 3 + 3?", 6, {"level": 0})
    assert exs[-1].prompt == ({"role": "user", "content": "hi"},)


def test_jsonl_errors_name_the_line_and_column(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        load_records(str(bad))
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        load_records(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match=r"row 0: no column 'question' \(prompt_column\)"):
        records_to_examples(ROWS, "question", "answer")
    with pytest.raises(ValueError, match="message 0 must be"):
        records_to_examples([{"prompt": [{"role": "user"}]}], "prompt", "answer")


def test_parquet_round_trip(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), path)
    assert load_records(str(path)) == ROWS


def test_parquet_without_pyarrow_names_the_package(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1")
    with pytest.raises(ImportError, match="needs the `pyarrow` package: pip install pyarrow"):
        load_records(str(path))


def test_hugging_face_dataset_name_split_and_columns(monkeypatch):
    calls = []

    def load_dataset(name, config_name, split):
        calls.append((name, config_name, split))
        return [{"question": "2+2?", "solution": "two and two #### 4", "id": 9}]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    config = RLConfig(dataset="org/gsm", dataset_config="main", dataset_split="train[:1]", prompt_column="question",
                      answer_column="solution", eval_dataset="org/gsm", eval_split="test")
    task, eval_examples = build_task_and_eval(config)
    assert calls == [("org/gsm", "main", "train[:1]"), ("org/gsm", "main", "test")]
    assert task.name == "dataset:org/gsm" and task.examples[0] == Example("2+2?", "two and two #### 4", {"id": 9})
    assert task.reward(task.examples[0], "so 4", ()) == 1.0  # a dataset's own reward: the math verifier
    assert len(eval_examples) == 1
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ImportError, match="needs the `datasets` package: pip install datasets"):
        load_records("org/gsm")


def test_eval_split_is_held_out_of_the_dataset(tmp_path):
    path = str(_jsonl(tmp_path / "d.jsonl", ROWS))
    task, held = build_task_and_eval(RLConfig(dataset=path, eval_size=2, eval_every=1, seed=3))
    assert len(held) == 2 and len(task.examples) == 5
    assert sorted(e.prompt for e in held + list(task.examples)) == sorted(r["prompt"] for r in ROWS)
    again, held_again = build_task_and_eval(RLConfig(dataset=path, eval_size=2, seed=3))
    assert held_again == held and again.examples == task.examples  # a function of the seed
    with pytest.raises(ValueError, match="eval_size=7 leaves no training examples"):
        build_task_and_eval(RLConfig(dataset=path, eval_size=7))
    _, generated = build_task_and_eval(RLConfig(task="math", eval_size=3))
    assert len(generated) == 3 and generated == build_task_and_eval(RLConfig(task="math", eval_size=3))[1]


@given(st.integers(1, 12), st.integers(1, 7), st.integers(0, 5), st.booleans())
def test_dataset_epochs_visit_every_example_once(size, count, seed, shuffle):
    steps = 3 * size  # whole epochs: 3 * count of them
    flat = [i for s in range(steps) for i in dataset_indices(size, seed, s, count, shuffle)]
    for epoch in range(len(flat) // size):
        part = flat[epoch * size:(epoch + 1) * size]
        assert sorted(part) == list(range(size))
        if not shuffle:
            assert part == list(range(size))
    assert dataset_indices(size, seed, 4, count, shuffle) == dataset_indices(size, seed, 4, count, shuffle)


def test_dataset_task_draws_by_step():
    exs = tuple(Example(f"p{i}") for i in range(5))
    task = Task("d", None, lambda ex, t, ids: 0.0, examples=exs)
    assert examples_for_step(task, 0, 1, 2) == [exs[i] for i in dataset_indices(5, 0, 1, 2)]
    assert examples_for_step(task, 0, 0, 5) != examples_for_step(task, 1, 0, 5)  # seeded order
    with pytest.raises(ValueError, match="exactly one of make_example"):
        Task("d", None, lambda ex, t, ids: 0.0)


# -- prompts through the chat template ----------------------------------------------------------------

@pytest.fixture
def chat_tokenizer(stories_dir, tmp_path):
    from detinfer.models.tokenizer import Tokenizer

    d = tmp_path / "tok"
    d.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(stories_dir / name, d / name)
    (d / "chat_template.jinja").write_text(
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}"
        "<assistant>{% endif %}")
    return Tokenizer.from_dir(d)


def test_chat_prompts_and_system_prompt_go_through_the_template(chat_tokenizer):
    ids = encode_prompt(chat_tokenizer, "Hi there", system_prompt="Be brief.")
    assert ids == chat_tokenizer.encode("<system>Be brief.\n<user>Hi there\n<assistant>", add_special_tokens=False)
    msgs = ({"role": "system", "content": "Own."}, {"role": "user", "content": "Yo"})
    assert prompt_messages(msgs, "Be brief.") == list(msgs)  # a prompt's own system message wins
    assert encode_prompt(chat_tokenizer, msgs) == chat_tokenizer.encode("<system>Own.\n<user>Yo\n<assistant>",
                                                                        add_special_tokens=False)
    assert encode_prompt(chat_tokenizer, "raw", chat=False) == chat_tokenizer.encode("raw")
    assert encode_prompt(chat_tokenizer, (5, 6, 7)) == [5, 6, 7]


def test_chat_prompts_without_a_template_are_refused(stories_dir):
    from detinfer.models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(stories_dir)  # stories260k has no chat template
    assert encode_prompt(tok, "Once upon") == tok.encode("Once upon")
    with pytest.raises(ValueError, match="system_prompt needs the model's chat template"):
        encode_prompt(tok, "Once upon", system_prompt="Be brief.")
    with pytest.raises(ValueError, match="chat messages needs the model's chat template"):
        encode_prompt(tok, ({"role": "user", "content": "x"},))


# -- rewards ----------------------------------------------------------------------------------------

def _batch(texts, answers, **columns):
    exs = [Example("p", a) for a in answers]
    return {"prompts": ["p"] * len(texts), "completions": texts, "answers": answers,
            "completion_ids": [[1]] * len(texts), "examples": exs, **columns}


def test_reward_config_parsing():
    assert parse_reward_config(None, None) == [("task", 1.0)]
    assert parse_reward_config("math, format,pkg.mod:fn", "1,0.2,-0.5") == [
        ("math", 1.0), ("format", 0.2), ("pkg.mod:fn", -0.5)]
    for funcs, weights, match in (("math,nope", None, "'nope' is neither a built-in"),
                                  ("math,format", "1", "one weight per reward function"),
                                  ("math", "nan", "finite numbers"), ("math,math", None, "twice")):
        with pytest.raises(ValueError, match=match):
            parse_reward_config(funcs, weights)
        with pytest.raises(ValueError, match="reward_"):
            RLConfig(reward_funcs=funcs, reward_weights=weights)


def test_weighted_rewards_and_a_failing_function_scores_only_its_samples(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(
        "def picky(completions, level, **kw):\n"
        "    return [1.0 / (len(c) - 4) + lv for c, lv in zip(completions, level)]  # 4 chars: ZeroDivision\n"
        "def wrong_length(completions, **kw):\n"
        "    return [1.0]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    model = RewardModel(parse_reward_config("math,format,my_rewards:picky", "1,0.5,2"), TASKS["math"])
    scores = model.score(_batch(["#### 4", "== 5", "boxed \\boxed{9}"], [4, 4, 9], level=[1, 2, 0]))
    assert scores.per_func["math"] == [1.0, 0.0, 1.0]
    assert scores.per_func["format"] == [1.0, 0.0, 1.0]
    picky = scores.per_func["my_rewards:picky"]
    assert picky[1] != picky[1] and picky[0] == 1.0 / 2 + 1 and picky[2] == 1.0 / 11  # sample 1 failed
    assert scores.failures == {"math": 0, "format": 0, "my_rewards:picky": 1}
    assert scores.failed_samples == 1 and "ZeroDivisionError" in scores.first_error
    assert scores.total == [1 + 0.5 + 2 * 1.5, 0.0, 1 + 0.5 + 2 / 11]  # the failed sample: 0 from picky
    broken = RewardModel(parse_reward_config("my_rewards:wrong_length", None), None)
    assert broken.score(_batch(["a", "b"], [1, 2])).failures == {"my_rewards:wrong_length": 0}  # 1 per call: fine
    with pytest.raises(ImportError, match="cannot import module 'no_such_module'"):
        RewardModel([("no_such_module:f", 1.0)], None)
    with pytest.raises(ValueError, match="no callable 'nope'"):
        RewardModel([("my_rewards:nope", 1.0)], None)


def test_task_reward_and_non_finite_values_fail_per_sample():
    task = Task("t", lambda rng: Example("p"), lambda ex, text, ids: float("nan") if text == "x" else 1.0)
    scores = RewardModel([("task", 1.0)], task).score(_batch(["a", "x", "b"], [None] * 3))
    assert scores.total == [1.0, 0.0, 1.0] and scores.failures == {"task": 1}
    assert "finite" in scores.first_error


def test_overlong_punishment():
    assert [overlong_punishment(n, 10, 4, 1.0) for n in (5, 6, 7, 8, 10)] == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_punishment(10, 10, 0, 1.0) == 0.0


# -- the math verifier --------------------------------------------------------------------------------

@pytest.mark.parametrize("text,value", [
    ("The answer is 42.", 42), ("so \\boxed{1,234} and 7", 1234), ("#### 72\nthen 5 more", 72),
    ("\\boxed{\\frac{3}{4}}", 0.75), ("\\boxed{-3/4}", -0.75), ("costs $5.50", 5.5), ("-3 apples", -3),
    ("\\boxed{x = 12}", 12), ("12 then \\boxed{{7}}", 7), ("no number", None), ("\\boxed{12", 12)])
def test_extract_answer_forms(text, value):
    assert extract_answer(text) == value


@given(st.integers(-10**7, 10**7), st.integers(0, 999), st.sampled_from(["boxed", "hashes", "last"]))
def test_extract_answer_finds_the_marked_number(n, distractor, form):
    body = f"{n:,}" if n % 2 else str(n)
    text = {"boxed": f"first {distractor}, so \\boxed{{{body}}} (not {distractor})",
            "hashes": f"{distractor} steps later\n#### {body}",
            "last": f"after {distractor} tries it is {body}"}[form]
    assert extract_answer(text) == n and answers_match(text, n) and answers_match(text, f"... #### {n}")
    assert has_answer_format(text) == (form != "last")


def test_word_problems_are_seeded_and_verifiable():
    make = TASKS["math"].make_example
    a = [make(random.Random(s)) for s in range(40)]
    assert a == [make(random.Random(s)) for s in range(40)]
    assert len({ex.prompt for ex in a}) == 40
    for ex in a:
        assert isinstance(ex.answer, int) and ex.answer >= 0 and "####" in ex.prompt
        assert TASKS["math"].reward(ex, f"Step by step... #### {ex.answer}", ()) == 1.0
        assert TASKS["math"].reward(ex, f"#### {ex.answer + 1}", ()) == 0.0
