"""A reply's tool calls while it streams: text before a call section goes out at once (holding back only what may be
the start of one), each call as soon as the family's syntax closes it, the rest when the reply ends."""

from __future__ import annotations

from leanlm.tool_calls.call import ToolCall
from leanlm.tool_calls.parsers import ToolCallParser


class ToolCallStreamer:
    """Feed the reply's text deltas; each step gives (text to send, calls to send)."""

    def __init__(self, parser: ToolCallParser) -> None:
        self.parser = parser
        self.text = ""  # the reply so far
        self.num_sent_chars = 0  # text before the call section that went out as content
        self.section_start: int | None = None  # where the call section begins, once it has
        self.num_sent_calls = 0

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.text += delta
        if self.section_start is None:
            start = self.parser.find_start(self.text)
            if start is None:
                return self._send_content(self.parser.hold_from(self.text)), []
            self.section_start = start
            content = self._send_content(start)
        else:
            content = ""
        calls = self.parser.closed_calls(self.text[self.section_start :])
        return content, self._new(calls)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The reply ended: the held-back text, or the calls not sent yet (a section that does not parse goes out
        as text, after any calls already sent)."""
        if self.section_start is None:
            return self._send_content(len(self.text)), []
        calls = self.parser.parse_section(self.text[self.section_start :])
        if calls is None or len(calls) < self.num_sent_calls:
            return self.text[self.section_start :] if not self.num_sent_calls else "", []
        return "", self._new(calls)

    @property
    def has_calls(self) -> bool:
        return self.num_sent_calls > 0

    def _send_content(self, end: int) -> str:
        content = self.text[self.num_sent_chars : end]
        self.num_sent_chars = max(self.num_sent_chars, end)
        return content

    def _new(self, calls: list[ToolCall]) -> list[ToolCall]:
        new = calls[self.num_sent_calls :]
        self.num_sent_calls += len(new)
        return new
