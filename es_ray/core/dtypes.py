"""The one place a dtype name becomes a torch dtype (engines, the ES replica, the GRPO learner, evaluation)."""

from __future__ import annotations

from es_ray.core.registry import Registry

# torch is imported by resolve_dtype only: the config's dtype names are checked without it.

DTYPES = Registry(
    "engine.dtype",
    {"auto": "bfloat16 on a GPU, float32 on a CPU", "bfloat16": "bfloat16", "float16": "float16", "float32": "float32"},
)


def resolve_dtype(name: str, device: str = "cpu", key: str = "engine.dtype"):
    """``auto`` is bfloat16 on CUDA and float32 on CPU (bf16 matmuls are several times slower on most CPUs);
    an unknown name is refused with the accepted ones."""
    import torch

    if isinstance(name, torch.dtype):
        return name
    name = str(name).removeprefix("torch.")
    DTYPES.check(name, key)
    if name == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    return getattr(torch, name)


def dtype_name(dtype) -> str:
    """torch.bfloat16 -> 'bfloat16'."""
    return str(dtype).removeprefix("torch.")
