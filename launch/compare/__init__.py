"""`es-compare`: ES and GRPO trained and evaluated side by side, and the verdict:

methods    the methods it compares: labels, which are trained, how each stage is built
run        the entry point: stages, run directory, resume
report     the verdict: paired tests over problems and seeds, power, budgets reached
markdown   the report's Markdown
plots      its figures
"""
