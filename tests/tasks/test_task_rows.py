"""Skipped rows are reported per reason with where the first one is; a file whose rows all fail, or that the
default task.eval_size would leave with fewer training rows than held-out ones, is refused in one line."""

from __future__ import annotations

import json

import pytest

from es_ray.core.config import TaskConfig
from es_ray.tasks import load_task
from es_ray.tasks.base import TaskLoadError


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _good(i):
    return {"question": f"What is {i} + 1?", "answer": f"{i} + 1 = {i + 1}\n#### {i + 1}"}


def test_skipped_rows_are_counted_per_reason_with_the_first_line(tmp_path):
    rows = [_good(i) for i in range(36)]
    rows[6] = {"question": "no answer here"}
    rows[20] = {"question": "also none"}
    rows[9] = "{not json"
    rows[30] = {"question": "a prose answer", "answer": "about seven"}  # a bare 7 is a reference (test below)
    path = _write(tmp_path / "mine.jsonl", rows)
    task = load_task(TaskConfig(name="gsm8k", path=path, eval_size=4))
    assert task.skipped_rows == 4
    assert task.skipped_lines() == [
        f'task gsm8k: skipped 4 of 36 rows of task.path={path}: 2 missing "answer", 1 not JSON, '
        "1 no '#### <number>' in the answer, nor a bare number; first at line 7"
    ]
    assert len(task.eval) == 4 and len(task.train) == 16  # task.train_size's default caps the pool


def test_a_clean_file_prints_nothing(tmp_path):
    task = load_task(
        TaskConfig(name="gsm8k", path=_write(tmp_path / "ok.jsonl", [_good(i) for i in range(8)]), eval_size=2)
    )
    assert task.skipped_lines() == []


def test_a_file_whose_every_row_is_skipped_is_refused_with_the_reason(tmp_path):
    # a gsm8k-schema file given to countdown: every row lacks "nums"
    path = _write(tmp_path / "gsm.jsonl", [_good(i) for i in range(40)])
    with pytest.raises(TaskLoadError) as err:
        load_task(TaskConfig(name="countdown", path=path, train_size=8, eval_size=4))
    text = str(err.value)
    assert "every row was skipped" in text and 'skipped 40 of 40 rows' in text and 'missing "nums"' in text
    assert "first at line 1" in text and "task.name=" in text and "\n" not in text


def test_the_default_eval_size_may_not_leave_fewer_training_rows_than_held_out(tmp_path):
    path = _write(tmp_path / "forty.jsonl", [_good(i) for i in range(40)])
    with pytest.raises(TaskLoadError) as err:
        load_task(TaskConfig(name="gsm8k", path=path))
    text = str(err.value)
    assert "40 usable rows" in text and "holds out 32" in text and "leaves 8 to train" in text
    assert "task.eval_size=" in text
    chosen = load_task(TaskConfig(name="gsm8k", path=path, eval_size=30))  # a size the user set is theirs
    assert (len(chosen.eval), len(chosen.train)) == (30, 10)
    assert len(load_task(TaskConfig(name="gsm8k", path=path, eval_size=8)).eval) == 8


def test_a_byte_order_mark_and_crlf_lines_keep_the_first_row(tmp_path):
    """A file saved by a Windows editor: a BOM before line 1 and CRLF endings; every row is read."""
    path = tmp_path / "bom.jsonl"
    rows = [json.dumps({"question": f"{i} + 1?", "answer": f"#### {i + 1}"}) for i in range(6)]
    path.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(rows).encode() + b"\r\n")
    task = load_task(TaskConfig(name="gsm8k", path=str(path), eval_size=2))
    assert len(task.train) + len(task.eval) == 6 and task.skipped_lines() == []


def test_a_gsm8k_answer_that_is_just_a_number_is_its_reference(tmp_path):
    """An int column (or "42") is the final answer itself; prose with no number after #### is still skipped."""
    path = tmp_path / "bare.jsonl"
    rows = [{"question": f"{i} + 1?", "answer": i + 1} for i in range(5)] + [{"question": "q", "answer": "about 3"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = load_task(TaskConfig(name="gsm8k", path=str(path), eval_size=1))
    assert sorted(p.answer for p in task.train + task.eval) == [1, 2, 3, 4, 5]
    assert task.skipped_lines() == [
        f"task gsm8k: skipped 1 of 6 rows of task.path={path}: 1 no '#### <number>' "
        "in the answer, nor a bare number; first at line 6"
    ]


@pytest.mark.parametrize(
    "content, words",
    [
        (b'[{"question": "1 + 1?", "answer": "#### 2"', "is not JSON"),
        (b'{"train": [{"question": "1 + 1?", "answer": "#### 2"}]}', 'no "data" or "rows" list (keys: train)'),
    ],
)
def test_a_json_file_that_is_cut_or_keyed_otherwise_is_one_line_naming_task_path(tmp_path, content, words):
    path = tmp_path / "mine.json"
    path.write_bytes(content)
    with pytest.raises(TaskLoadError) as err:
        load_task(TaskConfig(name="gsm8k", path=str(path), eval_size=1))
    assert words in str(err.value) and f"task.path={path}" in str(err.value) and "\n" not in str(err.value)


def test_a_json_file_with_a_byte_order_mark_is_read(tmp_path):
    path = tmp_path / "bom.json"
    rows = [{"question": f"{i} + 1?", "answer": f"#### {i + 1}"} for i in range(4)]
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(rows).encode())
    task = load_task(TaskConfig(name="gsm8k", path=str(path), eval_size=1))
    assert len(task.train) + len(task.eval) == 4


def test_the_eval_size_hint_says_what_0_does_for_a_training_file(tmp_path):
    """For a task with a training split (gsm8k) one file's task.eval_size=0 holds out nothing (no held-out curve;
    es-eval still scores every row): the hint says so, and does what it says."""
    path = _write(tmp_path / "forty.jsonl", [_good(i) for i in range(40)])
    with pytest.raises(TaskLoadError) as err:
        load_task(TaskConfig(name="gsm8k", path=path))
    assert "or 0 for no held-out set (es-eval scores every row either way)" in str(err.value)
    none_held = load_task(TaskConfig(name="gsm8k", path=path, eval_size=0, train_size=0))
    assert (len(none_held.eval), len(none_held.train), len(none_held.eval_problems())) == (0, 40, 40)
