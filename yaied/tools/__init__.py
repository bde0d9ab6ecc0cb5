"""Tool calling and reasoning output, as text processing only.

Pure Python with no torch import, so the server layer can use it: formats as data
(`formats`), the streaming tool-call parser (`parser`), the reasoning splitter (`reasoning`) and
the fallback renderer for templates without tool support (`render`).

Per generated message the server chains them: deltas -> ReasoningParser (when a reasoning parser
is configured) -> its content part -> ToolCallParser (when the request has tools) -> events.
"""

from yaied.tools.events import (
    ContentDelta,
    ParsedMessage,
    ToolCall,
    ToolCallArguments,
    ToolCallEnd,
    ToolCallStart,
    ToolEvent,
    finish_reason,
    new_call_id,
)
from yaied.tools.formats import (
    FALLBACK_FORMAT,
    FORMATS,
    HERMES,
    LLAMA3_JSON,
    ToolCallFormat,
    detect_format,
    get_format,
)
from yaied.tools.parser import ToolCallParser, parse_tool_calls
from yaied.tools.reasoning import (
    ReasoningDelta,
    ReasoningParser,
    ReasoningResult,
    prompt_opens_reasoning,
)
from yaied.tools.render import (
    needs_fallback,
    render_fallback,
    template_supports_tools,
    tools_prompt,
)

__all__ = [
    "FALLBACK_FORMAT",
    "FORMATS",
    "HERMES",
    "LLAMA3_JSON",
    "ContentDelta",
    "ParsedMessage",
    "ReasoningDelta",
    "ReasoningParser",
    "ReasoningResult",
    "ToolCall",
    "ToolCallArguments",
    "ToolCallEnd",
    "ToolCallFormat",
    "ToolCallParser",
    "ToolCallStart",
    "ToolEvent",
    "detect_format",
    "finish_reason",
    "get_format",
    "needs_fallback",
    "new_call_id",
    "parse_tool_calls",
    "prompt_opens_reasoning",
    "render_fallback",
    "template_supports_tools",
    "tools_prompt",
]
