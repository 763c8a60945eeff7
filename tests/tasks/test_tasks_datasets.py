"""Every dataset of the paper loads from a local file in its hub schema (tests/fixtures/), skips and counts
malformed rows, states the answer format in its prompt and grades right and wrong answers; hub loading asks for
the right ids, configs and splits."""

from __future__ import annotations

import json

import pytest

from es_ray.core.config import ConfigError, TaskConfig
from es_ray.tasks import EVAL_TASKS, TASKS, load_task
from es_ray.tasks.base import Problem, TaskLoadError
from paths import FIXTURES


# name -> (valid rows in the fixture, malformed rows in it)
FIXTURE_ROWS = {
    "deepscaler": (4, 2),
    "math500": (4, 1),
    "aime24": (3, 1),
    "aime25": (3, 1),
    "amc23": (3, 1),
    "gpqa": (3, 1),
    "csqa": (3, 1),
    "mbpp": (3, 1),
    "gsm8k": (4, 1),
    "countdown": (5, 2),
}


def _load(name: str, **kw):
    return load_task(
        TaskConfig(name=name, path=str(FIXTURES / f"{name}.jsonl"), eval_size=kw.pop("eval_size", 0), **kw)
    )


def test_every_dataset_of_the_paper_is_registered():
    assert set(EVAL_TASKS) == {"gpqa", "mbpp", "csqa", "countdown", "aime24", "aime25", "amc23", "math500"}
    assert set(EVAL_TASKS) | {"gsm8k", "deepscaler", "arithmetic"} == set(TASKS)


@pytest.mark.parametrize("name", sorted(FIXTURE_ROWS))
def test_fixture_loads_and_malformed_rows_are_skipped_and_counted(name):
    task = _load(name)
    valid, malformed = FIXTURE_ROWS[name]
    assert task.skipped_rows == malformed
    assert len(task.eval_problems()) == valid
    assert task.train  # usable as a training pool too


@pytest.mark.parametrize("name", ["deepscaler", "math500", "aime24", "aime25", "amc23"])
def test_math_prompts_ask_for_a_boxed_answer_and_math_verify_grades(name):
    task = _load(name)
    problems = task.eval_problems()
    for p in problems:
        assert "\\boxed{}" in p.question
    right = [f"Some reasoning.\nThe final answer is $\\boxed{{{p.answer}}}$." for p in problems]
    grades = task.grade_batch(right + ["\\boxed{123456789}"] * len(problems), problems + problems)
    assert [g.correct for g in grades] == [True] * len(problems) + [False] * len(problems)
    assert all(g.failure is None for g in grades)
    assert task.reward(right[0], problems[0]) == 1.0
    assert task.reward("no idea", problems[0]) == 0.0
    assert task.majority_vote


def test_math_answers_in_other_forms():
    math500 = _load("math500")
    by_answer = {p.answer: p for p in math500.eval_problems()}
    assert math500.grade("so $\\boxed{\\frac{10}{12}}$", by_answer["\\frac{5}{6}"]).correct
    assert math500.grade("\\boxed{(3, \\pi/2)}", by_answer["\\left( 3, \\frac{\\pi}{2} \\right)"]).correct
    amc = _load("amc23")
    assert [p.answer for p in amc.eval_problems()] == ["11", "15", "0.75"]  # float column 11.0 read as 11
    assert amc.grade("\\boxed{3/4}", amc.eval_problems()[2]).correct
    deepscaler = _load("deepscaler")
    sqrt2 = next(p for p in deepscaler.eval_problems() if p.answer == "\\sqrt{2}")
    assert deepscaler.grade("x = \\boxed{2^{1/2}}", sqrt2).correct


def test_answers_count_only_in_the_final_box_unless_last_is_asked_for():
    """The issue's example: an unboxed completion that restates the problem scored correct under the lenient
    parser; strict (boxed, the default) scores it wrong, and both modes report it."""
    strict, lenient = _load("math500"), _load("math500", answer="last")
    p = next(q for q in strict.eval_problems() if q.answer == "32")  # "Compute $2^5$."
    restating = "We can find $2^5$ by doubling five times"
    truncated = "2^5 = 32, so the answer is \\boxed{3"
    assert [g.correct for g in strict.grade_batch([restating, truncated], [p, p])] == [False, False]
    assert lenient.grade(restating, p).correct  # math-verify takes the restated 2^5 = 32
    assert strict.reward(restating, p) == 0.0 and strict.grade("\\boxed{32}", p).correct
    assert strict.answer_checks(restating, p) == {"boxed": False, "restated": True}
    assert strict.answer_checks("so \\boxed{32}", p) == {"boxed": True, "restated": False}
    with pytest.raises(ConfigError, match="task.answer='loose'"):
        from es_ray.runtime.validation import validate_task

        validate_task(TaskConfig(name="math500", answer="loose"))


def test_gpqa_shuffles_choices_with_a_fixed_seed():
    a, b = _load("gpqa"), _load("gpqa")
    assert [(p.question, p.answer) for p in a.eval_problems()] == [(p.question, p.answer) for p in b.eval_problems()]
    other = _load("gpqa", seed=99)
    assert [p.question for p in other.eval_problems()] != [p.question for p in a.eval_problems()]
    rows = [json.loads(x) for x in (FIXTURES / "gpqa.jsonl").read_text().splitlines()]
    good = [r for r in rows if "Incorrect Answer 3" in r]
    for p, row in zip(a.eval_problems(), good):
        assert p.question.startswith(row["Question"])
        assert f"{p.answer}) {row['Correct Answer']}" in p.question  # the letter points at the right answer
        for i in (1, 2, 3):
            assert row[f"Incorrect Answer {i}"] in p.question
        assert "Answer: X" in p.question  # the answer format is stated


def test_gpqa_shuffle_is_independent_of_row_order(tmp_path):
    rows = (FIXTURES / "gpqa.jsonl").read_text().splitlines()
    path = tmp_path / "gpqa_reversed.jsonl"
    path.write_text("\n".join(reversed(rows)) + "\n")
    fwd = {p.question: p.answer for p in _load("gpqa").eval_problems()}
    reordered = load_task(TaskConfig(name="gpqa", path=str(path), eval_size=0))
    rev = {p.question: p.answer for p in reordered.eval_problems()}
    assert fwd == rev


def test_gpqa_letters_are_spread_over_many_questions(tmp_path):
    rows = [
        {
            "Question": f"Question number {i}?",
            "Correct Answer": f"right {i}",
            "Incorrect Answer 1": f"w1 {i}",
            "Incorrect Answer 2": f"w2 {i}",
            "Incorrect Answer 3": f"w3 {i}",
        }
        for i in range(200)
    ]
    path = tmp_path / "gpqa.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    letters = [p.answer for p in load_task(TaskConfig(name="gpqa", path=str(path), eval_size=0)).eval_problems()]
    assert all(25 <= letters.count(x) <= 75 for x in "ABCD"), {x: letters.count(x) for x in "ABCD"}


@pytest.mark.parametrize("name", ["gpqa", "csqa"])
def test_multiple_choice_grading(name):
    task = _load(name)
    p = task.eval_problems()[0]
    wrong = next(x for x in p.meta["letters"] if x != p.answer)
    assert task.grade(f"Let me think.\nAnswer: {p.answer}", p).correct
    g = task.grade(f"Answer: {wrong}", p)
    assert (g.correct, g.answer) == (False, wrong)
    assert task.grade("I am not sure.", p).answer is None
    assert "Answer: X" in p.question


def test_csqa_has_five_options_and_skips_unlabelled_rows():
    task = _load("csqa")
    problems = task.eval_problems()
    assert [p.answer for p in problems] == ["B", "A", "C"]
    assert all(p.meta["letters"] == "ABCDE" for p in problems)
    assert "E) attic" in problems[0].question


def test_mbpp_prompt_and_sandboxed_grading():
    task = _load("mbpp")
    problems = task.eval_problems()
    add, rev, largest = problems
    assert "assert add(1, 2) == 3" in add.question and "```python" in add.question
    good = "Here is the code:\n```python\ndef add(a, b):\n    return a + b\n```"
    bad = "```python\ndef add(a, b):\n    return a * b\n```"
    hang = "```python\ndef add(a, b):\n    while True:\n        pass\n```"
    heap = "```python\ndef largest(xs):\n    return heapq.nlargest(1, xs)[0]\n```"  # needs the setup code's import
    task.sandbox_limits = type(task.sandbox_limits)(wall_s=3.0, cpu_s=1.0)
    grades = task.grade_batch([good, bad, hang, heap], [add, add, add, largest])
    assert [(g.score, g.failure) for g in grades] == [(1.0, None), (0.0, None), (0.0, "timeout"), (1.0, None)]
    assert task.reward(good, add) == 1.0
    assert not task.majority_vote


def test_mbpp_rows_need_string_tests_each_one_assert():
    from es_ray.tasks.dataset import RowError

    task = _load("mbpp")
    good = {"text": "t", "test_list": ["assert f(1) == 1"], "test_setup_code": ""}
    assert task.parse(good).answer == ("assert f(1) == 1",)
    for bad in (
        {"test_list": [None]},
        {"test_list": [1, "assert f(1) == 1"]},
        {"test_list": ["x = 1"]},
        {"test_list": ["assert f(1)\nassert g()"]},
        {"test_list": ["assert ("]},
        {"test_list": "assert f()"},
        {"test_setup_code": 3},
        {"test_imports": [None]},
    ):
        with pytest.raises(RowError):
            task.parse({**good, **bad})
    # the program's code cannot swallow a test: fewer trailing asserts than tests fails
    p = task.parse({**good, "test_list": ["assert f(1) == 1", "assert f(2) == 2"]})
    swallow = "```python\ndef f(x):\n    return x\nif False:\n    pass\n```"
    assert task.grade(swallow, p).score == 1.0
    from es_ray.grading.sandbox import run_python

    res = run_python("def f(x):\n    return 0\nassert f(1) == 0\nprint('x')\nassert f(2) == 0\n", n_tests=2)
    assert res.status == "failed" and "swallowed" in res.stderr


def test_aime25_from_the_hub_concatenates_both_parts(monkeypatch):
    import es_ray.tasks.dataset as dataset

    calls = []

    def fake_hub_rows(hub_id, config, split, task):
        calls.append((hub_id, config, split))
        part = config[-2:].strip("-")
        return [{"question": f"{part} problem {i}", "answer": str(i)} for i in range(15)]

    monkeypatch.setattr(dataset, "hub_rows", fake_hub_rows)
    task = load_task(TaskConfig(name="aime25", eval_size=0))
    assert calls == [("opencompass/AIME2025", "AIME2025-I", "test"), ("opencompass/AIME2025", "AIME2025-II", "test")]
    problems = task.eval_problems()
    assert len(problems) == 30
    assert problems[0].question.startswith("I problem 0") and problems[15].question.startswith("II problem 0")


@pytest.mark.parametrize(
    "name,hub_id,config,split",
    [
        ("deepscaler", "agentica-org/DeepScaleR-Preview-Dataset", None, "train"),
        ("math500", "HuggingFaceH4/MATH-500", None, "test"),
        ("aime24", "HuggingFaceH4/aime_2024", None, "train"),
        ("amc23", "math-ai/amc23", None, "test"),
        ("gpqa", "Idavidrein/gpqa", "gpqa_diamond", "train"),
        ("csqa", "tau/commonsense_qa", None, "validation"),
        ("mbpp", "google-research-datasets/mbpp", "full", "test"),
    ],
)
def test_hub_ids_configs_and_splits(monkeypatch, name, hub_id, config, split):
    import es_ray.tasks.dataset as dataset

    calls = []
    fixture_rows = [
        json.loads(x)
        for x in (FIXTURES / f"{name}.jsonl").read_text().splitlines()
        if x.strip().startswith("{") and x.strip().endswith("}")
    ]

    def fake_hub_rows(hub_id_, config_, split_, task):
        calls.append((hub_id_, config_, split_))
        return fixture_rows

    monkeypatch.setattr(dataset, "hub_rows", fake_hub_rows)
    task = load_task(TaskConfig(name=name, eval_size=1))
    assert calls[0] == (hub_id, config, split)
    assert task.eval_problems()


def test_hub_failure_says_to_use_a_local_file(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # as on a machine without the package or the network
    with pytest.raises(TaskLoadError, match="task.path"):
        load_task(TaskConfig(name="math500"))


def test_a_file_of_only_malformed_rows_is_an_error_not_a_silent_zero(tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text('{"problem": "no answer"}\nnot json\n{"answer": "1"}\n')
    with pytest.raises(TaskLoadError, match="every row was skipped, skipped 3 of 3 rows"):
        load_task(TaskConfig(name="math500", path=str(path)))


def test_bad_rows_are_skipped_and_counted_never_the_whole_file(tmp_path):
    from es_ray.tasks.dataset import MAX_QUESTION_CHARS

    path = tmp_path / "mixed.jsonl"
    good = [json.dumps({"problem": f"What is {i}+1?", "answer": str(i + 1)}).encode() for i in range(3)]
    bad = [
        b'{"problem": ' + b"[" * 200_000 + b"]" * 200_000 + b', "answer": "1"}',  # nested past the recursion limit
        b'{"problem": "caf\xe9 \xff", "answer": "1"}',  # not UTF-8
        json.dumps({"problem": {"text": "a dict"}, "answer": "1"}).encode(),  # wrong types
        json.dumps({"problem": ["a", "list"], "answer": "1"}).encode(),
        json.dumps({"problem": "x" * (MAX_QUESTION_CHARS + 1), "answer": "1"}).encode(),
    ]  # a 20 kB+ prompt
    path.write_bytes(b"\n".join([good[0], *bad[:3], good[1], *bad[3:], good[2]]) + b"\n")
    task = load_task(TaskConfig(name="math500", path=str(path), eval_size=0))
    assert sorted(p.answer for p in task.eval_problems()) == ["1", "2", "3"]
    assert task.skipped_rows == len(bad)


def test_last_accepts_every_completion_boxed_accepts():
    """answer=last is a superset of boxed: a final box is graded alone in both modes, so a later stray expression
    cannot turn a boxed right answer wrong; without a box, last lets math-verify take the last expression."""
    strict, lenient = _load("math500"), _load("math500", answer="last")
    p = next(q for q in strict.eval_problems() if q.answer == "32")
    boxed_then_more = "2^5 = \\boxed{32}. Check: 2^6 = 64"
    assert strict.grade(boxed_then_more, p).correct and lenient.grade(boxed_then_more, p).correct
    assert strict.prediction(boxed_then_more) == lenient.prediction(boxed_then_more) == "\\boxed{32}"
    assert strict.prediction("it is 32") is None and lenient.prediction("it is 32") == "it is 32"


def test_a_bare_latex_restatement_in_the_last_line_is_flagged():
    task = _load("math500")
    p = Problem(question="Compute $\\frac{1}{2}+\\frac{1}{3}$.", answer="\\frac{5}{6}")
    assert task.answer_checks("The sum is \\frac{1}{2}+\\frac{1}{3}.", p)["restated"]
    assert task.answer_checks("We get \\frac{1}{2} + \\frac{1}{3}", p)["restated"]
    assert not task.answer_checks("The sum is \\frac{5}{6}", p)["restated"]
    assert not task.answer_checks("The answer is 5", p)["restated"]


def test_benchmark_held_out_and_training_pool():
    task = _load("math500", eval_size=2)
    assert len(task.eval) == 2 and len(task.train) == 2
    assert not {p.question for p in task.eval} & {p.question for p in task.train}
    assert len(task.eval_problems()) == 4  # es-eval scores the whole benchmark


# -- bad data is skipped and counted; a bug in a parser is not ----------------------------------------------


def test_a_bug_in_a_parser_fails_loudly_and_bad_data_is_skipped_and_counted(tmp_path):
    from es_ray.tasks.dataset import MathTask

    path = tmp_path / "math.jsonl"
    path.write_text(
        '{"problem": "1 + 1?", "answer": "2"}\n{"problem": "no answer"}\n{"problem": "x", "answer": ""}\n'
        'not json\n[1, 2]\n'
    )

    class Benchmark(MathTask):
        name = "benchmark"

    class AttributeBug(Benchmark):
        def parse(self, row):
            return super().parse(row).meta.upper()  # a dict has no upper(): a bug, not bad data

    class TypeBug(Benchmark):
        def parse(self, row):
            return super().parse(row).answer + 1  # str + int

    cfg = TaskConfig(name="benchmark", path=str(path), eval_size=0)
    task = Benchmark(cfg)
    assert (task.skipped_rows, [p.answer for p in task.eval_problems()]) == (4, ["2"])
    with pytest.raises(AttributeError, match="upper"):
        AttributeBug(cfg)
    with pytest.raises(TypeError, match="can only concatenate str"):
        TypeBug(cfg)


# name -> rows whose values have the wrong type: each must be skipped and counted, not crash nor pass
WRONG_TYPES = {
    "csqa": [
        {"question": "q?", "choices": None, "answerKey": "A"},
        {"question": "q?", "choices": [["A", "B"], ["x", "y"]], "answerKey": "A"},
        {"question": "q?", "choices": {"label": "AB", "text": ["x", "y"]}, "answerKey": "A"},
    ],
    "mbpp": [
        {"text": "t", "test_list": None},
        {"text": "t", "test_list": "assert f() == 1"},
        {"text": "t", "test_list": ["assert f() == 1"], "test_imports": 7},
    ],
    "gsm8k": [{"question": None, "answer": "#### 4"}, {"question": "q", "answer": None}],
    "countdown": [
        {"target": 9, "nums": None},
        {"target": 9, "nums": "1,2,3"},
        {"target": 2.5, "nums": [1, 2]},
        {"target": None, "nums": [1, 2]},
        {"target": 3, "nums": [1, [2]]},
        {"target": 3, "nums": [3]},
    ],
}


@pytest.mark.parametrize("name", sorted(WRONG_TYPES))
def test_rows_with_values_of_the_wrong_type_are_skipped_and_counted(name, tmp_path):
    path = tmp_path / f"{name}.jsonl"
    rows = (FIXTURES / f"{name}.jsonl").read_text().splitlines() + [json.dumps(r) for r in WRONG_TYPES[name]]
    path.write_text("\n".join(rows) + "\n")
    task = load_task(TaskConfig(name=name, path=str(path), eval_size=0, train_size=2))
    valid, malformed = FIXTURE_ROWS[name]
    assert (task.skipped_rows, len(task.eval_problems())) == (malformed + len(WRONG_TYPES[name]), valid)


# -- countdown: generated by default, or the hub set, or a local copy of it ---------------------------------

COUNTDOWN_HUB = "Jiayi-Pan/Countdown-Tasks-3to4"


def _fake_datasets(monkeypatch, rows: list[dict]) -> list[tuple]:
    """`datasets` as a module whose load_dataset returns ``rows``; the calls it got."""
    import sys
    import types

    calls = []

    def load_dataset(path, name=None, split=None):
        calls.append((path, name, split))
        return rows

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    return calls


def test_countdown_from_the_hub_matches_a_local_copy(monkeypatch):
    rows = [json.loads(x) for x in (FIXTURES / "countdown.jsonl").read_text().splitlines() if x.endswith("}")]
    calls = _fake_datasets(monkeypatch, rows)
    hub = load_task(TaskConfig(name="countdown", countdown_source="hub", train_size=3, eval_size=2))
    assert calls == [(COUNTDOWN_HUB, None, "train")]
    assert hub.skipped_rows == 1  # the row without nums
    local = _load("countdown", train_size=3, eval_size=2)
    key = lambda problems: [(p.question, p.answer, p.meta["nums"]) for p in problems]  # noqa: E731
    assert key(hub.train) == key(local.train) and key(hub.eval) == key(local.eval)
    assert key(hub.eval_problems()) == key(local.eval_problems())
    assert [(p.answer, p.meta["nums"]) for p in hub.eval] == [(10, [2, 5, 7]), (98, [44, 19, 35])]
    assert hub.reward("<answer>(1 + 2) * 3</answer>", hub.train[0]) == 1.0
    # task.path is the offline copy: it wins over the hub
    calls.clear()
    assert key(_load("countdown", countdown_source="hub", train_size=3).train) == key(local.train)
    assert calls == []


def test_countdown_stays_generated_unless_the_hub_is_asked_for(monkeypatch):
    calls = _fake_datasets(monkeypatch, [{"target": 9, "nums": [1, 2, 3]}])
    task = load_task(TaskConfig(name="countdown", train_size=4, eval_size=2))
    assert calls == [] and task.skipped_rows == 0
    assert len(task.train) == 4 and [p.question for p in task.eval_problems()] == [p.question for p in task.eval]
    with pytest.raises(TaskLoadError, match=r"task.countdown_source='hf' is not one of generated, hub"):
        load_task(TaskConfig(name="countdown", countdown_source="hf"))


def test_countdown_hub_failure_says_to_use_a_local_file(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(TaskLoadError, match=f"could not load {COUNTDOWN_HUB} split 'train'.*task.path="):
        load_task(TaskConfig(name="countdown", countdown_source="hub"))
