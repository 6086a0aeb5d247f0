"""LLM: the offline entry point, shaped like vLLM's (`LLM(model=...).generate(prompts, SamplingParams(...))`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from leanlm.config import EngineConfig
from leanlm.config.engine import option_names as engine_option_names
from leanlm.engine import BeamSearch, BeamSearchOutput, BeamSearchParams, LLMEngine, RequestOutput
from leanlm.formats.checkpoint import require_model_path
from leanlm.formats.loader import load_checkpoint
from leanlm.loading.chat_encoding import encode_chat
from leanlm.loading.registry import DEFAULT_MODEL
from leanlm.lora_request import LoRARequest
from leanlm.model.device import resolve_device
from leanlm.model.offload import OffloadedLayers, offload_layers
from leanlm.pooling_params import PoolingParams
from leanlm.sampling_params import RequestOutputKind, SamplingParams
from leanlm.selection import (
    Extractor,
    Ranking,
    Scorer,
    VoteResult,
    best_of,
    majority_vote,
    make_extractor,
    sampling_params_for_samples,
)
from leanlm.tool_calls import Tool, has_tool_turns, messages_for_template

Prompt = str | list[int]
Message = dict[str, str]


def load_model(
    model: str = DEFAULT_MODEL,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device | None = None,
    progress: bool = True,
):
    """The network of a bundled name, GGUF file or (quantized) HF directory, for compression or inspection: a
    LlamaForCausalLM. For its tokenizer and recipe too (to save it again), use `load_checkpoint`."""
    require_model_path(model, "load_model")
    return load_checkpoint(model, dtype, device, progress=progress).model


def _is_float32(dtype: str | torch.dtype) -> bool:
    return dtype is torch.float32 or (isinstance(dtype, str) and dtype.lower() in ("float32", "fp32", "float"))


class LLM:
    """Load a model (bundled name, GGUF file or HF directory) and generate with continuous batching."""

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device | None = None,
        attention_backend: str = "auto",
        progress: bool = True,
        dequantize_gguf: bool = False,
        **engine_options,
    ) -> None:
        """`dequantize_gguf`: run a GGUF file's 4-bit linears on float weights dequantized at load, as before
        they ran on their codes (the base for re-quantization experiments; in bf16, about 3.5x the memory of
        4-bit codes)."""
        require_model_path(model, "LLM")
        unknown = set(engine_options) - engine_option_names()
        if unknown:
            raise TypeError(
                f"unknown LLM option(s) {sorted(unknown)}; engine options are {sorted(engine_option_names())}"
            )
        self.engine_config = EngineConfig.from_options(**engine_options)
        if self.engine_config.act_quant == "auto" and dtype != "auto" and _is_float32(dtype):
            # A float32 model asked for by name keeps its exact products: auto's int8 activations for float32 are the
            # AVX2 level's fast path, the one dtype="auto" picks there (as bf16 + int8 is on AVX512).
            self.engine_config = dataclasses.replace(self.engine_config, act_quant="none")
        self.device = resolve_device(device)
        self.parallel = None  # the ParallelDriver of a tensor/pipeline-parallel engine (leanlm.parallel)
        options = dict(attention_backend=attention_backend, progress=progress, dequantize_gguf=dequantize_gguf)
        if self.engine_config.world_size > 1:
            self._start_parallel(model, dtype, options)
            return
        checkpoint = load_checkpoint(model, dtype, self.device, **options)
        self.dtype = checkpoint.model.model.norm.weight.dtype  # what the loader resolved `dtype` to (norms stay float)
        self.model_config = checkpoint.config
        self.tokenizer = checkpoint.tokenizer
        net = checkpoint.model
        del checkpoint
        # layers beyond --max-weight-memory stream from a file / pinned memory from here on (None: all fit)
        limit = self.engine_config.max_weight_memory
        self.offloaded: OffloadedLayers | None = None if limit is None else offload_layers(net, limit)
        draft = None
        spec = self.engine_config.speculative
        if spec is not None and spec.method == "draft":
            draft = load_checkpoint(spec.draft_model, self.dtype, self.device, **options).model
        plan = self.offloaded.plan if self.offloaded is not None else None
        self.llm_engine = LLMEngine(net, self.tokenizer, self.engine_config, self.device, self.dtype, draft, plan)

    def _start_parallel(self, model: str, dtype: str | torch.dtype, options: dict) -> None:
        """Rank 0 of tensor_parallel_size x pipeline_parallel_size processes: it starts the others (or, under
        torchrun, joins them), and its engine's steps run on all of them."""
        from leanlm.parallel.launch import start_driver  # torch.distributed only when asked for

        self.parallel = start_driver(model, dtype, self.device, self.engine_config, options)
        rank = self.parallel.rank_model
        self.engine_config, self.device, self.dtype = rank.engine_config, rank.rank.device, rank.dtype
        self.model_config, self.tokenizer = rank.config, rank.tokenizer
        self.offloaded = rank.offloaded  # rank 0's own slice's layers beyond max_weight_memory (each rank has its own)
        plan = self.offloaded.plan if self.offloaded is not None else None
        self.llm_engine = LLMEngine(
            rank.model, self.tokenizer, self.engine_config, self.device, self.dtype, offload_plan=plan
        )
        self.parallel.attach(self.llm_engine)

    def close(self) -> None:
        """Stop the other ranks of a parallel engine (a one-process engine has nothing to stop). Idempotent."""
        if self.parallel is not None:
            self.parallel.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def get_tokenizer(self):
        return self.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion (batched) and return their outputs in input order. `lora_request`: the
        adapter every prompt runs with, or one (or None: the base model) per prompt; needs LLM(enable_lora=True)."""
        prompt_list = _as_prompt_list(prompts)
        params_list = _as_params_list(sampling_params, len(prompt_list))
        lora_list = _as_lora_list(lora_request, len(prompt_list))
        # Only the final outputs are returned: no request copies its text, ids and logprobs at every step (vLLM's
        # LLM does the same).
        final_only = {id(sp): dataclasses.replace(sp, output_kind=RequestOutputKind.FINAL_ONLY) for sp in params_list}
        return self._queue_and_run(prompt_list, [final_only[id(sp)] for sp in params_list], lora_list, use_tqdm)

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Embed every prompt (batched, through the same engine as generation, prefill only): each output's
        `embedding` is a [hidden] float32 CPU tensor, the final normed hidden state of the last token (or the mean of
        all tokens: PoolingParams(pooling="mean")), L2-normalized unless PoolingParams(normalize=False)."""
        params = pooling_params if pooling_params is not None else PoolingParams()
        if not isinstance(params, PoolingParams):
            raise TypeError(f"pooling_params must be a PoolingParams, got {type(params).__name__}")
        prompt_list = _as_prompt_list(prompts)
        return self._queue_and_run(prompt_list, [params] * len(prompt_list), [None] * len(prompt_list), use_tqdm)

    def _queue_and_run(
        self,
        prompt_list: list[Prompt],
        params_list: list[SamplingParams | PoolingParams],
        lora_list: list[LoRARequest | None],
        use_tqdm: bool,
    ) -> list[RequestOutput]:
        """Queue every prompt with its params and adapter, and run them all to completion. Everything is tokenized and
        validated before anything is queued: a bad prompt fails fast and disturbs nothing."""
        engine = self.llm_engine
        tokenized = [engine.tokenize_prompt(p) for p in prompt_list]
        for (_, token_ids), params in zip(tokenized, params_list):
            engine.validate(token_ids, params)
        for lora in lora_list:
            engine.prepare_lora(lora)
        ids = [
            engine.add_request(token_ids, params, prompt_text=text, lora_request=lora)
            for (text, token_ids), params, lora in zip(tokenized, params_list, lora_list)
        ]
        return self._run(ids, use_tqdm)

    def beam_search(
        self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams, use_tqdm: bool = True
    ) -> list[BeamSearchOutput]:
        """Beam search over each prompt (batched, on copy-on-write shared KV blocks); outputs in input order,
        each with up to beam_width hypotheses, best score first."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(
                f"beam_search takes a BeamSearchParams (BeamSearchParams(beam_width=4, max_tokens=32)), got "
                f"{type(params).__name__}; for sampling use generate(prompts, SamplingParams(...))"
            )
        return BeamSearch(self.llm_engine, params).run(_as_prompt_list(prompts), use_tqdm)

    def best_of_n(
        self,
        prompts: Prompt | Sequence[Prompt],
        n: int,
        sampling_params: SamplingParams | None = None,
        scorer: Scorer | None = None,
        use_tqdm: bool = True,
    ) -> list[Ranking]:
        """Sample n completions per prompt and rank them, best first: by mean token logprob, or by
        `scorer(text, token_ids)` (higher is better). One Ranking per prompt, in input order."""
        params = sampling_params_for_samples(n, "n", sampling_params, needs_logprobs=scorer is None)
        outputs = self.generate(prompts, params, use_tqdm=use_tqdm)
        return [best_of(out.outputs, scorer) for out in outputs]

    def majority_vote(
        self,
        prompts: Prompt | Sequence[Prompt],
        k: int,
        sampling_params: SamplingParams | None,
        extract: Extractor,
        use_tqdm: bool = True,
    ) -> list[VoteResult]:
        """Self-consistency: sample k completions per prompt, extract each one's answer (a regex: its first group
        or whole match; or a callable returning the answer or None) and vote. One VoteResult per prompt: the
        winner, its support (votes / samples that gave an answer) and the samples that gave it."""
        make_extractor(extract)  # a bad regex fails before any generation
        params = sampling_params_for_samples(k, "k", sampling_params, needs_logprobs=True)  # logprobs break vote ties
        outputs = self.generate(prompts, params, use_tqdm=use_tqdm)
        return [majority_vote(out.outputs, extract) for out in outputs]

    def score(self, token_id_lists: Sequence[Sequence[int]], use_tqdm: bool = True) -> list[torch.Tensor]:
        """Full next-token distributions of each sequence, through the same batched paged forward as
        generation: one [T-1, V] float32 CPU tensor per sequence, row i the log-softmax at position i (it
        scores token i+1). All sequences go in one batch; each costs (T-1) * V * 4 bytes, so pass chunks."""
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, full_prompt_logprobs=True)
        token_id_lists = [list(ids) for ids in token_id_lists]
        if any(len(ids) < 2 for ids in token_id_lists):
            raise ValueError("score needs sequences of at least 2 tokens (position 0 has no prefix to score it)")
        outputs = self.generate(token_id_lists, params, use_tqdm=use_tqdm)
        return [out.prompt_logprobs_full for out in outputs]

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        control_tokens: str = "text",
        tools: Sequence[Tool] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the model's chat template.
        `control_tokens`: what a control token's text inside a message becomes: "text" (its characters: no
        message can forge another role's turn), "reject" (ValueError), or "parse" (the token, as HF does).
        `lora_request`: as generate's, one per conversation. `tools`: functions the model may call
        (leanlm.tool_calls.Tool), rendered as the server renders them; read the calls back with
        `leanlm.tool_calls.parser_for_template(llm.tokenizer.chat_template).parse(text)`."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[Prompt] = []
        for conversation in conversations:
            template_tools = None
            if tools or has_tool_turns(conversation):
                conversation, template_tools = messages_for_template(
                    conversation, list(tools or ()), self.tokenizer.chat_template
                )
            _, ids = encode_chat(
                self.tokenizer, conversation, add_generation_prompt, control_tokens, tools=template_tools
            )
            prompts.append(ids)
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="Generating", unit="req", disable=not use_tqdm, leave=False)
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished and output.request_id not in finished:
                        finished[output.request_id] = output
                        bar.update(1)
        except BaseException:
            for request_id in request_ids:  # never leave requests holding KV blocks behind
                if request_id not in finished:
                    engine.abort_request(request_id)
            raise
        finally:
            bar.close()
        return [finished[i] for i in request_ids]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if not prompts:
        raise ValueError("no prompts given")
    if all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single prompt given as token ids
    for p in prompts:
        if not isinstance(p, (str, list, tuple)):
            raise TypeError(f"a prompt must be a string or a list of token ids, got {type(p).__name__}")
    return [p if isinstance(p, str) else list(p) for p in prompts]


def _as_lora_list(lora: LoRARequest | Sequence[LoRARequest | None] | None, n: int) -> list[LoRARequest | None]:
    if lora is None or isinstance(lora, LoRARequest):
        return [lora] * n
    if isinstance(lora, (str, bytes, dict)) or not isinstance(lora, Sequence):
        raise TypeError(f"lora_request must be a LoRARequest(name, path) or one per prompt, got {type(lora).__name__}")
    lora = list(lora)
    wrong = sorted({type(x).__name__ for x in lora if x is not None and not isinstance(x, LoRARequest)})
    if wrong:
        raise TypeError(f"lora_request entries must be LoRARequest or None, got {', '.join(wrong)}")
    if len(lora) != n:
        raise ValueError(f"got {len(lora)} lora_requests for {n} prompts; give one, or one per prompt")
    return lora


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if isinstance(params, (dict, str, bytes)) or not isinstance(params, Sequence):
        hint = "pass SamplingParams(**options)" if isinstance(params, dict) else "pass SamplingParams(...)"
        if isinstance(params, BeamSearchParams):
            hint = "for beam search call llm.beam_search(prompts, params)"
        raise TypeError(
            f"sampling_params must be a SamplingParams or one per prompt, got {type(params).__name__}; {hint}"
        )
    params = list(params)
    wrong = sorted({type(p).__name__ for p in params if not isinstance(p, SamplingParams)})
    if wrong:
        raise TypeError(f"sampling_params must all be SamplingParams, got {', '.join(wrong)}")
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts; give one, or one per prompt")
    return params
