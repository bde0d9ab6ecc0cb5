"""xgrammar's view of a model's tokenizer, built once per model (it scans the vocabulary)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from yaied.structured.backend import xgrammar

if TYPE_CHECKING:
    import xgrammar as xgr


def build_tokenizer_info(
    tokenizer: Any, vocab_size: int, stop_token_ids: Sequence[int] | None = None
) -> xgr.TokenizerInfo:
    """xgrammar's view of the tokenizer, over the model's `vocab_size` rows (padded rows past
    the tokenizer's vocabulary are never allowed).

    `from_huggingface` takes every vocabulary entry as text, added special tokens included, so a
    grammar would accept ``<|im_start|>`` as the characters of its name inside a JSON string, a
    token the detokenizer then drops. Blanking them (xgrammar's mark for a special token) bans
    them everywhere; the stop tokens stay allowed where the grammar may end.
    """
    xgr = xgrammar()
    stops = list(stop_token_ids) if stop_token_ids else None
    base = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=stops
    )
    from transformers import PreTrainedTokenizerFast

    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        # xgrammar encodes other tokenizers' vocabularies (tiktoken) its own way; keep it.
        return base
    # The same vocabulary xgrammar built for a fast tokenizer (get_vocab's strings, in id
    # order), with the special tokens blanked.
    encoded = [""] * vocab_size
    for token, index in tokenizer.get_vocab().items():
        if index < vocab_size:
            encoded[index] = token
    keep = set(base.stop_token_ids)
    for index, added in getattr(tokenizer, "added_tokens_decoder", {}).items():
        if added.special and index < vocab_size and index not in keep:
            encoded[index] = ""
    return xgr.TokenizerInfo(
        encoded,
        vocab_type=base.vocab_type,
        vocab_size=vocab_size,
        stop_token_ids=list(base.stop_token_ids),
        add_prefix_space=base.add_prefix_space,
    )
