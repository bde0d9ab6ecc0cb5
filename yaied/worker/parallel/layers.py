"""The layers that talk to the other ranks, and building one rank's shard of a native model.

They replace the plain modules of yaied/worker/models/llama.py after the model is built on the
meta device, keeping their parameter names (``weight``, ``bias``), so the model's own
``load_weights`` loads the sliced tensors and its forward runs unchanged on the local heads:

    qkv_proj, gate_up_proj   plain nn.Linear over this rank's rows (no communication)
    o_proj, down_proj        RowParallelLinear: partial sums, all-reduced
    embed_tokens             VocabParallelEmbedding: this rank's vocabulary rows, all-reduced
    lm_head                  ParallelLMHead: this rank's logits columns, gathered on rank 0
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from yaied.kernels.cpu_isa import selected_level
from yaied.worker.cpu_linear import PackedLinear, can_pack, pack_linears
from yaied.worker.models import (
    NATIVE_ARCHITECTURES,
    architecture_of,
    materialize,
    rope_frequencies,
)
from yaied.worker.parallel.group import LOGITS, RankGroup
from yaied.worker.parallel.plan import ShardPlan


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local @ W_local^T) + b: each rank holds the input columns of its heads
    (its intermediate slice); the bias is whole and added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool, group: RankGroup) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.group = group
        self.packed: PackedLinear | None = None  # bf16 on CPU: the weight packed for oneDNN

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        partial = self.packed(x) if self.packed is not None else F.linear(x, self.weight)
        out = self.group.all_reduce(partial)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + per_rank) of the vocabulary; ids outside give zeros here and their
    embedding from the rank that holds them, through the all-reduce."""

    def __init__(self, per_rank: int, hidden: int, start: int, group: RankGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(per_rank, hidden))
        self.start, self.per_rank, self.group = start, per_rank, group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.group.all_reduce(out.masked_fill_(outside[:, None], 0))


class ParallelLMHead(nn.Module):
    """Logits over this rank's vocabulary rows, gathered on rank 0 and cut to the vocabulary.

    Only rank 0 computes logits of its own accord (in the runner, for the rows it samples or
    scores): it sends LOGITS with the hidden rows first, and the other ranks answer through
    ``follow``. The gather ends the step's collectives, so ``group.pending`` clears here."""

    def __init__(self, per_rank: int, hidden: int, vocab_size: int, group: RankGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(per_rank, hidden))
        self.vocab_size, self.group = vocab_size, group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[0] == 0:  # nothing samples this step (a prefill chunk): no round trip
            self.group.pending = False
            return hidden.new_zeros((0, self.vocab_size))
        hidden = hidden.contiguous()
        self.group.send(LOGITS, hidden.shape[0])
        self.group.broadcast(hidden)
        parts = self.group.gather(F.linear(hidden, self.weight))
        self.group.pending = False
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]

    def follow(self, hidden: torch.Tensor) -> None:
        self.group.gather(F.linear(hidden, self.weight))


def build_shard_model(
    hf_config, plan: ShardPlan, group: RankGroup, device: torch.device, dtype: torch.dtype
) -> nn.Module:
    """This rank's native model, weights uninitialised: built on the meta device with the local
    shape, its communicating layers swapped in, then materialised (so no rank ever allocates
    a whole layer)."""
    cls = NATIVE_ARCHITECTURES[architecture_of(hf_config)]
    inv_freq, scaling = rope_frequencies(hf_config, plan.shape.head_dim)
    shape = plan.local_shape
    with torch.device("meta"):
        model = cls(shape, inv_freq, scaling).to(dtype)
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.o_proj = RowParallelLinear(attn.q_size, shape.hidden_size, False, group)
            mlp.down_proj = RowParallelLinear(
                shape.intermediate_size, shape.hidden_size, shape.mlp_bias, group
            )
        per_rank = plan.vocab_per_rank
        model.embed_tokens = VocabParallelEmbedding(
            per_rank, shape.hidden_size, plan.vocab_start, group
        )
        model.lm_head = ParallelLMHead(per_rank, shape.hidden_size, shape.vocab_size, group)
        model = model.to(dtype)
    materialize(model, device)
    model.tie_weights()
    model.inv_freq = inv_freq.float().to(device)
    return model


def pack_shard(model: nn.Module, batch_hint: int) -> None:
    """bf16 on CPU: pack the plain linears (as the worker does at TP=1) and the row-parallel
    ones, whose matmul runs before their all-reduce."""
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    if not can_pack(dtype, device, selected_level()) or pack_linears(model, batch_hint) == 0:
        return
    for module in model.modules():
        if isinstance(module, RowParallelLinear):
            local = nn.Linear(module.in_features, module.out_features, bias=False, device="meta")
            local.weight = module.weight
            module.packed = PackedLinear(local, batch_hint)
