"""Graders used by the tasks' rewards: final numbers (numbers), Countdown equations parsed without eval
(countdown), math answers with math-verify in a worker pool under our own timeout (mathverify), multiple-choice
letters (choice), MBPP programs in a sandboxed subprocess (code, sandbox); ``result`` holds the Grade type and
the failure kinds that es-eval counts."""
