"""Log-probabilities for the OpenAI `logprobs` and `echo` options.

Always the log-softmax of the RAW model logits (before logit_bias, penalties, temperature and
top-k/top-p), as vLLM returns by default: they describe the model's distribution, which is what
log-likelihood evaluation wants, and they do not change when a client tunes its sampler. A row
under a grammar is the exception, as in vLLM: its logits are masked before anything else, so its
logprobs are over the tokens the grammar allows, and the alternatives leave out the forbidden
ones (-inf, which JSON cannot carry) even when fewer than asked remain.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from yaied.core.request import TokenLogprobs

# Prompt rows are scored this many at a time, so a long chunk never holds a [rows, vocab]
# logits tensor for all of its rows at once (2,048 rows x 49k vocab would be 400 MB in fp32).
PROMPT_ROWS_PER_PASS = 256
_NEG_INF = float("-inf")


def token_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]
) -> list[TokenLogprobs]:
    """logits: [rows, vocab] raw fp32; token_ids: [rows] the token each row scores; num_top[i]
    alternatives for row i. One host copy per output tensor."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)
    k = min(max(num_top, default=0), logprobs.shape[-1])
    ids, chosen_lp = token_ids.tolist(), chosen.tolist()
    if k == 0:
        return [TokenLogprobs(t, lp, [], []) for t, lp in zip(ids, chosen_lp, strict=True)]
    top_lp, top_ids = logprobs.topk(k, dim=-1)  # sorted, most likely first
    top_ids_list, top_lp_list = top_ids.tolist(), top_lp.tolist()
    out = []
    for i, (t, lp, n) in enumerate(zip(ids, chosen_lp, num_top, strict=True)):
        row_lp = top_lp_list[i][:n]
        if row_lp and row_lp[-1] == _NEG_INF:  # a masked row with fewer allowed tokens than n
            n = next(j for j, v in enumerate(row_lp) if v == _NEG_INF)
        out.append(TokenLogprobs(t, lp, top_ids_list[i][:n], row_lp[:n]))
    return out


def sampled_logprobs(
    logits: torch.Tensor, token_ids: torch.Tensor, num_logprobs: list[int | None]
) -> list[TokenLogprobs | None] | None:
    """Logprobs of the sampled tokens for the rows that asked (num_logprobs[i] not None), aligned
    with the rows; None when no row asked, so a plain step does no extra work."""
    rows = [i for i, n in enumerate(num_logprobs) if n is not None]
    if not rows:
        return None
    num_top = [num_logprobs[i] or 0 for i in rows]
    if len(rows) == len(num_logprobs):  # every row asked: no [rows, vocab] copy
        found = token_logprobs(logits, token_ids, num_top)
    else:
        index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        found = token_logprobs(logits[index], token_ids[index], num_top)
    out: list[TokenLogprobs | None] = [None] * len(num_logprobs)
    for row, entry in zip(rows, found, strict=True):
        out[row] = entry
    return out


def prompt_logprobs(
    hidden: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    rows: list[int],
    targets: list[int],
    num_top: list[int],
) -> list[TokenLogprobs]:
    """Score targets[i] with the logits of hidden row rows[i], PROMPT_ROWS_PER_PASS rows at a
    time. hidden: [num_tokens, hidden_size], the model's final hidden states for the step."""
    device = hidden.device
    out: list[TokenLogprobs] = []
    for start in range(0, len(rows), PROMPT_ROWS_PER_PASS):
        end = start + PROMPT_ROWS_PER_PASS
        index = torch.tensor(rows[start:end], dtype=torch.int64, device=device)
        logits = compute_logits(hidden[index])
        wanted = torch.tensor(targets[start:end], dtype=torch.int64, device=device)
        out += token_logprobs(logits, wanted, num_top[start:end])
    return out
