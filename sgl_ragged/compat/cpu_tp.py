"""SGLang tensor parallelism on a machine without a GPU (--device cpu --tp-size T).

SGLang 0.5.23 builds its process groups with PyNccl whenever the platform is not an
out-of-tree one, also with the gloo backend it picks for the CPU: the PyNccl communicator then
asks for a CUDA device and every rank dies at startup ("Expected a cuda device, but got: cpu").
Without PyNccl a CPU group's all-reduce is torch.distributed's gloo all-reduce (SGLang's own
fallback where its shared-memory all-reduce, which needs AMX or arm64, is unavailable).
"""

from __future__ import annotations

from typing import Any

# Position of `backend` in parallel_state.init_model_parallel_group(group_ranks, local_rank,
# backend, use_pynccl, ...).
_BACKEND_ARG = 2


def init_model_parallel_group(original: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND parallel_state.init_model_parallel_group: no PyNccl for gloo (CPU) groups."""
    backend = args[_BACKEND_ARG] if len(args) > _BACKEND_ARG else kwargs.get("backend")
    if backend == "gloo":
        if len(args) > _BACKEND_ARG + 1:  # use_pynccl given by position
            args = (*args[: _BACKEND_ARG + 1], False, *args[_BACKEND_ARG + 2 :])
        else:
            kwargs["use_pynccl"] = False
    return original(*args, **kwargs)
