"""OutputProcessor: detokenizes requests incrementally, finds stop strings (even across tokens), and
folds the n sampled completions of one prompt into a single RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from leanlm.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from leanlm.engine.request import Request
from leanlm.loading.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class _CompletionState:
    """Text of one child request; `text` is cut at a matched stop string."""

    request: Request
    index: int  # which of the parent's n completions
    detokenizer: IncrementalDetokenizer
    text: str = ""
    num_detokenized: int = 0  # output tokens fed to the detokenizer
    stopped_by_string: bool = False


@dataclass
class _PromptState:
    """One user-visible request (prompt) and its n children."""

    request_id: str
    prompt: str | None
    children: list[_CompletionState] = field(default_factory=list)

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
        window_start = max(0, len(child.text) - len(new_text) - max(len(s) for s in params.stop) + 1)
        best: tuple[int, str] | None = None
        for stop in params.stop:
            idx = child.text.find(stop, window_start)
            if idx >= 0 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        child.text = child.text[: idx + len(stop)] if params.include_stop_str_in_output else child.text[:idx]
        child.stopped_by_string = True
        return stop

    def _catch_up(self, child: _CompletionState) -> str:
        """Feed output tokens not yet detokenized; returns the newly completed text."""
        tokens = child.request.output_token_ids
        if child.num_detokenized >= len(tokens) or child.stopped_by_string:
            return ""
        new_text = child.detokenizer.step(tokens[child.num_detokenized :])
        child.num_detokenized = len(tokens)
        child.text += new_text
        return new_text

    def make_outputs(self, requests: list[Request]) -> list[RequestOutput]:
        """One RequestOutput per parent touched by `requests`; forgets parents that finished."""
        parents: dict[str, _PromptState] = {}
        for req in requests:
            if req.request_id in self._children:
                parent, _ = self._children[req.request_id]
                parents[parent.request_id] = parent
        outputs = [self._output(p) for p in parents.values()]
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
        completions = []
        for child in parent.children:
            self._catch_up(child)
            req = child.request
            if req.is_finished and not child.stopped_by_string:  # no more tokens: the held-back tail too
                child.text += child.detokenizer.flush()
            completions.append(
                CompletionOutput(
                    index=child.index,
                    text=self._visible_text(child),
                    token_ids=list(req.output_token_ids),
                    logprobs=list(req.output_logprobs) if req.sampling_params.logprobs is not None else None,
                    finish_reason=req.status.finish_reason,
                    stop_reason=req.stop_reason,
                    error=req.error,
                )
            )
        first = parent.children[0].request
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=first.prompt_token_ids,
            prompt_logprobs=list(first.prompt_logprobs) if first.sampling_params.prompt_logprobs is not None else None,
            outputs=completions,
            finished=parent.finished,
            metrics=_metrics(first),
            prompt_logprobs_full=_full_prompt_logprobs(first) if parent.finished else None,
        )

    @staticmethod
    def _visible_text(child: _CompletionState) -> str:
        """While unfinished, hold back a tail that might be the start of a stop string."""
        stops = child.request.sampling_params.stop
        if child.request.is_finished or not stops:
            return child.text
        hold = max(len(s) for s in stops) - 1
        return child.text[: len(child.text) - hold] if hold else child.text


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
