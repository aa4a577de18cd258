"""Tool calling: parsing a model's tool-call syntax out of its text (`parser.py`), and turning OpenAI
tool messages and tool lists into chat-template input, with the request checks (`messages.py`)."""
from sudu.tools.messages import (check_tool_choice, check_tool_messages, check_tools, fallback_messages,
                                 supports_tools, template_messages)
from sudu.tools.parser import (ContentDelta, ToolCall, ToolCallArgsDelta, ToolCallStart, ToolCallStreamParser,
                               detect_format, new_call_id, parse_tool_calls)

__all__ = ["ContentDelta", "ToolCall", "ToolCallArgsDelta", "ToolCallStart", "ToolCallStreamParser",
           "check_tool_choice", "check_tool_messages", "check_tools", "detect_format", "fallback_messages",
           "new_call_id", "parse_tool_calls", "supports_tools", "template_messages"]
