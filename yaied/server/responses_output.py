"""The response object of ``/v1/responses`` as it is being made (``Turn``): its ids, output items,
body, status and the conversation the next turn continues; and its typed SSE events
(``SSEWriter``, ``block_events``). responses_api.py runs the call and stores what this builds.

Items get ids that name their response (``msg_<response>_<n>`` for output n,
``msg_<response>_in<n>`` for input n; ``fc``, ``fco``, ``rs`` for calls, call outputs and
reasoning), so an ``item_reference`` in a later input finds its stored response without an
index of its own.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from yaied.server.agent_output import Block, BlockEvent, Blocks, finish_kind
from yaied.server.agent_run import AgentRun
from yaied.server.responses import chat_logprobs
from yaied.server.responses_protocol import ResponsesRequest
from yaied.tools.custom import InputStream, input_of

_ITEM_PREFIX = {"reasoning": "rs", "text": "msg", "tool_call": "fc"}
_INPUT_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco",
                 "reasoning": "rs", "custom_tool_call": "ctc",
                 "custom_tool_call_output": "ctco"}  # fmt: skip


class Turn:
    """One response being made: its request, ids and the blocks its output has so far."""

    def __init__(self, req: ResponsesRequest, response_id: str, model: str) -> None:
        self.req = req
        self.id = response_id
        self.model = model
        self.created = int(time.time())
        self.completed_at: int | None = None  # set once, when it has completed
        self.blocks = Blocks()
        self.input_streams: dict[int, InputStream] = {}  # custom calls' inputs, by block index
        self.run: AgentRun | None = None  # the call, once started: its logprobs
        # the status the response ends with, once known: its items' status (_item_status)
        self.ending = "completed"
        self.history: list[dict[str, Any]] = []  # the stored conversation before this turn
        self.chain_id = response_id
        # this turn's input items, each with an id (the client's, or one naming this response)
        self.input_items = [
            item
            if "id" in item
            else {"id": f"{_INPUT_PREFIX[item['type']]}_{response_id[5:]}_in{i}", **item}
            for i, item in enumerate(req.input_items)
        ]

    def is_custom(self, block: Block) -> bool:
        """A call of a custom tool: a ``custom_tool_call`` item with the decoded input."""
        return block.kind == "tool_call" and block.name in self.req.custom_tools

    def tool_name(self, block: Block) -> dict[str, str]:
        """A call's ``name``, and its ``namespace`` when the tool is in one."""
        if block.name in self.req.namespaced:
            namespace, name = self.req.namespaced[block.name]
            return {"name": name, "namespace": namespace}
        return {"name": block.name}

    def item_id(self, block: Block) -> str:
        prefix = "ctc" if self.is_custom(block) else _ITEM_PREFIX[block.kind]
        return f"{prefix}_{self.id[5:]}_{block.index}"

    def item(self, block: Block, done: bool = True, ending: str | None = None) -> dict[str, Any]:
        """``block`` as an output item; ``ending``: the response's status (``self.ending``)."""
        status = self._item_status(block, ending or self.ending) if done else "in_progress"
        text = block.text if done else ""
        if block.kind == "reasoning":
            content = [{"type": "reasoning_text", "text": text}] if done else []
            return {"type": "reasoning", "id": self.item_id(block), "summary": [],
                    "content": content, "status": status}  # fmt: skip
        if self.is_custom(block):
            return {"type": "custom_tool_call", "id": self.item_id(block), "status": status,
                    "call_id": block.call_id, **self.tool_name(block),
                    "input": input_of(text) if done else ""}  # fmt: skip
        if block.kind == "tool_call":
            return {"type": "function_call", "id": self.item_id(block), "call_id": block.call_id,
                    **self.tool_name(block), "arguments": text, "status": status}  # fmt: skip
        content = [text_part(text, self.logprobs(everything=True))] if done else []
        return {"type": "message", "id": self.item_id(block), "status": status,
                "role": "assistant", "content": content}  # fmt: skip

    def _item_status(self, block: Block, ending: str) -> str:
        """OpenAI's item status, the item's own: the one a response that did not complete
        stopped in (the last: a block stays open until the next begins or the output ends) is
        incomplete, whether max_output_tokens cut it or the call failed or was cancelled;
        those finished before it are completed, as their streamed output_item.done said
        (an event sent is never taken back)."""
        last = self.blocks.blocks[-1] if self.blocks.blocks else None
        return "completed" if ending == "completed" or block is not last else "incomplete"

    def logprobs(self, everything: bool = False) -> list[dict[str, Any]]:
        """The output text's token logprobs when asked for (responses_protocol: only without
        tools or a reasoning parser, so every token is the text's): those no delta has carried
        yet, or all of them."""
        run = self.run
        if run is None or self.req.parsed.logprobs is None:
            return []
        if everything:
            return chat_logprobs(run.choice.names, run.choice.chat_logprobs)["content"]
        taken, run.new_logprobs = run.new_logprobs, []
        return chat_logprobs(run.choice.names, taken)["content"]

    def body(self, status: str, run: AgentRun | None = None) -> dict[str, Any]:
        req, done = self.req, status not in ("queued", "in_progress")
        output = [self.item(block, ending=status) for block in self.blocks.blocks]
        if not done and output:  # the output so far: the last item is still being written
            output[-1]["status"] = "in_progress"
        body: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "model": self.model, "output": output, "error": None, "incomplete_details": None,
            "instructions": req.instructions, "metadata": req.metadata,
            "max_output_tokens": req.parsed.max_tokens,
            "temperature": req.parsed.sampling.get("temperature"),
            "top_p": req.parsed.sampling.get("top_p"),
            "parallel_tool_calls": req.parsed.tools.parallel, "tool_choice": req.tool_choice,
            "tools": req.tools, "text": {"format": req.text_format}, "truncation": req.truncation,
            "previous_response_id": req.previous_response_id, "store": req.store,
            "reasoning": {"effort": req.effort, "summary": None}, "user": req.parsed.user,
            "usage": None, "background": req.background,
        }  # fmt: skip
        if status == "incomplete":
            body["incomplete_details"] = {"reason": "max_output_tokens"}
        if status == "completed" and self.completed_at is None:
            self.completed_at = int(time.time())
        body["completed_at"] = self.completed_at if status == "completed" else None
        conversation = req.conversation_id
        body["conversation"] = None if conversation is None else {"id": conversation}
        if done:
            body["output_text"] = "".join(b.text for b in self.blocks.blocks if b.kind == "text")
        if run is not None:
            prompt, output_tokens, cached = run.usage
            # cache_write_tokens: the newer client's model requires it (None in its place
            # breaks arithmetic); 0 as /v1/messages' cache_creation_input_tokens: no token
            # is billed for its write, the radix cache keeps what it prefills on its own
            details = {"cached_tokens": cached, "cache_write_tokens": 0}
            body["usage"] = {
                "input_tokens": prompt, "input_tokens_details": details,
                "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + output_tokens,
            }  # fmt: skip
        return body

    def status(self, run: AgentRun) -> str:
        kind = finish_kind(run.choice.finish_reason, self.blocks.blocks)
        return "incomplete" if kind == "length" else "completed"

    def conversation(self) -> list[dict[str, Any]]:
        """What the next turn continues: the history, this input, this output (no reasoning,
        no instructions)."""
        blocks = self.blocks.blocks
        calls = [
            {"id": b.call_id, "type": "function", "function": {"name": b.name, "arguments": b.text}}
            for b in blocks
            if b.kind == "tool_call"
        ]
        reply: dict[str, Any] = {"role": "assistant"}
        reply["content"] = "".join(b.text for b in blocks if b.kind == "text")
        if calls:
            reply["tool_calls"] = calls
        return [*self.history, *self.req.new_messages, reply]


def item_id_prefix(item: dict[str, Any]) -> str:
    """The prefix of an item id of this type (``msg``, ``fc``, ...)."""
    return _INPUT_PREFIX.get(item.get("type", "message"), "item")


def text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


class SSEWriter:
    """SSE events as OpenAI sends them: ``event: <type>`` and the JSON with sequence_number."""

    def __init__(self) -> None:
        self.sequence = 0

    def __call__(self, kind: str, **fields: Any) -> bytes:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"


def block_events(turn: Turn, write: SSEWriter, event: BlockEvent) -> list[bytes]:
    block, at = event.block, {"output_index": event.block.index}
    item_id = turn.item_id(block)
    if event.action == "start":
        out = [write("response.output_item.added", item=turn.item(block, done=False), **at)]
        if block.kind == "text":
            part = text_part("")
            out.append(write("response.content_part.added", item_id=item_id, content_index=0,
                             part=part, **at))  # fmt: skip
        return out
    if event.action == "delta":
        if turn.is_custom(block):  # the input's text, decoded from the arguments' JSON
            text = turn.input_streams.setdefault(block.index, InputStream()).feed(event.delta)
            if not text:
                return []
            return [write("response.custom_tool_call_input.delta", item_id=item_id, delta=text,
                          **at)]  # fmt: skip
        if block.kind == "tool_call":
            kind, extra = "response.function_call_arguments.delta", {}
        elif block.kind == "text":
            kind, extra = "response.output_text.delta", {"content_index": 0,
                                                          "logprobs": turn.logprobs()}  # fmt: skip
        else:
            kind, extra = "response.reasoning_text.delta", {"content_index": 0}
        return [write(kind, item_id=item_id, delta=event.delta, **extra, **at)]
    text, out = block.text, []
    if turn.is_custom(block):
        rest = turn.input_streams.setdefault(block.index, InputStream()).rest(text)
        if rest:  # what the stream held back: all of it if the arguments had another shape
            out.append(write("response.custom_tool_call_input.delta", item_id=item_id,
                             delta=rest, **at))  # fmt: skip
        out.append(write("response.custom_tool_call_input.done", item_id=item_id,
                         input=input_of(text), **at))  # fmt: skip
    elif block.kind == "tool_call":
        out.append(write("response.function_call_arguments.done", item_id=item_id,
                         **turn.tool_name(block), arguments=text, **at))  # fmt: skip
    elif block.kind == "text":
        logprobs = turn.logprobs(everything=True)
        out.append(write("response.output_text.done", item_id=item_id, content_index=0,
                         text=text, logprobs=logprobs, **at))  # fmt: skip
        out.append(write("response.content_part.done", item_id=item_id, content_index=0,
                         part=text_part(text, logprobs), **at))  # fmt: skip
    else:
        out.append(write("response.reasoning_text.done", item_id=item_id, content_index=0,
                         text=text, **at))  # fmt: skip
    out.append(write("response.output_item.done", item=turn.item(block), **at))
    return out
