"""Native model implementations, chosen by the ``architectures`` entry of a Hugging Face config."""

from __future__ import annotations

import torch
from torch import nn

from yaied.worker.models.llama import LlamaForCausalLM, LlamaShape

# architecture name -> model class; each takes (shape, inv_freq, rope_scaling).
NATIVE_ARCHITECTURES: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}

# Rope types whose frequencies do not depend on the sequence length, so one table serves all.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def architecture_of(hf_config) -> str:
    archs = getattr(hf_config, "architectures", None) or []
    if not archs:
        raise ValueError("the model config names no architecture ('architectures' is empty)")
    return archs[0]


def check_supported(hf_config) -> None:
    """Raise a clear error for a config no native implementation can run."""
    arch = architecture_of(hf_config)
    if arch not in NATIVE_ARCHITECTURES:
        raise ValueError(
            f"architecture {arch} is not supported; supported: {', '.join(NATIVE_ARCHITECTURES)}"
        )
    if arch == "MistralForCausalLM" and getattr(hf_config, "sliding_window", None):
        window = hf_config.sliding_window
        if window < getattr(hf_config, "max_position_embeddings", 0):
            raise ValueError(
                f"Mistral with a sliding window ({window}) is not supported by the native "
                "implementation; set max_model_len <= the window or use a model without one"
            )
    rope_type = rope_parameters(hf_config).get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise ValueError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(STATIC_ROPE_TYPES)}"
        )


def rope_parameters(hf_config) -> dict:
    # transformers 5 keeps rope settings in `rope_parameters`; 4.x in rope_theta + rope_scaling.
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        return dict(params)
    params = dict(getattr(hf_config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return params


def rope_frequencies(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim / 2] and the cos/sin scaling, as transformers computes them."""
    params = rope_parameters(hf_config)
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params["rope_theta"]
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        return 1.0 / (base**exponents), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq, float(scaling)


def build_model(hf_config, device: torch.device, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The native model for the config on the device in ``dtype``, its weights uninitialised (still
    to load). Weights are copied in with ``copy_``, which rounds exactly as a later ``.to(dtype)``
    would, so building in the final dtype changes no value and never holds an fp32 copy: a bf16
    model on a GPU peaks at 2 bytes a parameter while loading, not 6."""
    check_supported(hf_config)
    cls = NATIVE_ARCHITECTURES[architecture_of(hf_config)]
    shape = LlamaShape.from_hf_config(hf_config)
    inv_freq, scaling = rope_frequencies(hf_config, shape.head_dim)
    # Build on the meta device so no memory is touched twice, then materialise on the target.
    with torch.device("meta"):
        model = cls(shape, inv_freq, scaling).to(dtype)
    materialize(model, device)
    model.tie_weights()  # materialize gives each module its own copy of a shared parameter
    model.inv_freq = inv_freq.float().to(device)  # materialize left the buffer uninitialised
    return model


def materialize(model: nn.Module, device: torch.device) -> None:
    """``model.to_empty(device)`` in place, without ``torch.empty_like``: on a meta tensor that
    runs torch's Python reference, which imports sympy (about 30 MB resident, 0.2 s) on a path
    that never needs it. Each module gets its own tensors, as with to_empty."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            empty = torch.empty(param.shape, dtype=param.dtype, device=device)
            setattr(module, name, nn.Parameter(empty, requires_grad=param.requires_grad))
        for name, buffer in list(module.named_buffers(recurse=False)):
            setattr(module, name, torch.empty(buffer.shape, dtype=buffer.dtype, device=device))
