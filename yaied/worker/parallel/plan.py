"""Which part of every weight a rank holds, and reading only that part from safetensors files.

One engine of N ranks splits a Llama-family model the Megatron way:

    q/k/v, gate/up      column-parallel: rank r holds its heads' (its intermediate slice's) rows
    o_proj, down_proj   row-parallel: the matching input columns; partial sums are all-reduced
    embed_tokens        vocab-parallel: rows [r * Vp, (r + 1) * Vp) of the vocabulary,
    lm_head             Vp = ceil(vocab / N), padded with zero rows; logits gathered on rank 0
    norms, q/k norm     replicated

KV heads are split like query heads; with fewer KV heads than ranks, each KV head is replicated
on N / kv_heads ranks, and rank r holds KV head r * kv_heads // N, the one its query heads read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from yaied.worker.models.llama import LlamaShape

COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
VOCAB_PARALLEL = ("embed_tokens", "lm_head")


def check_divisible(shape: LlamaShape, world_size: int) -> None:
    """One line naming the numbers when the model's heads or sizes cannot be split N ways."""
    n, kv = world_size, shape.num_kv_heads
    problem = None
    if shape.num_heads % n:
        problem = f"its {shape.num_heads} attention heads are not divisible by {n}"
    elif kv >= n and kv % n:
        problem = f"its {kv} KV heads are not divisible by {n}"
    elif kv < n and n % kv:
        problem = f"its {kv} KV heads neither divide into {n} parts nor divide {n}"
    elif shape.intermediate_size % n:
        problem = f"its intermediate size {shape.intermediate_size} is not divisible by {n}"
    if problem:
        raise ValueError(f"tensor_parallel_size {n} cannot split this model: {problem}")


@dataclass(frozen=True, slots=True)
class ShardPlan:
    shape: LlamaShape  # the whole model's
    rank: int
    world_size: int

    def __post_init__(self) -> None:
        check_divisible(self.shape, self.world_size)

    @property
    def num_heads(self) -> int:
        return self.shape.num_heads // self.world_size

    @property
    def num_kv_heads(self) -> int:
        return max(self.shape.num_kv_heads // self.world_size, 1)

    @property
    def first_kv_head(self) -> int:
        # Replicated (kv < N): rank r's query heads all read KV head r * kv // N.
        return self.rank * self.shape.num_kv_heads // self.world_size

    @property
    def intermediate_size(self) -> int:
        return self.shape.intermediate_size // self.world_size

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.shape.vocab_size // self.world_size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    @property
    def local_shape(self) -> LlamaShape:
        """The shape this rank's layers are built with: its heads and intermediate slice. The
        vocabulary stays whole: the runner and the sampler see full-vocabulary logits."""
        return dataclasses.replace(
            self.shape,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_size,
        )

    def rows_of(self, hf_name: str) -> tuple[int, int] | None:
        """The output rows (dim 0) this rank reads of a column-parallel or vocab-parallel
        weight, or None when it is not split that way."""
        head_dim = self.shape.head_dim
        if ".q_proj." in hf_name:
            start = self.rank * self.num_heads * head_dim
            return start, start + self.num_heads * head_dim
        if ".k_proj." in hf_name or ".v_proj." in hf_name:
            start = self.first_kv_head * head_dim
            return start, start + self.num_kv_heads * head_dim
        if ".gate_proj." in hf_name or ".up_proj." in hf_name:
            start = self.rank * self.intermediate_size
            return start, start + self.intermediate_size
        if any(f"{name}.weight" in hf_name for name in VOCAB_PARALLEL):
            start = self.vocab_start
            return start, min(start + self.vocab_per_rank, self.shape.vocab_size)
        return None

    def columns_of(self, hf_name: str) -> tuple[int, int] | None:
        """The input columns (dim 1) this rank reads of a row-parallel weight (biases of
        row-parallel layers are whole: added once, after the all-reduce)."""
        if not hf_name.endswith(".weight"):
            return None
        if ".o_proj." in hf_name:
            size = self.num_heads * self.shape.head_dim
            return self.rank * size, (self.rank + 1) * size
        if ".down_proj." in hf_name:
            return self.rank * self.intermediate_size, (self.rank + 1) * self.intermediate_size
        return None

    def read(self, hf_name: str, handle_slice) -> torch.Tensor:
        """This rank's part of one tensor, reading only that part (a safetensors slice)."""
        rows = self.rows_of(hf_name)
        if rows is not None:
            part = handle_slice[rows[0] : rows[1]]
            if any(f"{name}.weight" in hf_name for name in VOCAB_PARALLEL):
                missing = self.vocab_per_rank - part.shape[0]  # the last rank's padding
                part = torch.nn.functional.pad(part, (0, 0, 0, missing))
            return part
        columns = self.columns_of(hf_name)
        if columns is not None:
            return handle_slice[:, columns[0] : columns[1]]
        return handle_slice[:]


def iter_shard_weights(folder: Path, plan: ShardPlan) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, this rank's part) for every tensor of the folder's safetensors files: each rank
    reads its own slices (safe_open + get_slice), never a whole copy of the model."""
    from safetensors import safe_open

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no *.safetensors files")
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                yield name, plan.read(name, handle.get_slice(name))
