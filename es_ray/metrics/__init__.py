"""Evaluation metrics as pure functions (no Ray, no vLLM): pass@k and maj@k (passk), token entropy (entropy),
weight drift between checkpoints (drift); plus the results table (report) and plots (plots)."""
