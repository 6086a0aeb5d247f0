"""SuffixProposer: prompt lookup for edited text. An edit (a renamed variable, an added type hint, a changed
line) breaks plain prompt lookup twice: the draft that ran into the edit is rejected, and after it the tail
n-gram's latest occurrence is often the wrong one (an earlier copy in the output, a line that recurs further
down). This proposer follows the copy instead of searching afresh each step.

- An index of every n-gram (min_n..max_n tokens) of the request's text to the positions that follow it, built
  incrementally (each new token adds max_n - min_n + 1 entries), so a lookup is a dict access and a bisect
  rather than a scan of the whole context per step (the cost model of SuffixDecoding, Oliaro et al. 2024,
  with bounded n-grams in place of its suffix tree).
- An anchor: the source position the text is currently copying from. While the tokens that arrive equal the
  source's continuation the anchor moves along with them and the draft is what follows it.
- Re-anchoring after an edit: once the text leaves its source, candidates are the followed source, the first
  occurrence of the longest tail n-gram at or just past the point where the text left it, and the latest
  occurrence (plain prompt lookup's choice); the one whose match with the tail is longest wins, ties in that
  order. So the draft resumes from the text just after the edit.
- Learned substitutions: when the text leaves its source and resumes just past the edit, the source span it
  skipped and the span it wrote instead become a rule (`entries` -> `records`); following a source, a span
  that has a rule is drafted as its replacement. A rule whose replacement is rejected is dropped.

Drafts are certain tokens (no distribution); the verifier decides, so greedy output stays that of plain
decoding whatever is proposed."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field

# A source followed for fewer tokens than this when it breaks was a wrong guess, not the place of an edit.
_MIN_FOLLOWED = 2
# Matches are compared over at most this many tokens.
_MAX_MATCH = 32
# Re-anchoring looks past the edit point only this far (tokens): farther occurrences are unrelated text.
_REANCHOR_WINDOW = 256
# Longest source span and replacement a substitution rule may have (tokens).
_MAX_RULE_SOURCE, _MAX_RULE_REPLACEMENT = 8, 16

_State = tuple[int, tuple[int, ...], "tuple[int, ...] | None"]  # anchor, pending replacement, its rule's span


@dataclass
class _Copy:
    """One request's index and where its text is copying from."""

    index: dict[tuple[int, ...], list[int]] = field(default_factory=dict)  # n-gram -> positions after it, rising
    num_indexed: int = 0  # tokens of the text whose n-grams ending before them are in `index`
    seen: int = 0  # text length at the last proposal: later tokens are what the verifier kept since
    # Where the next token comes from while copying: the replacement tokens still pending (of the rule whose
    # source span is `span`), then the source from `anchor` on. anchor None: not copying.
    anchor: int | None = None
    pending: tuple[int, ...] = ()
    span: tuple[int, ...] | None = None
    followed: int = 0  # tokens of the text that agree with the copy: the match that chose the anchor, and since
    edit_point: int | None = None  # source position where the text last left a source it had followed
    edit_at: int | None = None  # text position where it left; None once the edit has been learned from
    # substitution rules: first token -> source span -> replacement
    rules: dict[int, dict[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)

    @property
    def state(self) -> _State:
        return self.anchor, self.pending, self.span


class SuffixProposer:
    """Per-request state keyed by request id; `forget` drops it when a request ends."""

    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n
        self._copies: dict[str, _Copy] = {}

    def forget(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self._copies.pop(request_id, None)

    def propose(self, request_id: str, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to k draft tokens continuing `token_ids` (the request's whole text so far)."""
        copy = self._copies.get(request_id)
        if copy is None or len(token_ids) < copy.num_indexed:  # a new request (or a reused id): start over
            copy = self._copies[request_id] = _Copy()
        self._follow(copy, token_ids)
        self._extend_index(copy, token_ids)
        copy.seen = len(token_ids)
        return self._draft(copy, token_ids, k) if k >= 1 else []

    def _extend_index(self, copy: _Copy, ids: Sequence[int]) -> None:
        # Position j is indexed under each n-gram ids[j - n : j]; the tail's own continuation (len(ids)) never is.
        for j in range(max(copy.num_indexed, 1), len(ids)):
            for n in range(self.min_n, min(self.max_n, j) + 1):
                copy.index.setdefault(tuple(ids[j - n : j]), []).append(j)
        copy.num_indexed = max(copy.num_indexed, len(ids))

    @staticmethod
    def _step(copy: _Copy, ids: Sequence[int], state: _State, limit: int) -> tuple[int, _State] | None:
        """The next copied token from `state` and the state after it, reading source positions below `limit`."""
        anchor, pending, span = state
        if pending:
            return pending[0], (anchor, pending[1:], span)
        if anchor >= limit:
            return None
        for source, replacement in copy.rules.get(ids[anchor], {}).items():
            end = anchor + len(source)
            if end <= limit and tuple(ids[anchor:end]) == source:
                return replacement[0], (end, replacement[1:], source)
        return ids[anchor], (anchor + 1, (), None)

    def _follow(self, copy: _Copy, ids: Sequence[int]) -> None:
        """Move the anchor over the tokens kept since the last proposal while they are the copy's."""
        if copy.anchor is None:
            return
        for position in range(copy.seen, len(ids)):
            step = self._step(copy, ids, copy.state, position)
            if step is not None and step[0] == ids[position]:
                copy.anchor, copy.pending, copy.span = step[1]
                copy.followed += 1
                continue
            if step is not None and step[1][2] is not None:  # a substitution that did not hold: drop it
                source = step[1][2]
                copy.rules[source[0]].pop(source, None)
            if copy.followed >= _MIN_FOLLOWED:  # an edit, not a wrong guess
                copy.edit_point, copy.edit_at = copy.anchor, position
            copy.anchor, copy.pending, copy.span = None, (), None
            return

    def _draft(self, copy: _Copy, ids: Sequence[int], k: int) -> list[int]:
        """The copy of the candidate source whose match with the tail is longest (ties: the followed source,
        then the one past the last edit, then the latest)."""
        candidates = self._candidates(copy, ids, k)
        if not candidates:
            return []
        scores = [_match_length(ids, p) for p in candidates]
        if copy.anchor is not None and candidates[0] == copy.anchor:
            scores[0] = max(scores[0], copy.followed)  # after a substitution the source no longer matches
        best = max(range(len(candidates)), key=scores.__getitem__)  # the first of the highest
        position = candidates[best]
        if position != copy.anchor:
            self._learn(copy, ids, position, scores[best])
            copy.anchor, copy.pending, copy.span, copy.followed = position, (), None, scores[best]
        draft, state = [], copy.state
        while len(draft) < k and (step := self._step(copy, ids, state, len(ids))) is not None:
            draft.append(step[0])
            state = step[1]
        return draft

    @staticmethod
    def _learn(copy: _Copy, ids: Sequence[int], position: int, match: int) -> None:
        """The text resumes copying at `position` after `match` matching tokens: if that is past where it left
        its source, the source span it skipped was replaced by what it wrote in between."""
        if copy.edit_at is None or copy.edit_point is None:
            return
        source = tuple(ids[copy.edit_point : position - match])
        replacement = tuple(ids[copy.edit_at : len(ids) - match])
        if position - match < copy.edit_point or not 1 <= len(source) <= _MAX_RULE_SOURCE:
            return  # not a resumption just past the edit: keep the edit for a later one
        if 1 <= len(replacement) <= _MAX_RULE_REPLACEMENT:
            copy.rules.setdefault(source[0], {})[source] = replacement
        copy.edit_at = None

    def _candidates(self, copy: _Copy, ids: Sequence[int], k: int) -> list[int]:
        """Source positions for the next token, most preferred first: the followed source; for the longest
        tail n-gram that recurs past the last edit (within the window), its first occurrence there; for the
        longest that recurs at all, its latest occurrence with k tokens after it, and its latest."""
        num_tokens = len(ids)
        out = [] if copy.anchor is None or copy.anchor >= num_tokens else [copy.anchor]
        near = longest = None
        for n in range(min(self.max_n, num_tokens - 1), self.min_n - 1, -1):
            positions = copy.index.get(tuple(ids[num_tokens - n :]))
            if not positions:
                continue
            if near is None and copy.edit_point is not None:
                i = bisect_left(positions, copy.edit_point)
                if i < len(positions) and positions[i] - copy.edit_point <= _REANCHOR_WINDOW:
                    near = positions[i]
            if longest is None:
                longest = positions
            if near is not None or copy.edit_point is None:
                break
        if near is not None:
            out.append(near)
        if longest is not None:
            i = bisect_left(longest, num_tokens - k + 1) - 1  # the latest with k tokens after it
            out += [longest[i], longest[-1]] if i >= 0 else [longest[-1]]
        return out


def _match_length(ids: Sequence[int], position: int) -> int:
    """How many tokens before `position` equal the text's tail (at most _MAX_MATCH)."""
    tail = len(ids) - 1
    length = 0
    while length < min(position, _MAX_MATCH) and ids[position - 1 - length] == ids[tail - length]:
        length += 1
    return length
