"""Input processing: prompts to token ids and sampling parameters, validated before queueing.

Every check that can reject a request lives here, so a bad request raises ValueError in the caller
and never reaches the scheduler or the worker.
"""

from __future__ import annotations

from yaied.core.model_info import ModelInfo
from yaied.core.request import Request, SamplingParams
from yaied.engine.detokenizer import IncrementalDetokenizer
from yaied.worker import model_files
from yaied.worker.loader import LoadedModel


class InputProcessor:
    def __init__(self, loaded: LoadedModel, info: ModelInfo) -> None:
        self.info = info
        self.tokenizer = None
        self.eos_token_ids: frozenset[int] = frozenset()
        self.generation_defaults: dict[str, float | int] = {}
        if loaded.folder is not None:
            self.eos_token_ids = model_files.find_eos_token_ids(loaded.folder, loaded.hf_config)
            self.generation_defaults = model_files.load_generation_defaults(loaded.folder)
            if (loaded.folder / "tokenizer_config.json").exists() or (
                loaded.folder / "tokenizer.json"
            ).exists():
                self.tokenizer = model_files.load_tokenizer(loaded.folder)
        else:
            eos = getattr(loaded.hf_config, "eos_token_id", None)
            eos_ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
            self.eos_token_ids = frozenset(eos_ids)

    def default_params(self, **overrides: object) -> SamplingParams:
        """SamplingParams with the model's generation_config defaults under explicit overrides."""
        known = set(SamplingParams.__dataclass_fields__)
        values = {k: v for k, v in self.generation_defaults.items() if k in known}
        values.update(overrides)
        return SamplingParams.from_kwargs(**values)

    def sampling_params(
        self, params: SamplingParams | None, sampling: dict[str, object]
    ) -> SamplingParams:
        if params is not None and sampling:
            raise ValueError("pass either a SamplingParams or sampling keywords, not both")
        if params is None:
            return self._checked_against_model(self.default_params(**sampling))
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        return self._checked_against_model(params)

    def _checked_against_model(self, params: SamplingParams) -> SamplingParams:
        vocab = self.info.vocab_size
        for token, _ in params.logit_bias:
            if token >= vocab:
                raise ValueError(f"logit_bias names token {token}, beyond the vocabulary ({vocab})")
        for token in params.stop_token_ids:
            if token >= vocab:
                raise ValueError(f"stop_token_ids names {token}, beyond the vocabulary ({vocab})")
        return params

    def prompt_token_ids(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass prompts as token-id lists")
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, list | tuple):
            ids = list(prompt)
            vocab = self.info.vocab_size
            for token in ids:
                if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab:
                    raise ValueError(
                        f"prompt token ids must be integers in [0, {vocab}), got {token!r}"
                    )
        else:
            raise ValueError(
                f"prompt must be a string or a list of token ids, got {type(prompt).__name__}"
            )
        if not ids:
            raise ValueError("the prompt is empty")
        limit = self.info.max_model_len
        if len(ids) + params.max_tokens > limit:
            raise ValueError(
                f"prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
                f"model's context length of {limit} tokens"
            )
        return ids

    def detokenizer(self, request: Request) -> IncrementalDetokenizer | None:
        if self.tokenizer is None:
            return None
        params = request.params
        return IncrementalDetokenizer(
            self.tokenizer,
            request.prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )
