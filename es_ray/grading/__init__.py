"""Graders: pure parsers and checkers used by the tasks' rewards."""
