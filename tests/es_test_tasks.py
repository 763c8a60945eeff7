"""Tasks for tests: rewards a tiny random model can move, and one whose reward function raises."""

from __future__ import annotations

from es_ray.tasks.base import Problem, Task


class VowelTask(Task):
    """Reward: share of generated letters that are vowels. Dense, and movable by a tiny random model."""

    name = "vowels"

    def load(self):
        problems = [Problem(question=f"Say something about the number {i}.", answer=None) for i in range(24)]
        return problems[: self.cfg.train_size or 16], problems[16:]

    def reward(self, completion: str, problem: Problem) -> float:
        letters = [c for c in completion.lower() if c.isalpha()]
        return sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0


class FlakyRewardTask(VowelTask):
    """Raises on every other problem: those completions must score 0 and be counted."""

    name = "flaky"

    def reward(self, completion: str, problem: Problem) -> float:
        if int(problem.question.split()[-1].rstrip(".")) % 2:
            raise ValueError("malformed completion")
        return 1.0


class WhitespaceTask(VowelTask):
    """Reward: share of the completion's characters that are whitespace. Newline and space-prefixed tokens are a
    few token ids shared by every context, so the tiny model can raise it in a few steps."""

    name = "whitespace"

    def reward(self, completion: str, problem) -> float:
        return sum(c.isspace() for c in completion) / len(completion) if completion else 0.0
