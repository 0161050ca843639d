"""Streaming split of a generated output into reasoning and content (``<think>...</think>``).

Grammar: the output may start with the opening tag (only as its very first characters); the
text up to the closing tag is reasoning and everything after it is content, markers included
(a second ``<think>`` block is literal content). When the chat template already opened the
reasoning block, the output starts inside reasoning without any tag (``starts_in_reasoning``);
an output that never closes it is all reasoning.

Forced non-empty content (Nemotron): if the content of the finished output is empty or only
whitespace, the whole output text (reasoning, then that whitespace) is reported as content
and the reasoning channel stays empty. To keep emission stable the parser therefore withholds
reasoning (and whitespace-only content) until the first non-whitespace content character
arrives, and then releases the reasoning on its channel; if none ever arrives, ``finish``
emits the withheld text as content. This withheld text is the one exception to the bound on
held-back text, and it is not counted in ``pending_marker_chars``.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron.core.inference.parsers.base import Channel, Event, MarkerStreamParser, TextEvent

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


class ReasoningParser(MarkerStreamParser):
    """Splits reasoning from content.

    Args:
        starts_in_reasoning: the prompt already opened the reasoning block, so the output
            begins as reasoning. An explicit opening tag at the very start is accepted either way.
        thinking_enabled: False when thinking was switched off for this request; then every
            character, tags included, is content.
        force_nonempty_content: report the reasoning as content when the output has no
            non-whitespace content (see the module docstring for the streaming rule).
        open_tag, close_tag: the reasoning markers.
    """

    def __init__(
        self,
        *,
        starts_in_reasoning: bool = True,
        thinking_enabled: bool = True,
        force_nonempty_content: bool = False,
        open_tag: str = THINK_OPEN,
        close_tag: str = THINK_CLOSE,
    ) -> None:
        super().__init__()
        self._open_tag = open_tag
        self._close_tag = close_tag
        self._thinking_enabled = thinking_enabled
        self._in_reasoning = thinking_enabled and starts_in_reasoning
        self._at_start = True
        self._force_nonempty_content = force_nonempty_content and thinking_enabled
        self._content_seen = False
        self._withheld: list[TextEvent] = []

    def _live_markers(self) -> Sequence[str]:
        if not self._thinking_enabled:
            return ()
        if self._at_start:
            return (self._open_tag, self._close_tag) if self._in_reasoning else (self._open_tag,)
        return (self._close_tag,) if self._in_reasoning else ()

    def _on_text(self, text: str) -> list[Event]:
        self._at_start = False
        channel = Channel.REASONING if self._in_reasoning else Channel.CONTENT
        event = TextEvent(channel, text)
        if not self._force_nonempty_content or self._content_seen:
            return [event]
        self._withheld.append(event)
        if channel is Channel.CONTENT and text.strip():
            self._content_seen = True
            return self._release_withheld()
        return []

    def _on_marker(self, marker: str) -> list[Event]:
        self._at_start = False
        self._in_reasoning = marker == self._open_tag
        return []

    def _on_end(self) -> list[Event]:
        if not self._withheld:
            return []
        # No content ever arrived: the whole output becomes content.
        text = "".join(event.text for event in self._withheld)
        self._withheld = []
        return [TextEvent(Channel.CONTENT, text)]

    def _release_withheld(self) -> list[Event]:
        reasoning = "".join(e.text for e in self._withheld if e.channel is Channel.REASONING)
        content = "".join(e.text for e in self._withheld if e.channel is Channel.CONTENT)
        self._withheld = []
        events: list[Event] = [TextEvent(Channel.REASONING, reasoning)] if reasoning else []
        return events + [TextEvent(Channel.CONTENT, content)]


def deepseek_r1_reasoning_parser(*, starts_in_reasoning: bool = True) -> ReasoningParser:
    """DeepSeek-R1 style: ``<think>reasoning</think>content``."""
    return ReasoningParser(starts_in_reasoning=starts_in_reasoning)


def nemotron_reasoning_parser(
    *, thinking_enabled: bool = True, force_nonempty_content: bool = False, starts_in_reasoning: bool = True
) -> ReasoningParser:
    """Nemotron style: R1 tags, thinking may be disabled, content may be forced non-empty."""
    return ReasoningParser(
        starts_in_reasoning=starts_in_reasoning,
        thinking_enabled=thinking_enabled,
        force_nonempty_content=force_nonempty_content,
    )
