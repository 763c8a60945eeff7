"""task.reward=module:function: a reward in TRL's reward_funcs shape for any task, checked at load in one line."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest

from es_ray.core.config import ConfigError, TaskConfig
from es_ray.runtime.validation import validate_task
from es_ray.tasks import load_task
from es_ray.tasks.base import TaskLoadError, score
from paths import REPO

REWARDS = '''
import time

def exact(completions, answer, **kwargs):
    """TRL's shape: a column by name, the rest in kwargs."""
    return [1.0 if c.strip() == a.split("####")[-1].strip() else 0.0 for c, a in zip(completions, answer)]

def length(prompts, completions, **columns):
    assert set(columns) >= {"question", "answer"}, columns
    return [float(len(c)) for c in completions]

def seen(prompts, completions, **columns):
    seen.calls.append((list(prompts), list(completions), columns))
    return [0.5] * len(completions)
seen.calls = []

def scalar(prompts, completions, **columns):
    return 1.0

def short(prompts, completions, **columns):
    return [1.0]

def boom_later(prompts, completions, **columns):
    if any(completions):
        raise RuntimeError("bug")
    return [0.0] * len(completions)

def slow_later(prompts, completions, **columns):
    if any(completions):
        time.sleep(5)
    return [0.0] * len(completions)

async def later(prompts, completions, **columns):
    return [0.0] * len(completions)

def text(prompts, completions, **columns):
    return "10"

def by_index(prompts, completions, **columns):
    return {i: 1.0 for i in range(len(completions))}

not_callable = 3
'''


@pytest.fixture()
def module(tmp_path, monkeypatch):
    name = f"my_rewards_{abs(hash(str(tmp_path)))}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(REWARDS))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


@pytest.fixture()
def data(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text(
        "".join(json.dumps({"question": f"{i} + 1?", "answer": f"#### {i + 1}", "level": i}) + "\n" for i in range(6))
    )
    return str(path)


def _task(data, reward, **kw):
    return load_task(TaskConfig(name="gsm8k", path=data, eval_size=2, reward=reward, **kw))


def test_a_trl_shaped_reward_replaces_the_tasks_reward_in_training(module, data):
    task = _task(data, f"{module}:exact")
    problems = task.train[:2]
    answers = [p.meta["row"]["answer"].split("####")[-1].strip() for p in problems]
    rewards, errors = score(task, [answers[0], "wrong"], problems)
    assert (rewards, errors) == ([1.0, 0.0], 0)
    assert task.grade("#### 0", problems[0]).score == task.reward("#### 0", problems[0])  # pass@k: the task's own


def test_the_function_gets_prompts_completions_and_every_column_of_the_row(module, data):
    task = _task(data, f"{module}:seen")
    seen = sys.modules[module].seen
    seen.calls.clear()
    score(task, ["a", "b"], task.train[:2])
    prompts, completions, columns = seen.calls[-1]
    assert completions == ["a", "b"] and prompts == [p.question for p in task.train[:2]]
    assert set(columns) == {"question", "answer", "level"}
    assert columns["level"] == [p.meta["row"]["level"] for p in task.train[:2]]


def test_a_generated_task_gives_question_and_answer(module):
    task = load_task(TaskConfig(name="arithmetic", train_size=4, eval_size=2, reward=f"{module}:length"))
    assert score(task, ["abc", "de"], task.train[:2]) == ([3.0, 2.0], 0)


@pytest.mark.parametrize(
    "fn, words",
    [
        ("scalar", "not a list of floats"),
        ("short", "returned 1 values for 2 completions"),
        ("not_callable", "not a function"),
        ("nope", "cannot import"),
        ("later", "async"),
        ("text", "returned str"),
        ("by_index", "returned dict"),
    ],
)
def test_a_reward_of_the_wrong_shape_is_refused_at_load_in_one_line(module, data, fn, words):
    with pytest.raises(TaskLoadError) as err:
        _task(data, f"{module}:{fn}")
    assert words in str(err.value) and f"task.reward='{module}:{fn}'" in str(err.value)
    assert "\n" not in str(err.value)


def test_a_reward_that_raises_or_overruns_in_training_scores_the_batch_zero_counted(module, data):
    task = _task(data, f"{module}:boom_later")
    assert score(task, ["x", "y"], task.train[:2]) == ([0.0, 0.0], 2)
    slow = _task(data, f"{module}:slow_later")
    slow.grade_timeout_s = 0.2
    assert score(slow, ["x"], slow.train[:1]) == ([0.0], 1)


@pytest.mark.parametrize("spec", ["nomodule", "a:b:c", ":f", "m:"])
def test_the_config_check_refuses_a_spec_that_is_not_module_function(spec):
    with pytest.raises(ConfigError, match="task.reward="):
        validate_task(TaskConfig(reward=spec))


def test_the_examples_in_docs_tasks_md_run(tmp_path, monkeypatch):
    """The reward and the task class docs/tasks.md shows, as written there."""
    import re

    text = (REPO / "docs" / "tasks.md").read_text()
    blocks = {m.group(1): m.group(0) for m in re.finditer(r"# my_pkg/(\w+)\.py\n.*?(?=```)", text, re.S)}
    pkg = tmp_path / "my_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name in ("rewards", "tasks"):
        (pkg / f"{name}.py").write_text(blocks[name])
    monkeypatch.syspath_prepend(str(tmp_path))
    for mod in [m for m in sys.modules if m == "my_pkg" or m.startswith("my_pkg.")]:
        monkeypatch.delitem(sys.modules, mod)
    rows = tmp_path / "capitals.jsonl"
    rows.write_text(
        "".join(
            json.dumps({"country": c, "capital": k}) + "\n"
            for c, k in [("France", "Paris"), ("Peru", "Lima"), ("Chad", "N"), ("Japan", "Tokyo")] * 3
        )
        + "not json\n"
    )
    task = load_task(TaskConfig(name="my_pkg.tasks:Capitals", path=str(rows), eval_size=2))
    assert task.skipped_lines() == [
        f"task capitals: skipped 4 of 13 rows of task.path={rows}: 3 capital too short, 1 not JSON; first at line 3"
    ]
    problem = task.train[0]
    assert task.reward(f"It is {problem.answer}.", problem) == 1.0
    gsm = tmp_path / "gsm.jsonl"
    gsm.write_text("".join(json.dumps({"question": f"{i}+1?", "answer": f"#### {i + 1}"}) + "\n" for i in range(6)))
    own = load_task(TaskConfig(name="gsm8k", path=str(gsm), eval_size=2, reward="my_pkg.rewards:exact"))
    p = own.train[0]
    assert score(own, [f"so {p.answer}", "no"], [p, p]) == ([1.0, 0.0], 0)


@pytest.mark.parametrize(
    "source, words", [("def f(:\n", "SyntaxError"), ("raise RuntimeError('at import')\n", "RuntimeError: at import")]
)
def test_a_module_that_fails_to_import_is_one_line_not_a_traceback(tmp_path, monkeypatch, data, source, words):
    (tmp_path / "broken_reward_mod.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "broken_reward_mod", raising=False)
    with pytest.raises(TaskLoadError) as err:
        _task(data, "broken_reward_mod:f")
    assert words in str(err.value) and "task.reward='broken_reward_mod:f'" in str(err.value)
    assert "\n" not in str(err.value)


def test_a_relative_module_is_refused_naming_the_key(data):
    with pytest.raises(TaskLoadError) as err:
        _task(data, ".rewards:f")
    assert "task.reward='.rewards:f'" in str(err.value) and "absolute" in str(err.value)


def test_a_module_in_the_current_directory_but_not_on_the_path_says_so(tmp_path, monkeypatch, data):
    """An installed command (es-train) does not search the current directory, where a user's rewards.py sits."""
    (tmp_path / "rewards_here_only.py").write_text(
        "def f(prompts, completions, **kw):\n    return [0.0] * len(completions)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    with pytest.raises(TaskLoadError) as err:
        _task(data, "rewards_here_only:f")
    assert "in the current directory" in str(err.value) and "PYTHONPATH=$PWD" in str(err.value)


@pytest.mark.parametrize(
    "name, words",
    [
        ("a:b:c", "is not package.module:TaskClass"),
        (":Capitals", "is not package.module:TaskClass"),
        ("broken_task_mod:Capitals", "RuntimeError: at import"),
        ("os:path", "is a module, not a Task class"),
    ],
)
def test_a_user_task_that_cannot_be_used_is_one_line(tmp_path, monkeypatch, name, words):
    """task.name=package.module:TaskClass: a malformed path, a module that raises at import or an object that is no
    Task is refused as the task.reward hook is, in one line naming the key, not a traceback."""
    (tmp_path / "broken_task_mod.py").write_text("raise RuntimeError('at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "broken_task_mod", raising=False)
    with pytest.raises(TaskLoadError) as err:
        load_task(TaskConfig(name=name))
    assert words in str(err.value) and f"task.name={name!r}" in str(err.value) and "\n" not in str(err.value)
    if name.count(":") != 1 or not all(name.split(":")):  # a malformed path is refused with the config already
        with pytest.raises(ConfigError, match=f"task.name={name!r} is not package.module:TaskClass"):
            validate_task(TaskConfig(name=name))
