"""Models without a native implementation, run through transformers' own model classes.

The model is ``AutoModelForCausalLM`` with ``attn_implementation="yaied_paged"`` (hf_attention.py):
transformers does everything but attention, and attention reads and writes yaied's KV pages. So
scheduling, the prefix cache and sampling are the same as for native models; only the layers'
arithmetic is transformers'. ``TransformersModel`` gives the model the interface the runner and
the worker expect (``forward(input_ids, positions, kv_caches, meta)``, ``compute_logits``,
``shape``).

What cannot work this way is refused with a ValueError that names the model and the reason:
encoder-decoder models, code shipped with a model while ``trust_remote_code`` is off, classes that
do not call transformers' attention interface, and rope scalings that change with the batch.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from yaied.worker.attention import AttentionMetadata
from yaied.worker.models.hf_attention import (
    ATTENTION_NAME,
    NoPagedContext,
    PagedContext,
    register_attention,
)

log = logging.getLogger(__name__)

# Rope types whose frequencies transformers picks from the batch's longest position: in a packed
# batch one long sequence would change every other sequence's rotation.
BATCH_DEPENDENT_ROPE_TYPES = ("dynamic", "longrope")


@dataclass(frozen=True, slots=True)
class TransformersShape:
    """What the worker and the runner read from ``model.shape`` (names as in LlamaShape)."""

    vocab_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


def needs_remote_code(folder: Path | None) -> bool:
    """True when the folder's config.json names a model type transformers does not ship and
    points at code of its own (``auto_map``)."""
    if folder is None or not (folder / "config.json").is_file():
        return False
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    data = json.loads((folder / "config.json").read_text())
    return "auto_map" in data and data.get("model_type") not in CONFIG_MAPPING


def check_remote_code(name: str, folder: Path | None, trust_remote_code: bool) -> None:
    if needs_remote_code(folder) and not trust_remote_code:
        raise ValueError(
            f"model {name}: its model type is not part of transformers and needs the Python code "
            "shipped with the model; set model.trust_remote_code = true (model_impl = "
            '"transformers") only if you trust that code'
        )


def model_class(name: str, hf_config, trust_remote_code: bool) -> type[nn.Module]:
    """The transformers causal-LM class for the config, refused where it cannot run paged."""
    arch = (getattr(hf_config, "architectures", None) or [type(hf_config).__name__])[0]
    if getattr(hf_config, "is_encoder_decoder", False):
        raise ValueError(
            f"model {name} ({arch}) is an encoder-decoder model; yaied's paged KV cache serves "
            "decoder-only models"
        )
    if getattr(hf_config, "attention_chunk_size", None):  # Llama 4's text layers
        raise ValueError(
            f"model {name} ({arch}): its attention is chunked (attention_chunk_size), which "
            "yaied's paged attention does not apply"
        )
    auto_map = getattr(hf_config, "auto_map", None) or {}
    if trust_remote_code and "AutoModelForCausalLM" in auto_map:
        from transformers.dynamic_module_utils import get_class_from_dynamic_module

        cls = get_class_from_dynamic_module(
            auto_map["AutoModelForCausalLM"], hf_config.name_or_path, local_files_only=True
        )
    else:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        if type(hf_config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
            raise ValueError(
                f"model {name} ({arch}): transformers has no causal-LM class for model type "
                f"{hf_config.model_type!r}"
            )
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]
    if not getattr(cls, "_supports_attention_backend", False):
        raise ValueError(
            f"model {name}: {cls.__name__} does not support transformers' attention interface "
            "(_supports_attention_backend is off), so it cannot attend over yaied's KV pages"
        )
    return cls


def check_rope(name: str, hf_config, max_model_len: int) -> None:
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    params = dict(params or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in BATCH_DEPENDENT_ROPE_TYPES:
        return
    original = params.get("original_max_position_embeddings") or getattr(
        hf_config, "original_max_position_embeddings", None
    )
    if original is None or max_model_len > original:
        raise ValueError(
            f"model {name}: rope type {rope_type!r} rescales positions by the longest sequence of "
            f"a batch, which differs between batched and single requests; set max_model_len <= "
            f"{original or 'the original context length'} to serve it"
        )


class TransformersModel(nn.Module):
    """A transformers causal LM behind the native models' interface (see llama.py)."""

    def __init__(self, hf_model: nn.Module, name: str) -> None:
        super().__init__()
        self.name = name  # the model as the user named it, for errors
        self.hf_model = hf_model
        self.base = hf_model.base_model
        if self.base is hf_model:  # no inner model to take hidden states from
            raise ValueError(f"model {name}: {type(hf_model).__name__} has no base model")
        self.lm_head = hf_model.get_output_embeddings()
        self.config = hf_model.config.get_text_config()
        self.shape = self._probe_shape()

    def _run(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: PagedContext):
        # One batch row: the runner's packed tokens, each with its own sequence's position.
        return self.base(
            input_ids=input_ids[None],
            position_ids=positions[None],
            use_cache=False,
            yaied_paged=ctx,
        ).last_hidden_state[0]

    @torch.inference_mode()
    def _probe_shape(self) -> TransformersShape:
        """Run two tokens through the model with a recording attention: every layer must call
        the attention interface, each with the same head layout (that is the KV pool's)."""
        device = self.lm_head.weight.device
        ids = torch.zeros(2, dtype=torch.int64, device=device)
        positions = torch.arange(2, device=device)
        ctx = PagedContext(None, None, positions, 1)
        name = f"model {self.name}: {type(self.hf_model).__name__}"
        try:
            hidden = self._run(ids, positions, ctx)
        except NoPagedContext:
            raise ValueError(
                f"{name}: its layers do not pass their keyword arguments on to the attention "
                "call, so attention cannot reach yaied's KV pages"
            ) from None
        if ctx.unsupported:
            raise ValueError(
                f"{name}: {ctx.unsupported[0]}, which yaied's paged attention does not support"
            )
        self._check_head(name, ids, positions, hidden)
        num_layers = self.config.num_hidden_layers
        if sorted(ctx.probed) != list(range(num_layers)):
            raise ValueError(
                f"{name}: {len(ctx.probed)} of {num_layers} layers attend through transformers' "
                "attention interface; every layer must, to run on yaied's KV pages"
            )
        layouts = set(ctx.probed.values())
        if len(layouts) != 1:
            raise ValueError(f"{name}: layers differ in KV head layout {sorted(layouts)}")
        num_heads, num_kv_heads, head_dim = layouts.pop()
        return TransformersShape(
            vocab_size=self.lm_head.weight.shape[0],
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
        )

    def _check_head(self, name: str, ids, positions, hidden: torch.Tensor) -> None:
        """compute_logits must give the causal-LM forward's logits (ModernBERT's decoder has a
        prediction head between the base model and its output embeddings, for one)."""
        probe = PagedContext(None, None, positions, 1)
        full = self.hf_model(input_ids=ids[None], position_ids=positions[None], yaied_paged=probe)
        if not torch.allclose(self.compute_logits(hidden), full.logits[0].float(), 1e-3, 1e-3):
            raise ValueError(
                f"{name}: its logits are not its output embeddings' (with the scalings yaied "
                "knows) of the base model's hidden states"
            )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions: [num_tokens]. Returns hidden states [num_tokens, hidden]."""
        ctx = PagedContext(kv_caches, meta, positions, int(positions.max()))
        return self._run(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] fp32, with the scalings some causal-LM heads apply after lm_head."""
        logits = self.lm_head(hidden).float()
        config = self.config
        scale = getattr(config, "logit_scale", None)  # Cohere multiplies
        if isinstance(scale, float | int) and not isinstance(scale, bool):
            logits = logits * scale
        divisor = getattr(config, "logits_scaling", None)  # Granite divides
        if isinstance(divisor, float | int) and not isinstance(divisor, bool):
            logits = logits / divisor
        cap = getattr(config, "final_logit_softcapping", None)  # Gemma 2
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits


def build_transformers_model(
    name: str,
    hf_config,
    folder: Path | None,
    *,
    device: torch.device,
    dtype: torch.dtype,
    dummy: bool,
    trust_remote_code: bool,
    max_model_len: int,
) -> TransformersModel:
    """Instantiate transformers' class for the config, with weights from the folder (or random,
    seeded by the caller, for dummy models), on the device, in eval mode."""
    model_class(name, hf_config, trust_remote_code)  # refuses what cannot run, before loading
    check_rope(name, hf_config, max_model_len)
    register_attention()
    from transformers import AutoModelForCausalLM

    common = dict(dtype=dtype, attn_implementation=ATTENTION_NAME)
    if dummy or folder is None:
        hf_model = AutoModelForCausalLM.from_config(
            hf_config, trust_remote_code=trust_remote_code, **common
        )
    else:
        hf_model = AutoModelForCausalLM.from_pretrained(
            folder,
            trust_remote_code=trust_remote_code,
            local_files_only=True,
            use_safetensors=True,  # never unpickle a checkpoint: a .bin can run code on load
            **common,
        )
    hf_model = hf_model.to(device).eval()
    if not getattr(type(hf_model), "_supports_attention_backend", False):  # remote code's class
        raise ValueError(
            f"model {name}: {type(hf_model).__name__} does not support transformers' attention "
            "interface (_supports_attention_backend is off)"
        )
    model = TransformersModel(hf_model, name)
    log.info("model %s runs as transformers' %s on yaied's KV pages", name, type(hf_model).__name__)
    return model
