"""The one input path: chat template, tokenization and validation, run once per request.

Every caller that turns user input into an engine call goes through an InputProcessor: the HTTP
server (through the router's manager, which owns one for the model it serves), the offline API
(`LLM`, `AsyncEngine.generate`) and the CLI. Every check that can reject a request lives here, so
a bad request raises ValueError (an InputError naming its field where one is known) in the caller
and never reaches the scheduler or the worker; the engine trusts what it is then given.

It reads the model's folder (tokenizer, generation defaults, EOS ids) and config, never its
weights, so the router builds one for engines that run in other processes or machines.

A constrained request's grammar is compiled through ``grammars`` (engine/grammar.py) before it is
queued: the caller awaits ``grammars.compile``, so an invalid or too slow spec is a ValueError
naming its field, and the engine then finds the grammar in the cache.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from yaied.core.config import ModelConfig
from yaied.core.detokenizer import IncrementalDetokenizer
from yaied.core.errors import ContextLengthError, InputError
from yaied.core.model_info import ModelInfo
from yaied.core.request import Request, SamplingParams
from yaied.engine.grammar import Grammars
from yaied.engine.prompt_encoder import PromptEncoder
from yaied.tools import FALLBACK_FORMAT, needs_fallback, render_fallback
from yaied.worker import model_files


class InputProcessor:
    def __init__(self, folder: Path | None, hf_config: Any, info: ModelInfo) -> None:
        """``folder`` holds the tokenizer and generation config (None for a model built from a
        bare config, which takes token-id prompts only); ``info`` gives the limits."""
        self.info = info
        self.tokenizer = None
        self._prompt_encoder: PromptEncoder | None = None
        self.eos_token_ids: frozenset[int] = frozenset()
        self.generation_defaults: dict[str, float | int] = {}
        if folder is not None:
            self.eos_token_ids = model_files.find_eos_token_ids(folder, hf_config)
            self.generation_defaults = model_files.load_generation_defaults(folder)
            if (folder / "tokenizer_config.json").exists() or (folder / "tokenizer.json").exists():
                self.tokenizer = model_files.load_tokenizer(folder)
                self._prompt_encoder = PromptEncoder(self.tokenizer)
        else:
            eos = getattr(hf_config, "eos_token_id", None)
            eos_ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
            self.eos_token_ids = frozenset(eos_ids)
        # The compiler is built on the first constrained request (it needs the tokenizer).
        self.grammars = Grammars(self.tokenizer, info.vocab_size, self.eos_token_ids)

    # -- sampling parameters -------------------------------------------------------------------

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

    # -- prompts -------------------------------------------------------------------------------

    @property
    def prompt_encoder(self) -> PromptEncoder:
        """Tokenizes chat prompts in cached pieces (the tokenizer's, rebuilt if it is swapped)."""
        if self._prompt_encoder is None or self._prompt_encoder.tokenizer is not self.tokenizer:
            self._prompt_encoder = PromptEncoder(self.tokenizer)
        return self._prompt_encoder

    def prompt_token_ids(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """A prompt (text or token ids) as checked token ids that fit the context with
        ``params.max_tokens`` (an embedding, ``params.pooling``, decodes nothing: its input may
        fill the context)."""
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
        self.check_fits(len(ids), 0 if params.pooling else params.max_tokens)
        return ids

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """``max_tokens`` 0: the prompt alone (an embedding's input)."""
        limit = self.info.max_model_len
        if num_prompt_tokens + max_tokens > limit:
            what = f" plus max_tokens ({max_tokens})" if max_tokens else ""
            raise ContextLengthError(
                f"prompt ({num_prompt_tokens} tokens){what} exceeds the model's context length "
                f"of {limit} tokens"
            )

    def has_chat_template(self, chat_template: str = "") -> bool:
        return self.tokenizer is not None and bool(
            chat_template or getattr(self.tokenizer, "chat_template", None)
        )

    def chat_prompt(
        self,
        messages: list[dict[str, Any]],
        chat_template: str = "",
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_format: str = FALLBACK_FORMAT,
    ) -> tuple[list[int], str]:
        """The messages through ``chat_template`` (else the tokenizer's own): token ids and text.
        With ``continue_final_message`` the text ends where the last message's content does (no
        end of turn, no generation prompt), so the output continues it: a prefill.
        ``template_kwargs`` (a request's chat_template_kwargs) are variables for the template.
        ``tools`` (OpenAI tool definitions) go to a template that renders tools; for one that
        does not, the tools and the tool history are written into the messages in
        ``tool_format`` (yaied/tools/render.py), the format the output is then parsed in.
        Not checked against the context: the caller knows max_tokens only afterwards."""
        if not self.has_chat_template(chat_template):
            raise InputError("this model has no chat template; use /v1/completions", "messages")
        from jinja2 import TemplateError  # transformers renders templates with jinja2

        template = chat_template or self.tokenizer.chat_template
        extra: dict[str, Any] = dict(template_kwargs or {})
        if needs_fallback(template if isinstance(template, str) else None, messages, tools):
            messages = render_fallback(messages, tools, fmt=tool_format)
        else:
            messages = [_with_parsed_arguments(m) for m in messages]
            if tools:
                extra["tools"] = tools
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                chat_template=chat_template or None,
                tokenize=False,
                add_generation_prompt=add_generation_prompt and not continue_final_message,
                continue_final_message=continue_final_message,
                **extra,
            )
        except TemplateError as exc:  # a template's raise_exception, say for roles out of order
            raise InputError(f"chat template: {exc}", "messages") from None
        except (TypeError, ValueError) as exc:
            if continue_final_message and "continue_final_message" in str(exc):
                # transformers' own check: the template dropped or rewrote the last message
                raise InputError(
                    "the chat template does not render the last message's content as sent, so "
                    "it cannot be continued",
                    "messages",
                ) from None
            if not template_kwargs:
                raise  # the template itself is broken: a server error
            # The template choked on a client's variable (say a string where it adds numbers).
            message = f"chat template with chat_template_kwargs: {exc}"
            raise InputError(message, "chat_template_kwargs") from None
        # The template wrote the special tokens already; adding them again doubles a BOS.
        return self.prompt_encoder.encode(text), text

    def new_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        session_id: str | None,
        priority: int,
        output_ids: Sequence[int],
        compile_now: bool,
    ) -> Request:
        """The engine's Request for checked input, with its grammar's matcher when the grammar
        is in the compile cache, or (``compile_now``, from plain code) compiled here; otherwise
        the caller compiles it and sets ``request.grammar``."""
        request = Request(
            request_id,
            list(prompt_ids),
            params,
            session_id=session_id,
            priority=priority,
            eos_token_ids=frozenset() if params.ignore_eos else self.eos_token_ids,
            output_token_ids=list(output_ids),
        )
        spec = params.structured
        if spec is not None:
            request.grammar = self.grammars.matcher(spec)
            if request.grammar is None and compile_now:
                request.grammar = self.grammars.matcher_of(self.grammars.compile_sync(spec))
        return request

    # -- output ----------------------------------------------------------------------------------

    def detokenizer(self, request: Request) -> IncrementalDetokenizer | None:
        params = request.params
        if self.tokenizer is None or params.pooling is not None:
            return None  # an embedding has no text
        return IncrementalDetokenizer(
            self.tokenizer,
            request.prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
        )


def _with_parsed_arguments(message: dict[str, Any]) -> dict[str, Any]:
    """Templates that render earlier calls write ``arguments | tojson`` (Qwen, Llama 3.1): they
    want an object, where OpenAI's history carries JSON text. Text that is not a JSON object
    stays text."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    parsed = []
    for call in calls:
        function = dict(call.get("function", {}))
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                value = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                value = None
            if isinstance(value, dict):
                function["arguments"] = value
        parsed.append({**call, "function": function})
    return {**message, "tool_calls": parsed}


def inputs_for_model(model: ModelConfig, infos: list[ModelInfo]) -> InputProcessor:
    """An InputProcessor for ``model`` under the tightest limits the engines reported: the
    router's front end for engines that run in other processes or on other machines. It reads
    the model's folder and config, never its weights."""
    from yaied.worker.loader import resolve_model_config  # deferred: it imports torch

    folder, hf_config = resolve_model_config(model)
    vocab = min((i.vocab_size for i in infos if i.vocab_size), default=0)
    max_len = min((i.max_model_len for i in infos if i.max_model_len), default=0)
    info = ModelInfo(
        max_len or model.max_model_len or hf_config.max_position_embeddings,
        vocab or hf_config.vocab_size,
    )
    return InputProcessor(folder, hf_config, info)
