"""The context length the router takes calls up to, and which engines can hold a call.

Engines of one pool may hold different context lengths: a remote daemon run with a smaller
``max_model_len``, a local engine with a larger one. The front end (``inputs``) checks each call
against the largest any engine in the pool (not draining) holds, so a call that fits one of them
is taken and one that fits none is a 400 naming that length; the router then sends a call only
to engines that hold it (its prompt plus ``max_tokens``, the prompt alone for an embedding).

The largest follows the pool: an engine that starts, is drained or removed, or a remote that
reports another length at its next probe, changes it at once, and with it what ``/v1/models``
and ``/tokenize`` say. An engine that has reported no length (0: a remote daemon of another
kind) is sent any call, and the front end's own limit stands while no engine reports one.

A mixin of ``EngineManager`` (like pool.py), so that manager.py stays about calls.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING

from yaied.core.model_info import ModelInfo
from yaied.router.handle import Health

if TYPE_CHECKING:
    from yaied.core.request import SamplingParams
    from yaied.engine.inputs import InputProcessor
    from yaied.router.handle import EngineHandle
    from yaied.router.pool import PoolEntry


def call_length(num_prompt_tokens: int, params: SamplingParams) -> int:
    """The context a call needs: its prompt, and what it may generate (an embedding, nothing)."""
    return num_prompt_tokens + (0 if params.pooling else params.max_tokens)


def holds(handle: EngineHandle, length: int) -> bool:
    """Whether the engine can take a call needing ``length`` tokens (unknown: it may)."""
    limit = 0 if handle.info is None else handle.info.max_model_len
    return limit <= 0 or length <= limit


class ContextLimits:
    # The manager's tables this mixin reads (manager.py, pool.py).
    handles: dict[str, EngineHandle]
    pool: dict[str, PoolEntry]

    _front: InputProcessor | None = None
    _front_limit = 0  # the context length the front end was made with

    @property
    def inputs(self) -> InputProcessor | None:
        """The front end (tokenize and validate), under the pool's context length now."""
        front = self._front
        if front is None:
            return None
        limit = self.context_limit()
        if front.info.max_model_len != limit:  # a copy: the one given may be an engine's own
            front = copy.copy(front)
            front.info = dataclasses.replace(front.info, max_model_len=limit)
            self._front = front
        return front

    @inputs.setter
    def inputs(self, front: InputProcessor | None) -> None:
        self._front = front
        self._front_limit = 0 if front is None else front.info.max_model_len

    @property
    def info(self) -> ModelInfo | None:
        """The limits calls are checked against (``/v1/models`` shows its max_model_len)."""
        front = self.inputs
        return None if front is None else front.info

    def context_limit(self) -> int:
        """The largest context length an engine in the pool (not draining) reported; the front
        end's own while none has."""
        return max(self._reported(up_only=False), default=self._front_limit)

    def room_for(self, num_prompt_tokens: int) -> int:
        """What a call of this prompt may generate when it does not say (chat's default
        max_tokens): the context left on the smallest engine up that holds the prompt, so the
        call may go to any of them. From the largest, it could go to the largest engine only,
        and while that one was down to none. The pool's largest while no engine up holds it."""
        fits = [n for n in self._reported(up_only=True) if n > num_prompt_tokens]
        return (min(fits) if fits else self.context_limit()) - num_prompt_tokens

    def _reported(self, *, up_only: bool) -> list[int]:
        """The context lengths engines of the pool (not draining; up, with ``up_only``) have
        reported. A snapshot: the front end runs on worker threads too, while the loop adds and
        removes engines."""
        handles, pool = list(self.handles.items()), dict(self.pool)
        return [
            handle.info.max_model_len
            for engine_id, handle in handles
            if handle.info is not None
            and handle.info.max_model_len > 0
            and engine_id in pool
            and not pool[engine_id].draining
            and (not up_only or handle.health is Health.UP)
        ]
