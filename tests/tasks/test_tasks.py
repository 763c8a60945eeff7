"""Tasks: fixed pools, rewards, and loading from local files in the hub schema (tests/fixtures/)."""

from __future__ import annotations

import itertools
import subprocess
import sys
import textwrap
from fractions import Fraction

import pytest

from es_ray.core.config import TaskConfig
from es_ray.tasks import load_task
from es_ray.tasks.arithmetic import ArithmeticTask
from es_ray.tasks.base import Problem, TaskLoadError
from es_ray.tasks.countdown import CountdownTask
from es_ray.tasks.gsm8k import GSM8KTask
from paths import FIXTURES, REPO


# -- arithmetic -------------------------------------------------------------------------------------------


def _arith(**kw) -> ArithmeticTask:
    return ArithmeticTask(TaskConfig(name="arithmetic", **kw))


def test_arithmetic_sets_have_the_configured_sizes_and_are_disjoint():
    task = _arith(train_size=40, eval_size=15, seed=3)
    assert len(task.train) == 40 and len(task.eval) == 15
    train_q = {p.question for p in task.train}
    eval_q = {p.question for p in task.eval}
    assert len(train_q) == 40 and len(eval_q) == 15  # no duplicates within a set
    assert not train_q & eval_q  # the held-out set never repeats a training problem


def test_arithmetic_is_deterministic_in_task_seed():
    a = _arith(train_size=20, eval_size=5, seed=11)
    b = _arith(train_size=20, eval_size=5, seed=11)
    c = _arith(train_size=20, eval_size=5, seed=12)
    assert [p.question for p in a.train] == [p.question for p in b.train]
    assert [p.question for p in a.eval] == [p.question for p in b.eval]
    assert [p.answer for p in a.train] == [p.answer for p in b.train]
    assert [p.question for p in a.train] != [p.question for p in c.train]


@pytest.mark.parametrize("operations,num_operands,digits", [("+-", 2, 2), ("+-*", 3, 1), ("*", 2, 3)])
def test_arithmetic_answers_follow_standard_precedence(operations, num_operands, digits):
    task = _arith(train_size=30, eval_size=10, seed=5, operations=operations, num_operands=num_operands, digits=digits)
    for p in task.train + task.eval:
        expr = p.meta["expression"]
        assert expr in p.question
        operands = [int(x) for x in expr.split() if x.isdigit()]
        assert len(operands) == num_operands
        lo = 0 if digits == 1 else 10 ** (digits - 1)
        assert all(lo <= x < 10**digits for x in operands)
        assert set(expr.split()) - {str(x) for x in operands} <= set(operations)
        assert p.answer == eval(expr, {"__builtins__": {}}), expr  # controlled input: digits and + - * only


def test_arithmetic_reward_exact_and_dense():
    task = _arith(train_size=4, eval_size=0, seed=0)
    p = Problem(question="What is 23 + 45?", answer=68)
    assert task.reward("68", p) == 1.0
    assert task.reward("23 + 45 = 68", p) == 1.0
    assert task.reward("The answer is 70.", p) == pytest.approx(0.5 * (1 - 2 / 78))
    assert task.reward("66", p) == pytest.approx(0.5 * (1 - 2 / 78))
    assert task.reward("60", p) == pytest.approx(0.5 * (1 - 8 / 78))
    # closer is better, never above 0.5 unless exact, 0 when far or when there is no number
    rewards = [task.reward(str(x), p) for x in (69, 70, 80, 100, 140)]
    assert rewards == sorted(rewards, reverse=True)
    assert all(0 < r < 0.5 for r in rewards[:-1])
    assert task.reward("1000", p) == 0.0
    assert task.reward("I am not sure", p) == 0.0
    neg = Problem(question="What is 12 - 45?", answer=-33)
    assert task.reward("-33", neg) == 1.0
    assert task.reward("33", neg) == pytest.approx(0.5 * max(0.0, 1 - 66 / 43))


def test_arithmetic_refuses_bad_operations_and_digits():
    with pytest.raises(ValueError, match="task.operations"):
        _arith(operations="+/")
    with pytest.raises(ValueError, match="task.digits"):
        _arith(digits=0)


def test_arithmetic_terminates_when_fewer_distinct_problems_exist_than_requested():
    """1-digit '+' has only 100 distinct problems; asking for 128 must stop with a TaskLoadError naming the keys
    to change, never spin."""
    code = textwrap.dedent("""
        from es_ray.core.config import TaskConfig
        from es_ray.tasks.arithmetic import ArithmeticTask
        from es_ray.tasks.base import TaskLoadError
        try:
            ArithmeticTask(TaskConfig(digits=1, operations="+", train_size=64, eval_size=64))
        except TaskLoadError as exc:  # any other exception fails the subprocess with its traceback
            print(type(exc).__name__, exc, sep=": ")
    """)
    try:  # a subprocess, so a spinning loop is killed instead of hanging the test session
        proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=5)
    except subprocess.TimeoutExpired:
        proc = None
    assert proc is not None, (
        "ArithmeticTask.load did not terminate: it loops forever when the configuration has "
        "fewer distinct problems than task.train_size + task.eval_size"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == (
        "TaskLoadError: task arithmetic: only 100 distinct problems found for digits=1, "
        "operations='+'; lower task.train_size + task.eval_size (128) or raise task.digits\n"
    )


# -- countdown --------------------------------------------------------------------------------------------


def _solve(items: list[tuple[Fraction, str]], target: int) -> str | None:
    """Any binary tree of + - * / over all the numbers (each once) reaching target; an expression or None."""
    if len(items) == 1:
        return items[0][1] if items[0][0] == target else None
    for i, j in itertools.combinations(range(len(items)), 2):
        (a, ea), (b, eb) = items[i], items[j]
        rest = [items[k] for k in range(len(items)) if k not in (i, j)]
        cands = [
            (a + b, f"({ea} + {eb})"),
            (a - b, f"({ea} - {eb})"),
            (b - a, f"({eb} - {ea})"),
            (a * b, f"({ea} * {eb})"),
        ]
        if b != 0:
            cands.append((a / b, f"({ea} / {eb})"))
        if a != 0:
            cands.append((b / a, f"({eb} / {ea})"))
        for c in cands:
            found = _solve(rest + [c], target)
            if found:
                return found
    return None


@pytest.mark.parametrize("k", [3, 4])
def test_countdown_generated_problems_are_solvable(k):
    task = CountdownTask(TaskConfig(name="countdown", train_size=8, eval_size=3, countdown_numbers=k, seed=21))
    assert len(task.train) == 8 and len(task.eval) == 3
    for p in task.train + task.eval:
        nums = p.meta["nums"]
        assert len(nums) == k and all(1 <= x <= 99 for x in nums)
        assert isinstance(p.answer, int) and 1 <= p.answer <= 1000
        assert str(p.answer) in p.question and str(nums) in p.question
        expr = _solve([(Fraction(x), str(x)) for x in nums], p.answer)
        assert expr is not None, (nums, p.answer)
        assert task.reward(f"Here it is: <answer>{expr}</answer>", p) == 1.0


def test_countdown_generation_is_deterministic_in_task_seed():
    a = CountdownTask(TaskConfig(name="countdown", train_size=6, eval_size=2, seed=4))
    b = CountdownTask(TaskConfig(name="countdown", train_size=6, eval_size=2, seed=4))
    c = CountdownTask(TaskConfig(name="countdown", train_size=6, eval_size=2, seed=5))
    key = lambda t: [(p.answer, tuple(p.meta["nums"])) for p in t.train + t.eval]  # noqa: E731
    assert key(a) == key(b)
    assert key(a) != key(c)


def test_countdown_loads_a_local_jsonl_and_skips_malformed_rows():
    path = FIXTURES / "countdown.jsonl"
    task = load_task(TaskConfig(name="countdown", path=str(path), train_size=3, eval_size=2))
    assert isinstance(task, CountdownTask)
    assert task.skipped_rows == 2  # one row without nums, one line that is not JSON
    assert [(p.answer, p.meta["nums"]) for p in task.train] == [(9, [1, 2, 3]), (20, [95, 11, 4, 1]), (24, [4, 6, 1])]
    assert [(p.answer, p.meta["nums"]) for p in task.eval] == [(10, [2, 5, 7]), (98, [44, 19, 35])]
    nine = task.train[0]
    assert task.reward("<answer>(1 + 2) * 3</answer>", nine) == 1.0
    assert task.reward("<answer>1 + 2 + 3</answer>", nine) == pytest.approx(0.1)
    assert task.reward("no idea", nine) == 0.0
    assert task.reward("<answer>(95 - 11) / 4 - 1</answer>", task.train[1]) == 1.0


# -- gsm8k ------------------------------------------------------------------------------------------------


def test_gsm8k_loads_a_local_jsonl_and_rewards_the_final_number():
    path = FIXTURES / "gsm8k.jsonl"
    task = load_task(TaskConfig(name="gsm8k", path=str(path), eval_size=1))
    assert isinstance(task, GSM8KTask)
    assert task.skipped_rows == 1  # the row without '####'
    assert len(task.eval) == 1 and len(task.train) == 3
    problems = task.train + task.eval
    assert sorted(p.answer for p in problems) == [Fraction(9, 2), 7, 42, 2000]
    assert not {p.question for p in task.train} & {p.question for p in task.eval}
    by_answer = {p.answer: p for p in problems}
    p42 = by_answer[42]
    assert p42.question.startswith("Tom has 40 marbles")
    assert "####" in p42.question  # the instruction asks for the '#### <number>' format
    assert task.reward("40 + 2 = 42\n#### 42", p42) == 1.0
    assert task.reward("#### 42", p42) == 1.0
    assert task.reward("#### 41", p42) == 0.0
    assert task.reward("I cannot tell", p42) == 0.0
    assert task.reward("#### 2,000", by_answer[2000]) == 1.0
    assert task.reward("#### 4.5", by_answer[Fraction(9, 2)]) == 1.0
    msgs = task.messages(p42)
    assert msgs[-1] == {"role": "user", "content": p42.question}


def test_gsm8k_split_is_deterministic_in_task_seed():
    path = str(FIXTURES / "gsm8k.jsonl")
    a = GSM8KTask(TaskConfig(name="gsm8k", path=path, eval_size=1, seed=1))
    b = GSM8KTask(TaskConfig(name="gsm8k", path=path, eval_size=1, seed=1))
    assert [p.question for p in a.train] == [p.question for p in b.train]
    assert [p.question for p in a.eval] == [p.question for p in b.eval]
    capped = GSM8KTask(TaskConfig(name="gsm8k", path=path, eval_size=1, train_size=2, seed=1))
    assert [p.question for p in capped.train] == [p.question for p in a.train][:2]


@pytest.mark.parametrize("name", ["gsm8k", "countdown"])
def test_missing_task_path_raises_task_load_error(tmp_path, name):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(TaskLoadError, match="task.path") as info:
        load_task(TaskConfig(name=name, path=str(missing), eval_size=1))
    assert str(missing) in str(info.value)


def test_unknown_task_name_is_refused():
    with pytest.raises(ValueError, match="task.name"):
        load_task(TaskConfig(name="mbpp_typo"))
