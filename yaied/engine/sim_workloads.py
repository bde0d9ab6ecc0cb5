"""Synthetic agentic programs for the scheduler simulator, shaped like the Autellix paper's.

A program is a sequence of stages; the calls of a stage run in parallel, and a stage starts when
the previous one has finished. Shapes (mean calls, mean prompt / output tokens per call):

- ``chat``: about 7 sequential calls, 256 / 277 (a multi-turn conversation);
- ``react``: about 11 sequential calls, 735 / 34 (an agent loop: long observations, short actions);
- ``mcts``: about 4 waves of 2..8 parallel calls, 467 / 73 (a tree search expanding nodes);
- ``mix``: each program one of the three at random.

Program lengths (stages) are heavy-tailed around the mean by default: lognormal with sigma 1, so
most programs are short and a few are many times longer, as in agent traces. That shape is what
scheduling by attained service exploits; with memoryless (geometric) lengths, queueing theory
says no size-blind policy beats another on the mean, and ``lengths="geometric"`` shows it. Token
counts per call are uniform in [0.5, 1.5] x the mean. Programs arrive as a Poisson process.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

WORKLOADS = ("chat", "react", "mcts", "mix")
LENGTHS = ("lognormal", "geometric", "fixed")  # distributions of a program's number of stages


@dataclass(frozen=True, slots=True)
class CallSpec:
    prompt_len: int  # new prompt tokens, after the program's context
    output_len: int


@dataclass(frozen=True, slots=True)
class ProgramSpec:
    program_id: str
    kind: str
    arrival: float  # seconds
    stages: tuple[tuple[CallSpec, ...], ...]
    # Each stage's prompts extend the previous stage's first call (prompt + output), so later
    # calls hit the prefix cache when their context is still there. A context longer than
    # max_context starts over (the agent summarises its history into a fresh prompt).
    extend_context: bool = True
    max_context: int = 8192

    @property
    def num_calls(self) -> int:
        return sum(len(stage) for stage in self.stages)

    @property
    def num_output_tokens(self) -> int:
        return sum(call.output_len for stage in self.stages for call in stage)


@dataclass(frozen=True, slots=True)
class ProgramShape:
    mean_stages: float
    width: tuple[int, int]  # parallel calls per stage, inclusive range
    prompt_len: int
    output_len: int


SHAPES: dict[str, ProgramShape] = {
    "chat": ProgramShape(7, (1, 1), 256, 277),
    "react": ProgramShape(11, (1, 1), 735, 34),
    "mcts": ProgramShape(4, (2, 8), 467, 73),
}


def make_workload(
    name: str,
    *,
    num_programs: int,
    rate: float,
    seed: int = 0,
    lengths: str = "lognormal",
    extend_context: bool = True,
    token_scale: float = 1.0,
) -> list[ProgramSpec]:
    """``num_programs`` programs of the named workload, arriving at ``rate`` programs/second;
    ``token_scale`` shrinks every call's token counts (a small model on a CPU)."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    if lengths not in LENGTHS:
        raise ValueError(f"unknown length distribution {lengths!r}; known: {', '.join(LENGTHS)}")
    if not rate > 0 or num_programs < 1:
        raise ValueError("a workload needs rate > 0 and at least one program")
    rng = random.Random(seed)
    programs: list[ProgramSpec] = []
    now = 0.0
    for i in range(num_programs):
        now += rng.expovariate(rate)
        kind = rng.choice(sorted(SHAPES)) if name == "mix" else name
        stages = _stages(SHAPES[kind], lengths, token_scale, rng)
        programs.append(ProgramSpec(f"{kind}-{i}", kind, now, stages, extend_context))
    return programs


def _stages(
    shape: ProgramShape, lengths: str, scale: float, rng: random.Random
) -> tuple[tuple[CallSpec, ...], ...]:
    count = _num_stages(shape.mean_stages, lengths, rng)
    prompt, output = shape.prompt_len * scale, shape.output_len * scale
    return tuple(
        tuple(
            CallSpec(_around(prompt, rng), _around(output, rng))
            for _ in range(rng.randint(*shape.width))
        )
        for _ in range(count)
    )


def _num_stages(mean: float, lengths: str, rng: random.Random) -> int:
    if mean <= 1 or lengths == "fixed":
        return max(1, round(mean))
    if lengths == "geometric":  # 1, 2, 3... with P(n) = p (1 - p)^(n - 1), p = 1 / mean
        p = 1.0 / mean
        return 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - p))
    # Lognormal with sigma 1 and the given mean: median 0.6 x mean, 5% above 3 x mean.
    sigma = 1.0
    return max(1, round(rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)))


def _around(mean: float, rng: random.Random) -> int:
    return max(1, round(mean * rng.uniform(0.5, 1.5)))
