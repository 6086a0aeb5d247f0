"""Tool (function) calling: the tools a request offers, the calls parsed out of a model's reply per model family
(Hermes / Qwen2.5 `<tool_call>` JSON, Llama 3.x JSON, Mistral `[TOOL_CALLS]`), the grammar that forces a call when
one is required, and the prompt for chat templates that know no tools."""

from leanlm.tool_calls.call import ParsedReply, Tool, ToolCall, new_call_id
from leanlm.tool_calls.constraint import required_call_grammar
from leanlm.tool_calls.parsers import PARSERS, ToolCallParser, parser_for_template
from leanlm.tool_calls.prompt import has_tool_turns, messages_for_template
from leanlm.tool_calls.streamer import ToolCallStreamer

__all__ = [
    "PARSERS",
    "ParsedReply",
    "Tool",
    "ToolCall",
    "ToolCallParser",
    "ToolCallStreamer",
    "has_tool_turns",
    "messages_for_template",
    "new_call_id",
    "parser_for_template",
    "required_call_grammar",
]
