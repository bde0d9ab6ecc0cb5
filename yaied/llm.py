"""``LLM``: the synchronous face of the engine, for scripts and benchmarks.

It runs an AsyncEngine on a private event loop; ``generate`` submits every prompt at once, so
they are batched continuously exactly as concurrent HTTP requests would be.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from pathlib import Path

from yaied.core.config import EngineConfig, load_config
from yaied.core.request import RequestOutput, SamplingParams
from yaied.engine.async_engine import AsyncEngine


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str | None = None,
        config_path: str | None = None,
        show_progress: bool = True,
        **overrides: object,
    ) -> None:
        """``overrides`` are config settings by name (``max_num_seqs=8``) or ``section.key``."""
        settings = dict(overrides)
        if model is not None:
            settings["model.model"] = model
        if dtype is not None:
            settings["model.dtype"] = dtype
        self.config: EngineConfig = load_config(config_path, overrides=settings)
        self.engine = AsyncEngine(self.config, show_progress=show_progress)
        self._loop = asyncio.new_event_loop()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def hf_config(self):
        return self.engine.worker.loaded.hf_config

    @property
    def model_folder(self) -> Path | None:
        return self.engine.worker.loaded.folder

    @property
    def vocab_size(self) -> int:
        return self.engine.info.vocab_size

    def stats(self) -> dict[str, int | float]:
        return self.engine.stats()

    def generate(
        self,
        prompts: str | list[int] | Sequence[str | list[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        **sampling: object,
    ) -> list[RequestOutput]:
        """Generate for each prompt (a string or a token-id list); outputs come in prompt order."""
        if self._loop.is_closed():  # else asyncio's "Event loop is closed", a coroutine leaked
            raise RuntimeError("this LLM is closed (close() was called); make a new one")
        if not isinstance(prompts, str | Sequence):
            raise TypeError(
                "prompts must be a string, a token-id list, or a list of those, got "
                f"{type(prompts).__name__}"
            )
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params_list = [params] * len(prompts)
        else:
            params_list = list(params)
            if len(params_list) != len(prompts):
                raise ValueError("give one SamplingParams, or one per prompt")
        # Validate everything before queueing anything, so a bad prompt rejects the whole call.
        inputs = self.engine.inputs
        resolved = [inputs.sampling_params(p, dict(sampling)) for p in params_list]
        # Tokenized once here; the engine gets the ids, so nothing is tokenized twice.
        prompt_ids = [
            inputs.prompt_token_ids(prompt, p) for prompt, p in zip(prompts, resolved, strict=True)
        ]
        # Grammars compile here (a bad spec raises), so the engine finds them in the cache.
        for spec in dict.fromkeys(p.structured for p in resolved if p.structured is not None):
            inputs.grammars.compile_sync(spec)
        return self._loop.run_until_complete(self._generate_all(prompt_ids, resolved))

    async def _generate_all(
        self, prompts: list[list[int]], params: list[SamplingParams]
    ) -> list[RequestOutput]:
        pairs = zip(prompts, params, strict=True)
        return list(await asyncio.gather(*(self._collect(p, sp) for p, sp in pairs)))

    async def _collect(self, prompt_ids: list[int], params: SamplingParams) -> RequestOutput:
        token_ids: list[int] = []
        text: list[str] = []
        logprobs: list = []
        prompt_logprobs = None
        async for event in self.engine.generate(prompt_ids, params):
            token_ids += event.token_ids
            text.append(event.text)
            logprobs += event.logprobs or []
            prompt_logprobs = prompt_logprobs or event.prompt_logprobs
            last = event
        return RequestOutput(
            request_id=last.request_id,
            prompt_token_ids=prompt_ids,
            token_ids=token_ids,
            text="".join(text),
            finish_reason=last.finish_reason,
            stop_reason=last.stop_reason,
            num_cached_tokens=last.num_cached_tokens,
            error=last.error,
            logprobs=logprobs if params.logprobs is not None else None,
            prompt_logprobs=prompt_logprobs,
        )

    def close(self) -> None:
        if not self._loop.is_closed():
            self._loop.run_until_complete(self.engine.shutdown())
            self._loop.close()

    def __del__(self) -> None:
        # Scripts often drop an LLM without close(); stop the engine task quietly then.
        loop = getattr(self, "_loop", None)
        if loop is not None and not loop.is_closed() and not loop.is_running():
            with contextlib.suppress(Exception):
                self.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
