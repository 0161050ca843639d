"""The grammar state of one request, advanced by its accepted tokens."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class RequestMatcher:
    """Where one request stands in its grammar.

    The state is a function of the request's generated tokens only: :meth:`sync` feeds the
    tokens accepted since the last call, so a matcher rebuilt from a request's tokens (after a
    handoff, on the decode side) is in the same state as the one that saw them one by one.
    Once a token does not match (only possible past the end, e.g. with ``ignore_eos``), the
    matcher stops constraining.
    """

    def __init__(self, compiled_grammar):
        import xgrammar

        self._matcher = xgrammar.GrammarMatcher(compiled_grammar)
        self.num_tokens = 0
        self.active = True

    def sync(self, tokens: Sequence[int]) -> None:
        """Accept ``tokens[num_tokens:]`` (the request's generated tokens)."""
        for token in tokens[self.num_tokens :]:
            if self.active and (self._matcher.is_terminated() or not self._matcher.accept_token(int(token))):
                self.active = False
        self.num_tokens = len(tokens)

    def fill(self, bitmask: torch.Tensor, first_row: int, num_rows: int, drafts: Sequence[int]) -> None:
        """Fill bitmask rows ``first_row ..`` for ``num_rows`` speculative depths: depth ``d``
        allows what may follow the tokens so far plus ``drafts[:d]``. Past the first draft the
        grammar rejects, rows repeat the last valid mask: the verifier rejects those depths
        anyway, because the row before them cannot pick the invalid draft. The matcher ends
        where it began (drafts are rolled back)."""
        accepted = 0
        for depth in range(num_rows):
            row = first_row + depth
            if depth and accepted < depth:
                bitmask[row] = bitmask[row - 1]
                continue
            if self._matcher.is_terminated():
                bitmask[row] = bitmask_allowing_all(bitmask.shape[1])
            else:
                self._matcher.fill_next_token_bitmask(bitmask, row)
            # Test the draft against the row just filled: the matcher warns on every rejected token.
            if (
                depth < len(drafts)
                and _allows(bitmask[row], drafts[depth])
                and self._matcher.accept_token(drafts[depth])
            ):
                accepted += 1
        if accepted:
            self._matcher.rollback(accepted)


def _allows(bitmask_row: torch.Tensor, token: int) -> bool:
    return bool((int(bitmask_row[token >> 5]) >> (token & 31)) & 1)


def bitmask_allowing_all(width: int) -> torch.Tensor:
    """One bitmask row that allows every token."""
    return torch.full((width,), -1, dtype=torch.int32)
