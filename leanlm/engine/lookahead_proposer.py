"""LookaheadProposer: drafts from Jacobi iteration and an n-gram pool, with no draft model (Jacobi decoding,
Santilli et al. 2023; lookahead decoding, Fu et al. 2024).

Every verification step is also a Jacobi step: the target's argmax at each draft row is its prediction for the
next position given the (guessed) tokens before it. The predictions past the first rejected draft become the
next guess for the positions after the new token, and the n-grams along each step's window (input token, then
the predictions that follow it) join a per-request pool, with the n-grams of the request's own text. A draft is
the newest pool n-gram that starts with the last token, else the Jacobi guess, else the last token repeated
(the iteration has to start somewhere). Lookahead decoding proper runs the Jacobi window and the candidate
n-grams in one forward with a custom attention mask; here they share the ordinary verification rows, one
candidate per step.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class _State:
    pool: dict[int, deque[tuple[int, ...]]] = field(default_factory=dict)  # first token -> continuations, newest first
    guess: list[int] = field(default_factory=list)  # Jacobi guess for the tokens after the newest one
    num_indexed: int = 0  # tokens of the request's text whose n-grams are in the pool


class LookaheadProposer:
    def __init__(self, ngram_size: int = 4, pool_size: int = 8) -> None:
        if ngram_size < 2 or pool_size < 1:
            raise ValueError(f"need ngram_size >= 2 and pool_size >= 1, got {ngram_size}, {pool_size}")
        self.ngram_size = ngram_size
        self.pool_size = pool_size
        self._states: dict[str, _State] = {}

    def forget(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self._states.pop(request_id, None)

    def observe(self, request_id: str, inputs: Sequence[int], predictions: Sequence[int], num_accepted: int) -> None:
        """One verified window: `inputs` = [last token, drafts...], `predictions` = the target's argmax at each
        of those rows; drafts 1..num_accepted matched."""
        state = self._states.setdefault(request_id, _State())
        state.guess = list(predictions[num_accepted + 1 :])
        span = self.ngram_size - 1
        for j in range(len(inputs)):
            continuation = tuple(predictions[j : j + span])
            if len(continuation) == span:
                self._add(state, inputs[j], continuation)

    def propose(self, request_id: str, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to k drafts continuing `token_ids` (the request's prompt and output, newest token last)."""
        if k < 1 or not token_ids:
            return []
        state = self._states.setdefault(request_id, _State())
        self._index_text(state, token_ids)
        last = token_ids[-1]
        candidates = state.pool.get(last)
        if candidates:
            draft = list(candidates[0])
        elif state.guess:
            draft = list(state.guess)
        else:
            draft = [last]
        while len(draft) < k:  # pad with the guess, then repeats: cheap rows that may still be accepted
            draft.append(state.guess[len(draft)] if len(draft) < len(state.guess) else draft[-1])
        return draft[:k]

    def _index_text(self, state: _State, token_ids: Sequence[int]) -> None:
        n = self.ngram_size
        start = max(0, state.num_indexed - n + 1)
        for i in range(start, len(token_ids) - n + 1):
            self._add(state, token_ids[i], tuple(token_ids[i + 1 : i + n]))
        state.num_indexed = len(token_ids)

    def _add(self, state: _State, first: int, continuation: tuple[int, ...]) -> None:
        entries = state.pool.setdefault(first, deque(maxlen=self.pool_size))
        if continuation in entries:
            entries.remove(continuation)
        entries.appendleft(continuation)
