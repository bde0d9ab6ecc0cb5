"""Whether a request stops at the token just appended to its output: the one place the stop
conditions live (grammar, EOS and stop token ids under min_tokens, max_tokens, the context
limit), for plain and speculative decodes alike (scheduler.update)."""

from __future__ import annotations

from yaied.core.request import FinishReason, Request


def stop_reason(request: Request, token: int, max_model_len: int) -> FinishReason | None:
    # The grammar advances where the token is appended, so it has accepted exactly the
    # output (a preemption keeps both). A refused token fails this request alone (the engine
    # reports the matcher's error); a terminated grammar (it accepted EOS where it may end)
    # is a stop, whatever min_tokens or ignore_eos say: the output is complete.
    grammar = request.grammar
    if grammar is not None:
        if not grammar.accept(token):
            return FinishReason.ERROR
        if grammar.is_terminated:
            return FinishReason.STOP
    # min_tokens holds off EOS and stop token ids (the sampler also bans them until then).
    may_stop = len(request.output_token_ids) >= request.params.min_tokens
    if may_stop and (token in request.eos_token_ids or token in request.stop_ids):
        return FinishReason.STOP
    if len(request.output_token_ids) >= request.params.max_tokens:
        return FinishReason.LENGTH
    if request.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
