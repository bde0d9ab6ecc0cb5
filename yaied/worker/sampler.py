"""Sampling, vectorised over the batch: every knob is a per-row tensor, so one batch may mix greedy
and random requests with different temperatures, top-k, top-p, min-p, penalties and biases.

The order on the logits of one row (vLLM's and OpenAI's):

    raw logits -> + logit_bias -> repetition, frequency and presence penalties
               -> min_tokens bans (-inf) -> argmax for greedy rows
               -> / temperature -> top-k, top-p -> softmax -> min-p -> exponential race

Everything up to the bans is "processing" and is skipped entirely when no row asks for it, so a
batch of plain requests pays nothing for the knobs it does not use.

On a GPU the path never waits for the device: its branches follow the requests' settings, known
on the host, never a tensor's values; no op has an output shaped by the values; and the step's
settings reach the device from pinned memory, one non-blocking copy per dtype. (On CPU, where
the values already are in host memory, top-p still reads them to spare itself a full sort.) The
noise of the exponential race is a counter-based hash of (row key, token id), so a seeded row's
draws follow from its seed and position alone, with no generator per row.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields, is_dataclass, replace

import torch

from yaied.core.request import SamplingParams
from yaied.worker.penalties import PenaltyTensors, apply_penalties, build_penalties

_MASK64 = (1 << 64) - 1
_CPU = torch.device("cpu")


@dataclass(slots=True)
class SamplingTensors:
    """Per-row sampling settings, built once per step from the requests' SamplingParams. Greedy
    rows hold neutral settings (temperature 1, no top-k, top-p or min-p): argmax takes them."""

    temperature: torch.Tensor  # [rows] fp32
    top_k: torch.Tensor  # [rows] int64; vocab size where disabled
    top_p: torch.Tensor  # [rows] fp32
    min_p: torch.Tensor  # [rows] fp32
    greedy: torch.Tensor  # [rows] bool
    all_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    # Host-side facts the path branches on (a tensor's values would need a sync on a GPU):
    max_top_k: int = 0  # the largest top-k of a random row; 0: none
    top_p_reach: int = 0  # the most sorted tokens a random top-p row may keep: top_k or vocab
    # Flattened ``row * vocab + token`` keys and biases of every logit_bias entry.
    logit_bias: tuple[torch.Tensor, torch.Tensor] | None = None
    penalties: PenaltyTensors | None = None
    banned: torch.Tensor | None = None  # flattened keys set to -inf
    # [rows, 2] int32 hash keys of the seeded rows' draws (0 elsewhere) and [rows] bool which
    # rows they are; None when no row is seeded. Unseeded rows draw theirs from the generator.
    seed_keys: torch.Tensor | None = None
    seeded: torch.Tensor | None = None
    all_seeded: bool = False

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        vocab_size: int,
        device: torch.device,
        *,
        prompt_ids: Sequence[list[int] | None] | None = None,
        output_ids: Sequence[list[int] | None] | None = None,
        banned_ids: Sequence[Sequence[int]] | None = None,
        num_output_tokens: Sequence[int] | None = None,
    ) -> SamplingTensors:
        """The keyword lists are aligned with params (one entry per row); a missing list or a
        None entry means an empty history, no bans, or no output yet. Everything is built in
        host memory, then moved to `device` at once (see _to_device)."""
        greedy = [p.greedy for p in params]
        random_rows = [p for p, g in zip(params, greedy, strict=True) if not g]

        def per_row(knob: str, neutral: float) -> list[float]:
            return [neutral if g else getattr(p, knob) for p, g in zip(params, greedy, strict=True)]

        def top_k_of(p: SamplingParams) -> int:
            return p.top_k if 0 < p.top_k < vocab_size else vocab_size

        top_p_rows = [p for p in random_rows if p.top_p < 1.0]
        tensors = cls(
            temperature=_floats(per_row("temperature", 1.0)),
            top_k=torch.tensor(
                [vocab_size if g else top_k_of(p) for p, g in zip(params, greedy, strict=True)],
                dtype=torch.int64,
            ),
            top_p=_floats(per_row("top_p", 1.0)),
            min_p=_floats(per_row("min_p", 0.0)),
            greedy=torch.tensor(greedy, dtype=torch.bool),
            all_greedy=all(greedy),
            need_top_k=any(0 < p.top_k < vocab_size for p in random_rows),
            need_top_p=bool(top_p_rows),
            need_min_p=any(p.min_p > 0.0 for p in random_rows),
            max_top_k=max((p.top_k for p in random_rows if 0 < p.top_k < vocab_size), default=0),
            top_p_reach=max((top_k_of(p) for p in top_p_rows), default=0),
        )
        if any(p.logit_bias for p in params):
            tensors.logit_bias = _bias_tensors(params, vocab_size)
        if any(p.has_penalties for p in params):
            tensors.penalties = build_penalties(params, prompt_ids, output_ids, vocab_size, _CPU)
        if banned_ids is not None and any(banned_ids):
            tensors.banned = _ban_keys(banned_ids, vocab_size)
        seeded = [p.seed is not None and not g for p, g in zip(params, greedy, strict=True)]
        if any(seeded):
            counts = num_output_tokens or [0] * len(params)
            keys = [
                _seed_key(p.seed, counts[row]) if on else (0, 0)
                for row, (p, on) in enumerate(zip(params, seeded, strict=True))
            ]
            tensors.seed_keys = torch.tensor(keys, dtype=torch.int32)
            tensors.seeded = torch.tensor(seeded, dtype=torch.bool)
            tensors.all_seeded = all(seeded)
        return _to_device(tensors, torch.device(device))

    @property
    def need_processing(self) -> bool:
        return not (self.logit_bias is None and self.penalties is None and self.banned is None)


def _floats(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


def _to_device(tensors: SamplingTensors, device: torch.device) -> SamplingTensors:
    """The host-built tensors on `device`. On a GPU the tensors of one dtype are packed into one
    pinned buffer and copied with one non-blocking transfer: no pageable staging and no sync.
    The caching host allocator keeps each buffer until its copy has run."""
    if device.type == "cpu":
        return tensors
    host = list(_tensor_leaves(tensors))
    on_device: list[torch.Tensor] = list(host)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, tensor in enumerate(host):
        by_dtype.setdefault(tensor.dtype, []).append(i)
    for dtype, members in by_dtype.items():
        sizes = [host[i].numel() for i in members]
        staged = torch.empty(sum(sizes), dtype=dtype, pin_memory=device.type == "cuda")
        torch.cat([host[i].reshape(-1) for i in members], out=staged)
        parts = staged.to(device, non_blocking=True).split(sizes)
        for i, part in zip(members, parts, strict=True):
            on_device[i] = part.view(host[i].shape)
    return _with_tensors(tensors, iter(on_device))


def _tensor_leaves(value: object) -> Iterator[torch.Tensor]:
    """The tensors in value (a tensor, a tuple or a dataclass of them), depth first."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, tuple):
        for item in value:
            yield from _tensor_leaves(item)
    elif is_dataclass(value):
        for field in fields(value):
            yield from _tensor_leaves(getattr(value, field.name))


def _with_tensors(value, new: Iterator[torch.Tensor]):
    """value with its tensors replaced, in _tensor_leaves order, by those of `new`."""
    if isinstance(value, torch.Tensor):
        return next(new)
    if isinstance(value, tuple):
        return tuple(_with_tensors(item, new) for item in value)
    if is_dataclass(value):
        changes = {f.name: _with_tensors(getattr(value, f.name), new) for f in fields(value)}
        return replace(value, **changes)
    return value


def _draw_seed(seed: int, step: int) -> int:
    """A 64-bit key for draw number `step` of a request seeded with `seed`. Mixed (splitmix64
    finaliser) rather than added, so seed s at step 1 and seed s + 1 at step 0 stay unrelated."""
    x = (seed * 0x9E3779B97F4A7C15 + step + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _int32(value: int) -> int:
    """The low 32 bits of value, as a signed int32."""
    value &= 0xFFFFFFFF
    return value - (1 << 32) if value >> 31 else value


def _seed_key(seed: int, step: int) -> tuple[int, int]:
    """The (low, high) int32 hash key of draw number `step` of a request seeded with `seed`."""
    x = _draw_seed(seed, step)
    return _int32(x), _int32(x >> 32)


def _bias_tensors(
    params: Sequence[SamplingParams], vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    # Ids past the vocabulary are the engine's to reject; dropping them here keeps one bad id
    # from failing every request of the step.
    entries = [
        (row * vocab_size + token, bias)
        for row, p in enumerate(params)
        for token, bias in p.logit_bias
        if token < vocab_size
    ]
    keys, biases = zip(*entries, strict=True) if entries else ((), ())
    return torch.tensor(keys, dtype=torch.int64), _floats(list(biases))


def _ban_keys(banned_ids: Sequence[Sequence[int]], vocab_size: int) -> torch.Tensor:
    keys = [
        row * vocab_size + t for row, ids in enumerate(banned_ids) for t in ids if t < vocab_size
    ]
    return torch.tensor(keys, dtype=torch.int64)


def process_logits(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    """Bias, penalties and bans; returns a new tensor (the caller's raw logits are kept for
    logprobs), or the input itself when no row asks for any of them."""
    if not t.need_processing:
        return logits
    logits = logits.clone(memory_format=torch.contiguous_format)
    flat = logits.view(-1)
    if t.logit_bias is not None:
        keys, biases = t.logit_bias
        flat.index_add_(0, keys, biases)
    if t.penalties is not None:
        apply_penalties(logits, t.penalties)
    if t.banned is not None:
        flat.index_fill_(0, t.banned, float("-inf"))
    return logits


def sample(
    logits: torch.Tensor, t: SamplingTensors, generator: torch.Generator | None = None
) -> torch.Tensor:
    """logits: [rows, vocab] fp32, left unchanged. Returns the sampled token ids [rows] int64.
    `generator` (on the logits' device) draws the unseeded rows' noise keys."""
    logits = process_logits(logits, t)
    greedy_ids = logits.argmax(dim=-1)
    if t.all_greedy:
        return greedy_ids
    logits = logits / t.temperature.unsqueeze(1)
    if t.need_top_k or t.need_top_p:
        logits = _apply_top_k_top_p(logits, t)
    probs = torch.softmax(logits, dim=-1)
    if t.need_min_p:
        # min-p keeps tokens whose probability is at least min_p times the most likely one's.
        threshold = probs.amax(dim=-1, keepdim=True) * t.min_p.unsqueeze(1)
        probs = probs.masked_fill(probs < threshold, 0.0)
    # Sampling by the exponential race: argmax(p / E) with E ~ Exp(1) draws from p, needs no
    # renormalisation and runs the same on every device.
    # In place where it can be: probs and the scaled logits (dead now, the hash's scratch) are
    # this function's own tensors, and fresh memory costs page faults on CPU.
    keys = _noise_keys(t, probs.shape[0], probs.device, generator)
    scratch = logits.view(torch.int32) if logits.dtype == torch.float32 else None
    noise = _hashed_exp1(keys, probs.shape[1], scratch)
    sampled = probs.div_(noise).argmax(dim=-1)
    return torch.where(t.greedy, greedy_ids, sampled)


def _noise_keys(
    t: SamplingTensors, rows: int, device: torch.device, generator: torch.Generator | None
) -> torch.Tensor:
    """[rows, 2] int32 hash keys: a seeded row's from its seed and position, the others drawn
    from the generator (on the device: drawing needs no sync)."""
    if t.all_seeded:
        return t.seed_keys
    drawn = torch.randint(
        -(2**31), 2**31, (rows, 2), dtype=torch.int32, device=device, generator=generator
    )
    if t.seed_keys is None:
        return drawn
    return torch.where(t.seeded.unsqueeze(1), t.seed_keys, drawn)


# murmur3's 32-bit finaliser constants, and the 32-bit golden ratio, as signed int32.
_GOLDEN = _int32(0x9E3779B9)
_MIX1 = _int32(0x85EBCA6B)
_MIX2 = _int32(0xC2B2AE35)


def _hashed_exp1(
    keys: torch.Tensor, vocab: int, scratch: torch.Tensor | None = None
) -> torch.Tensor:
    """Exp(1) noise [rows, vocab] for the [rows, 2] int32 keys: token j of a row gets -log(u) of
    a hash of (key, j) alone, so a row's draws depend on nothing else in the batch. The hash is
    murmur3's 32-bit finaliser over the Weyl sequence key_lo + j * golden ratio, the key's high
    word mixed in after the first multiply; int32 tensor arithmetic (wrapping multiplies, logical
    shifts by masking) makes it exact and the same on every device. Its top 23 bits become the
    mantissa of a float m in [1, 2), and u = m - (1 - 2^-24) = (bits + 1/2) / 2^23 lies strictly
    inside (0, 1), so E is finite and positive. In place on one new buffer (and `scratch`, an
    int32 [rows, vocab] one, when given): cheaper than drawing uniforms from a CPU generator."""
    x = torch.arange(vocab, dtype=torch.int32, device=keys.device).mul_(_GOLDEN)
    x = x + keys[:, :1]
    scratch = torch.empty_like(x) if scratch is None else scratch
    _xor_shift_(x, 16, scratch)
    x.mul_(_MIX1).bitwise_xor_(keys[:, 1:])
    _xor_shift_(x, 13, scratch)
    x.mul_(_MIX2)
    _xor_shift_(x, 16, scratch)
    x.bitwise_right_shift_(9).bitwise_and_(0x7FFFFF).bitwise_or_(0x3F800000)  # 1.0's exponent
    return x.view(torch.float32).sub_(1.0 - 2.0**-24).log_().neg_()


def _xor_shift_(x: torch.Tensor, shift: int, scratch: torch.Tensor) -> None:
    """x ^= x >>> shift (a logical shift: the arithmetic one masked) on int32, in place."""
    torch.bitwise_right_shift(x, shift, out=scratch).bitwise_and_((1 << (32 - shift)) - 1)
    x.bitwise_xor_(scratch)


# top-k/top-p first look at this many best tokens per row (a partial sort, about 7x cheaper than
# sorting a 49k vocabulary on CPU).
TOP_CANDIDATES = 1024


def _reads_are_free(device: torch.device) -> bool:
    """Whether the sampler may branch on tensor values: only where they already are in host
    memory, so that reading them waits for nothing."""
    return device.type == "cpu"


def _apply_top_k_top_p(logits: torch.Tensor, t: SamplingTensors) -> torch.Tensor:
    vocab = logits.shape[-1]
    num = max(TOP_CANDIDATES, t.max_top_k)
    # A top-p row that no top-k caps within the candidates may need tokens past them. Only the
    # values tell: on CPU they are read, elsewhere such a batch sorts the whole vocabulary.
    uncapped = t.need_top_p and t.top_p_reach > num
    if num >= vocab or (uncapped and not _reads_are_free(logits.device)):
        return _filter_sorted(logits, *logits.sort(dim=-1, descending=True), t)
    values, order = logits.topk(num, dim=-1)  # sorted, descending
    unfiltered = (t.top_k >= vocab) & (t.top_p >= 1.0)  # rows that keep every token
    if uncapped:
        # Enough candidates when top-k already cut below them, or their share of the whole
        # distribution reaches top_p.
        mass = (values - logits.logsumexp(dim=-1, keepdim=True)).exp().sum(dim=-1)
        enough = (t.top_k <= num) | (mass >= t.top_p) | unfiltered
        if not bool(enough.all()):  # host memory: _reads_are_free
            return _filter_sorted(logits, *logits.sort(dim=-1, descending=True), t)
    filtered = _filter_sorted(logits, values, order, t)
    return torch.where(unfiltered.unsqueeze(1), logits, filtered)


def _filter_sorted(
    logits: torch.Tensor, sorted_logits: torch.Tensor, order: torch.Tensor, t: SamplingTensors
) -> torch.Tensor:
    """Apply top-k and top-p to the best tokens of each row, sorted descending (all of the
    vocabulary or a prefix of it); every token outside them gets -inf."""
    vocab = logits.shape[-1]
    ranks = torch.arange(sorted_logits.shape[-1], device=logits.device).unsqueeze(0)
    drop = ranks >= t.top_k.unsqueeze(1)
    if t.need_top_p:
        kept = sorted_logits.masked_fill(drop, float("-inf"))
        # Probabilities as top-k leaves them: within the top k where top-k is on, else over the
        # whole vocabulary (which the candidates may not all cover).
        top_k_on = (t.top_k < vocab).unsqueeze(1)
        norm = torch.where(
            top_k_on, kept.logsumexp(dim=-1, keepdim=True), logits.logsumexp(dim=-1, keepdim=True)
        )
        probs = (kept - norm).exp()
        # Keep the smallest prefix whose mass reaches top_p: drop a token when the mass before
        # it already does. The top token is always kept; top_p = 1 keeps every token (the mass
        # may round up to 1 before the last one).
        mass_before = probs.cumsum(dim=-1) - probs
        top_p = t.top_p.unsqueeze(1)
        drop |= (mass_before >= top_p) & (top_p < 1.0)
    drop[:, 0].fill_(False)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.full_like(logits, float("-inf")).scatter_(1, order, sorted_logits)
