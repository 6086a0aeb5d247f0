"""OutputProcessor: detokenizes requests incrementally, finds stop strings (even across tokens), and
folds the n sampled completions of one prompt into a single RequestOutput: cumulative, only what is new since
the last output (DELTA: a stream's cost per step is its increment, not its whole text, ids and logprobs), or
only the final one (RequestOutputKind, as vLLM)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from leanlm.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from leanlm.engine.request import Request
from leanlm.loading.tokenizer import IncrementalDetokenizer, Tokenizer
from leanlm.sampling_params import RequestOutputKind


@dataclass
class _CompletionState:
    """Text of one child request, cut at a matched stop string. The text is kept in pieces, joined only when
    a whole text is asked for: appending a token's text and reading the end of it cost O(piece), not O(text)."""

    request: Request
    index: int  # which of the parent's n completions
    detokenizer: IncrementalDetokenizer
    text_parts: list[str] = field(default_factory=list)  # the text so far, in order
    num_chars: int = 0  # characters in text_parts
    num_detokenized: int = 0  # output tokens fed to the detokenizer
    stopped_by_string: bool = False
    num_sent_tokens: int = 0  # DELTA: output tokens already handed out
    num_sent_chars: int = 0  # DELTA: characters already handed out

    def append(self, piece: str) -> None:
        if piece:
            self.text_parts.append(piece)
            self.num_chars += len(piece)

    def tail(self, start: int) -> str:
        """text[start:], reading only the pieces it spans."""
        need = self.num_chars - max(start, 0)
        pieces, got = [], 0
        for piece in reversed(self.text_parts):
            if got >= need:
                break
            pieces.append(piece)
            got += len(piece)
        joined = "".join(reversed(pieces))
        return joined[len(joined) - need :] if need > 0 else ""

    def truncate(self, length: int) -> None:
        """Keep text[:length]."""
        while self.num_chars > length:
            last = self.text_parts.pop()
            self.num_chars -= len(last)
            if self.num_chars < length:
                self.append(last[: length - self.num_chars])

    @property
    def text(self) -> str:
        joined = "".join(self.text_parts)
        self.text_parts = [joined] if joined else []  # the next join starts from one piece
        return joined


@dataclass
class _PromptState:
    """One user-visible request (prompt) and its n children."""

    request_id: str
    prompt: str | None
    children: list[_CompletionState] = field(default_factory=list)
    num_outputs: int = 0  # RequestOutputs made so far (DELTA sends the prompt's logprobs with the first only)

    @property
    def finished(self) -> bool:
        return all(c.request.is_finished for c in self.children)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._prompts: dict[str, _PromptState] = {}  # parent request id -> state
        self._children: dict[str, tuple[_PromptState, _CompletionState]] = {}  # child id -> states

    def add(self, parent_id: str, prompt: str | None, children: list[Request]) -> None:
        state = _PromptState(parent_id, prompt)
        for index, req in enumerate(children):
            detok = IncrementalDetokenizer(
                self.tokenizer, req.prompt_token_ids, req.sampling_params.skip_special_tokens
            )
            child = _CompletionState(req, index, detok)
            state.children.append(child)
            self._children[req.request_id] = (state, child)
        self._prompts[parent_id] = state

    def parent_ids(self) -> list[str]:
        """Ids of the requests (prompts) not finished yet."""
        return list(self._prompts)

    def child_ids(self, parent_id: str) -> list[str]:
        state = self._prompts.get(parent_id)
        return [c.request.request_id for c in state.children] if state else []

    def check_stop(self, request: Request) -> str | None:
        """Scheduler hook, after each new token: the stop string that now ends the text, if any."""
        if request.request_id not in self._children:
            return None  # an engine-internal request (a beam search round) has no text or stop strings
        _, child = self._children[request.request_id]
        new_text = self._catch_up(child)
        params = request.sampling_params
        if not params.stop or not new_text or request.num_output_tokens < params.min_tokens:
            return None
        # A match must end inside the new text; it may start up to (len(stop) - 1) characters before it.
        window_start = max(0, child.num_chars - len(new_text) - max(len(s) for s in params.stop) + 1)
        window = child.tail(window_start)
        best: tuple[int, str] | None = None
        for stop in params.stop:
            idx = window.find(stop)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        child.truncate(window_start + idx + (len(stop) if params.include_stop_str_in_output else 0))
        child.stopped_by_string = True
        return stop

    def _catch_up(self, child: _CompletionState) -> str:
        """Feed output tokens not yet detokenized; returns the newly completed text."""
        tokens = child.request.output_token_ids
        if child.num_detokenized >= len(tokens) or child.stopped_by_string:
            return ""
        new_text = child.detokenizer.step(tokens[child.num_detokenized :])
        child.num_detokenized = len(tokens)
        child.append(new_text)
        return new_text

    def make_outputs(self, requests: list[Request]) -> list[RequestOutput]:
        """One RequestOutput per parent touched by `requests`; forgets parents that finished."""
        parents: dict[str, _PromptState] = {}
        for req in requests:
            if req.request_id in self._children:
                parent, _ = self._children[req.request_id]
                parents[parent.request_id] = parent
        outputs = [
            self._output(p)
            for p in parents.values()
            if p.finished or p.children[0].request.sampling_params.output_kind != RequestOutputKind.FINAL_ONLY
        ]
        for parent in parents.values():
            if parent.finished:
                self.forget(parent.request_id)
        return outputs

    def forget(self, parent_id: str) -> None:
        parent = self._prompts.pop(parent_id, None)
        if parent is not None:
            for child in parent.children:
                self._children.pop(child.request.request_id, None)

    def _output(self, parent: _PromptState) -> RequestOutput:
        first = parent.children[0].request
        is_delta = first.sampling_params.output_kind == RequestOutputKind.DELTA
        completions = []
        for child in parent.children:
            self._catch_up(child)
            req = child.request
            if req.is_finished and not child.stopped_by_string:  # no more tokens: the held-back tail too
                child.append(child.detokenizer.flush())
            completions.append(self._delta(child) if is_delta else self._cumulative(child))
        has_prompt_logprobs = first.sampling_params.prompt_logprobs is not None
        parent.num_outputs += 1
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=first.prompt_token_ids,
            # A prompt's logprobs are complete by its first output (outputs start with the first sampled token).
            prompt_logprobs=list(first.prompt_logprobs)
            if has_prompt_logprobs and not (is_delta and parent.num_outputs > 1)
            else None,
            outputs=completions,
            finished=parent.finished,
            metrics=_metrics(first),
            prompt_logprobs_full=_full_prompt_logprobs(first) if parent.finished else None,
            kind=RequestOutputKind.DELTA if is_delta else RequestOutputKind.CUMULATIVE,
            embedding=first.embedding,
        )

    def _cumulative(self, child: _CompletionState) -> CompletionOutput:
        req = child.request
        return CompletionOutput(
            index=child.index,
            text=child.text[: self._visible_end(child)],
            token_ids=list(req.output_token_ids),
            logprobs=list(req.output_logprobs) if req.sampling_params.logprobs is not None else None,
            finish_reason=req.status.finish_reason,
            stop_reason=req.stop_reason,
            error=req.error,
        )

    def _delta(self, child: _CompletionState) -> CompletionOutput:
        """What is new since this child's last output: O(increment), however long the completion is."""
        req = child.request
        end = max(self._visible_end(child), child.num_sent_chars)
        text = child.tail(child.num_sent_chars)[: end - child.num_sent_chars]
        start, num_tokens = child.num_sent_tokens, len(req.output_token_ids)
        child.num_sent_chars, child.num_sent_tokens = end, num_tokens
        return CompletionOutput(
            index=child.index,
            text=text,
            token_ids=req.output_token_ids[start:num_tokens],
            logprobs=req.output_logprobs[start:num_tokens] if req.sampling_params.logprobs is not None else None,
            finish_reason=req.status.finish_reason,
            stop_reason=req.stop_reason,
            error=req.error,
        )

    @staticmethod
    def _visible_end(child: _CompletionState) -> int:
        """While unfinished, hold back a tail that might be the start of a stop string."""
        stops = child.request.sampling_params.stop
        if child.request.is_finished or not stops:
            return child.num_chars
        return max(0, child.num_chars - (max(len(s) for s in stops) - 1))


def _full_prompt_logprobs(req: Request) -> torch.Tensor | None:
    """The request's [P-1, V] chunks joined, once (only finished outputs carry it: a join per stream step
    of a long request would copy P * V floats each time)."""
    if not req.sampling_params.full_prompt_logprobs or not req.prompt_logprobs_full:
        return None
    return torch.cat(req.prompt_logprobs_full)


def _metrics(req: Request) -> RequestMetrics:
    return RequestMetrics(
        arrival_time=req.arrival_time,
        first_scheduled_time=req.first_scheduled_time,
        first_token_time=req.first_token_time,
        last_token_time=req.last_token_time,
        finished_time=req.finished_time,
        num_prompt_tokens=req.num_prompt_tokens,
        num_generation_tokens=req.num_output_tokens,
        num_cached_tokens=req.num_cached_tokens,
        num_preemptions=req.num_preemptions,
    )
