"""Structured output (llguidance masks, jump-forward decoding) on SmolLM2-135M-Instruct, in one run on this machine.

    python benchmarks/structured_output.py --doc docs/structured_output.md

1. Validity: each of the hand-written real-world-shaped JSON schemas in benchmarks/data/structured_output_schemas.json
   (addresses, invoices, GitHub issues, weather reports, recipes, calendar events, ...), the instruct model asked for
   one (its chat template, the task and the schema's top-level keys in the prompt), greedy, up to --max-tokens: the
   share of outputs that `json.loads` and `jsonschema.validate` accept, constrained vs free (free text is also tried
   with a Markdown code fence stripped, the most lenient reading).
2. Cost of the masks: decode tokens/s at batch 32 (32 schemas at once), constrained (jump-forward off, so both
   arms run the same steps) vs free; the median step time over the steps where all 32 requests decode.
3. Jump-forward vs not, on compact JSON (no free whitespace: keys, punctuation and enum tails are forced) at batch 1
   and at batch --batch: wall time, forwards, and where the time goes (forward, mask computation waited for, rest).
4. Why: the forward time of one request's step at ~160 tokens of context computing 1, 2, 4 or 8 new tokens (what a
   forced run costs in the next step), `--chunk-cost` alone writes just this section.
Each timed repetition records the CPU share other processes took (/proc/stat); the numbers are the medians of the
repetitions kept (other processes below --threshold of the CPU), and the discarded count is reported.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path

import jsonschema

from leanlm.analysis.host import CpuMonitor, describe_machine
from leanlm.analysis.markdown import replace_section
from leanlm.engine import structured_output as structured_output_module
from leanlm.llm import LLM
from leanlm.sampling_params import SamplingParams
from leanlm.structured_outputs import StructuredOutputsParams

SCHEMAS = Path(__file__).parent / "data" / "structured_output_schemas.json"
MODEL = "smollm2-135m-instruct"
JUMP_LABELS = {False: "off", True: "on, runs >= {} tokens (default)", "every": "on, every forced run"}
FENCE = re.compile(r"^\s*```(?:json)?\s*(.*?)\s*```", re.S)


def prompts_for(llm: LLM, cases: list[dict]) -> list[str]:
    tokenizer = llm.get_tokenizer()
    out = []
    for case in cases:
        keys = ", ".join(case["schema"].get("properties", {}))
        message = f"Write {case['task']} as a JSON object with the keys {keys}. Reply with the JSON object only."
        chat = [{"role": "user", "content": message}]
        out.append(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
    return out


def is_valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def validity(llm: LLM, cases: list[dict], prompts: list[str], max_tokens: int) -> dict:
    free = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    constrained = [
        SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(json=s))
        for s in (c["schema"] for c in cases)
    ]
    free_out = [o.outputs[0] for o in llm.generate(prompts, free, use_tqdm=False)]
    con_out = [o.outputs[0] for o in llm.generate(prompts, constrained, use_tqdm=False)]
    rows = []
    for case, f, c in zip(cases, free_out, con_out):
        fenced = FENCE.match(f.text)
        rows.append(
            {
                "name": case["name"],
                "free": is_valid(f.text, case["schema"]),
                "free_lenient": is_valid(fenced.group(1) if fenced else f.text, case["schema"]),
                "constrained": is_valid(c.text, case["schema"]),
                "constrained_finish": c.finish_reason,
                "constrained_tokens": len(c.token_ids),
                "free_tokens": len(f.token_ids),
                "constrained_text": c.text,
            }
        )
    return {"rows": rows}


class StepTimer:
    """Wraps the engine's forward and the structured-output mask jobs to split a run's time."""

    def __init__(self, llm: LLM) -> None:
        runner = llm.llm_engine.model_runner
        self.forward_s = 0.0
        self.num_forwards = 0
        self.mask_wait_s = 0.0
        forward = runner.step_forward

        def timed_forward(plans):
            t0 = time.perf_counter()
            try:
                return forward(plans)
            finally:
                self.forward_s += time.perf_counter() - t0
                self.num_forwards += 1

        runner.step_forward = timed_forward
        self._restore = lambda: setattr(runner, "step_forward", forward)
        start = structured_output_module.StructuredOutput.start_masks
        timer = self

        def start_masks(so, requests, drafts):
            future = start(so, requests, drafts)
            if future is None:
                return None
            result = future.result

            def timed_result(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return result(*args, **kwargs)
                finally:
                    timer.mask_wait_s += time.perf_counter() - t0

            future.result = timed_result
            return future

        structured_output_module.StructuredOutput.start_masks = start_masks
        self._restore_masks = lambda: setattr(structured_output_module.StructuredOutput, "start_masks", start)

    def close(self) -> None:
        self._restore()
        self._restore_masks()


def decode_rate(llm: LLM, prompts: list[str], cases: list[dict], constrained: bool, max_tokens: int) -> tuple:
    """Median seconds of the steps in which every request decodes (one token each), and the CPU sample."""
    engine = llm.llm_engine
    for prompt, case in zip(prompts, cases):
        spec = StructuredOutputsParams(json=case["schema"], jump_forward=False) if constrained else None
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=spec))
    step_s = []
    with CpuMonitor() as monitor:
        while engine.has_unfinished_requests():
            all_decode = engine.scheduler.num_running == len(prompts) and all(
                r.num_computed_tokens == r.num_tokens - 1 for r in engine.scheduler.running
            )
            t0 = time.perf_counter()
            engine.step()
            if all_decode:
                step_s.append(time.perf_counter() - t0)
    return statistics.median(step_s) if step_s else float("nan"), len(step_s), monitor.sample


def jump_forward_run(llm: LLM, prompts: list[str], cases: list[dict], jump: bool, max_tokens: int) -> dict:
    """Times from the step after which every request has its first token (prefill left out) to the end."""
    engine = llm.llm_engine
    ids = []
    for prompt, case in zip(prompts, cases):
        spec = StructuredOutputsParams(json=case["schema"], disable_any_whitespace=True, jump_forward=jump)
        ids.append(
            engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=spec))
        )
    finals = {}
    timer = None
    try:
        with CpuMonitor() as monitor:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        finals[out.request_id] = out.outputs[0]
                scheduler = engine.scheduler
                if timer is None and not scheduler.waiting and all(r.num_output_tokens for r in scheduler.running):
                    timer, t0 = StepTimer(llm), time.perf_counter()  # every prompt computed: decoding from here
            wall = time.perf_counter() - t0
    finally:
        if timer is not None:
            timer.close()
    return {
        "wall_s": wall,
        "forward_s": timer.forward_s,
        "mask_wait_s": timer.mask_wait_s,
        "forwards": timer.num_forwards,
        "tokens": sum(len(finals[i].token_ids) for i in ids),
        "texts": [finals[i].text for i in ids],
        "other_share": monitor.sample.other_share,
    }


def chunk_cost(llm: LLM, reps: int) -> dict[int, float]:
    """Median seconds of a step computing q tokens of one request (the last q of 160 + q - 1), for q in 1, 2, 4, 8."""
    engine = llm.llm_engine
    ids = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 20)[:160]
    out = {}
    for q in (1, 2, 4, 8):
        times = []
        for rep in range(reps):
            request_id = f"chunk-{q}-{rep}"
            engine.add_request(ids, SamplingParams(max_tokens=q + 1, ignore_eos=True), request_id=request_id)
            engine.step()  # the prompt, and its first token
            engine.scheduler.requests[request_id].append_output_token_ids([ids[5]] * (q - 1))  # q tokens to compute
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
            engine.abort_request(request_id)
        out[q] = statistics.median(times)
    return out


def format_chunk_cost(args, cost: dict[int, float], sample) -> str:
    lines = [
        f"SmolLM2-135M-Instruct ({str(args.dtype).removeprefix('torch.')}), one request at 160 tokens of context, "
        f"median of {args.reps * 3} steps; other processes took {sample.other_share:.0%} of the CPU meanwhile. "
        f"{describe_machine()}. Command: `python benchmarks/structured_output.py --doc docs/structured_output.md "
        "--chunk-cost`.",
        "",
        "| tokens computed in the step | ms | vs one token |",
        "|---:|---:|---:|",
    ]
    lines += [f"| {q} | {1e3 * s:.1f} | {s / cost[1]:.2f} |" for q, s in cost.items()]
    return "\n".join(lines) + "\n"


# Schema-heavy outputs: long property names around short enum / boolean / small-integer values, where most of the
# document is structure the grammar forces (what jump-forward is for). Hand-written, like the 58 real-world ones.
_FLAGS = ["enable_automatic_software_updates", "allow_anonymous_usage_statistics", "require_two_factor_authentication",
          "show_desktop_notifications_for_messages", "synchronize_settings_across_devices"]  # fmt: skip
HEAVY_CASES = [
    {
        "task": "the settings of a laptop",
        "schema": {
            "type": "object",
            "properties": {
                **{name: {"type": "boolean"} for name in _FLAGS},
                "preferred_color_theme_for_the_interface": {"enum": ["light_theme", "dark_theme", "system_default"]},
                "display_brightness_percentage_level": {"type": "integer", "minimum": 0, "maximum": 100},
                "keyboard_backlight_timeout_setting": {"enum": ["never_turn_off", "after_thirty_seconds"]},
            },
            "required": [
                *_FLAGS,
                "preferred_color_theme_for_the_interface",
                "display_brightness_percentage_level",
                "keyboard_backlight_timeout_setting",
            ],  # fmt: skip
            "additionalProperties": False,
        },
    },
    {
        "task": "a shipment's status record",
        "schema": {
            "type": "object",
            "properties": {
                "shipment_current_delivery_status": {"enum": ["awaiting_pickup", "in_transit", "out_for_delivery"]},
                "package_requires_signature_on_delivery": {"type": "boolean"},
                "package_contains_fragile_items": {"type": "boolean"},
                "number_of_delivery_attempts_so_far": {"type": "integer", "minimum": 0, "maximum": 9},
                "carrier_service_level_agreement_tier": {"enum": ["standard_ground", "express_overnight"]},
                "customs_clearance_documentation_status": {"enum": ["not_required", "pending_review", "cleared"]},
            },
            "required": [
                "shipment_current_delivery_status",
                "package_requires_signature_on_delivery",
                "package_contains_fragile_items",
                "number_of_delivery_attempts_so_far",
                "carrier_service_level_agreement_tier",
                "customs_clearance_documentation_status",
            ],  # fmt: skip
            "additionalProperties": False,
        },
    },
]


def schema_heavy(llm: LLM, args) -> str:
    """Jump-forward off vs on (every forced run) on HEAVY_CASES, one request at a time; medians of --reps."""
    prompts = prompts_for(llm, HEAVY_CASES)
    so = llm.llm_engine.model_runner.structured_output
    runs = {False: [], True: []}
    for _ in range(args.reps):
        for jump in (False, True):
            so.min_jump_forward_tokens = 1
            parts = [jump_forward_run(llm, [p], [c], jump, args.max_tokens) for p, c in zip(prompts, HEAVY_CASES)]
            total = {k: sum(r[k] for r in parts) for k in ("wall_s", "forwards", "tokens", "other_share")}
            total["other_share"] /= len(parts)
            total["texts"] = [t for r in parts for t in r["texts"]]
            runs[jump].append(total)
    valid = all(is_valid(t, c["schema"]) for t, c in zip(runs[True][0]["texts"], HEAVY_CASES))
    off, on = (median_kept(runs[j], "wall_s", args.threshold) for j in (False, True))
    lines = [
        f"SmolLM2-135M-Instruct ({str(args.dtype).removeprefix('torch.')}), greedy, compact JSON, {len(HEAVY_CASES)} "
        f"schema-heavy schemas (HEAVY_CASES: long keys, enum / boolean / integer values) one at a time, medians of "
        f"{args.reps}. {describe_machine()}. Command: `python benchmarks/structured_output.py --doc "
        f"docs/structured_output.md --schema-heavy`.",
        "",
        "| jump-forward | decode s | forwards | output tokens | tokens / forward | speedup | other CPU share |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for jump, wall in ((False, off), (True, on)):
        first = runs[jump][0]
        shares = ", ".join(f"{r['other_share']:.0%}" for r in runs[jump])
        lines.append(
            f"| {'on, every forced run' if jump else 'off'} | {wall:.2f} | {first['forwards']} | {first['tokens']} | "
            f"{first['tokens'] / max(first['forwards'], 1):.2f} | {off / wall:.2f}x | {shares} |"
        )
    same = runs[True][0]["texts"] == runs[False][0]["texts"]
    lines += ["", f"Outputs valid against their schemas: {valid}; the same text with and without: {same}."]
    return "\n".join(lines) + "\n"


def jf_modes(jf: dict, batch: str) -> list:
    return [j for b, j in jf if b == batch]


def median_kept(runs: list[dict], key: str, threshold: float) -> float:
    kept = [r[key] for r in runs if r["other_share"] <= threshold] or [r[key] for r in runs]
    return statistics.median(kept)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--doc", type=Path, default=None, help="write the tables into this markdown file")
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--batch1-cases", type=int, default=6, help="schemas timed one at a time for jump-forward")
    parser.add_argument("--threshold", type=float, default=0.10, help="leave out repetitions above this foreign CPU")
    parser.add_argument("--chunk-cost", action="store_true", help="only part 4: the step cost of 1-8 new tokens")
    parser.add_argument("--schema-heavy", action="store_true", help="only part 5: jump-forward on schema-heavy output")
    parser.add_argument("--num-schemas", type=int, default=None, help="the first N schemas only (a quick check)")
    args = parser.parse_args()
    cases = json.loads(SCHEMAS.read_text())[: args.num_schemas]
    llm = LLM(MODEL, progress=False)
    prompts = prompts_for(llm, cases)
    args.dtype = llm.dtype
    if args.schema_heavy:
        report = schema_heavy(llm, args)
        print(report)
        if args.doc is not None:
            replace_section(args.doc, "structured-output-heavy", report)
        return
    if args.chunk_cost:
        with CpuMonitor() as monitor:
            cost = chunk_cost(llm, args.reps * 3)
        report = format_chunk_cost(args, cost, monitor.sample)
        print(report)
        if args.doc is not None:
            replace_section(args.doc, "structured-output-chunks", report)
        return

    t0 = time.perf_counter()
    valid = validity(llm, cases, prompts, args.max_tokens)
    print(f"validity done in {time.perf_counter() - t0:.0f} s", flush=True)

    batch_cases, batch_prompts = cases[: args.batch], prompts[: args.batch]
    rate = {True: [], False: []}
    for _ in range(args.reps):
        for constrained in (False, True):
            step_s, num_steps, sample = decode_rate(llm, batch_prompts, batch_cases, constrained, 64)
            rate[constrained].append({"step_s": step_s, "steps": num_steps, "other_share": sample.other_share})
            print("batch", constrained, rate[constrained][-1], flush=True)

    so = llm.llm_engine.model_runner.structured_output
    default_min = so.min_jump_forward_tokens
    # off, on (runs >= MIN_JUMP_FORWARD_TOKENS), and on for every forced run when that default is above 1
    modes = (False, True) if default_min == 1 else (False, True, "every")
    jf = {(b, j): [] for b in ("batch1", "batch") for j in modes}
    for _ in range(args.reps):
        for jump in modes:
            so.min_jump_forward_tokens = 1 if jump == "every" else default_min
            jf["batch", jump].append(jump_forward_run(llm, batch_prompts, batch_cases, bool(jump), args.max_tokens))
            runs = [
                jump_forward_run(llm, [p], [c], bool(jump), args.max_tokens)
                for p, c in zip(prompts[: args.batch1_cases], cases[: args.batch1_cases])
            ]
            jf["batch1", jump].append(
                {
                    k: sum(r[k] for r in runs)
                    for k in ("wall_s", "forward_s", "mask_wait_s", "forwards", "tokens", "other_share")
                }
                | {"texts": [t for r in runs for t in r["texts"]]}
            )
            jf["batch1", jump][-1]["other_share"] /= len(runs)
            print("jump", jump, {k: v for k, v in jf["batch", jump][-1].items() if k != "texts"}, flush=True)
    args.min_jump_forward_tokens = default_min
    report = format_report(args, cases, valid, rate, jf)
    print(report)
    if args.doc is not None:
        replace_section(args.doc, "structured-output", report)


def format_report(args, cases, valid, rate, jf) -> str:
    rows = valid["rows"]
    n = len(rows)
    count = {k: sum(r[k] for r in rows) for k in ("free", "free_lenient", "constrained")}
    stopped = sum(r["constrained_finish"] == "stop" for r in rows)
    invalid_constrained = [r for r in rows if not r["constrained"]]
    lines = [
        f"SmolLM2-135M-Instruct ({str(args.dtype).removeprefix('torch.')}), greedy. {describe_machine()}. Command: "
        f"`python benchmarks/structured_output.py --doc docs/structured_output.md --max-tokens {args.max_tokens} "
        f"--batch {args.batch} --reps {args.reps}`. Timed repetitions with other processes above "
        f"{args.threshold:.0%} of the CPU are left out of the medians when any repetition is below it (this machine "
        "is shared with other agents: the share is reported).",
        "",
        f"### Validity: {n} JSON schemas (benchmarks/data/structured_output_schemas.json), <= {args.max_tokens} tokens",
        "",
        "| output | json.loads + jsonschema.validate |",
        "|---|---:|",
        f"| free | {count['free']}/{n} ({count['free'] / n:.0%}) |",
        f"| free, a Markdown code fence stripped | {count['free_lenient']}/{n} ({count['free_lenient'] / n:.0%}) |",
        f"| constrained (structured_outputs json) | {count['constrained']}/{n} ({count['constrained'] / n:.0%}) |",
        "",
        f"Constrained outputs that ended by themselves: {stopped}/{n}. Every constrained output is a prefix of a valid "
        "document by construction; the invalid ones ran out of tokens "
        + (
            "(" + ", ".join(f"{r['name']}: {r['constrained_tokens']} tokens" for r in invalid_constrained[:8]) + ")"
            if invalid_constrained
            else "(none here)"
        )
        + ", typically a 135M model repeating inside a free string.",
        "",
    ]
    free_step = median_kept(rate[False], "step_s", args.threshold)
    con_step = median_kept(rate[True], "step_s", args.threshold)
    shares = lambda runs: ", ".join(f"{r['other_share']:.0%}" for r in runs)  # noqa: E731
    lines += [
        f"### Mask cost: decode at batch {args.batch} (median step where all {args.batch} requests decode)",
        "",
        "| rows | ms / step | tokens / s | vs free | other processes' CPU share per repetition |",
        "|---|---:|---:|---:|---|",
        f"| free | {1e3 * free_step:.1f} | {args.batch / free_step:.0f} | 1.00 | {shares(rate[False])} |",
        f"| constrained (jump-forward off) | {1e3 * con_step:.1f} | {args.batch / con_step:.0f} | "
        f"{free_step / con_step:.3f} | {shares(rate[True])} |",
        "",
        f"### Jump-forward decoding on compact JSON (disable_any_whitespace), up to {args.max_tokens} tokens",
        "",
        "Decode phase only (from the step after which every request has its first token). Tokens and forwards "
        "are those of the decode phase's first repetition; times are medians.",
        "",
        "| batch | jump-forward | decode s | forwards | output tokens | tokens / forward | forward s | mask waited s "
        "| rest s | speedup | same text | other CPU share |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for batch in ("batch1", "batch"):
        label = f"1 (x{args.batch1_cases} schemas, one at a time)" if batch == "batch1" else str(args.batch)
        base = median_kept(jf[batch, False], "wall_s", args.threshold)
        same = {j: jf[batch, False][0]["texts"] == jf[batch, j][0]["texts"] for j in jf_modes(jf, batch)}
        for jump in jf_modes(jf, batch):
            runs = jf[batch, jump]
            med = {k: median_kept(runs, k, args.threshold) for k in ("wall_s", "forward_s", "mask_wait_s")}
            forwards, tokens = runs[0]["forwards"], runs[0]["tokens"]
            mode = JUMP_LABELS[jump].format(args.min_jump_forward_tokens)
            lines.append(
                f"| {label} | {mode} | {med['wall_s']:.2f} | {forwards} | {tokens} | "
                f"{tokens / max(forwards, 1):.2f} | {med['forward_s']:.2f} | {med['mask_wait_s']:.3f} | "
                f"{med['wall_s'] - med['forward_s'] - med['mask_wait_s']:.2f} | {base / med['wall_s']:.2f}x | "
                f"{'yes' if same[jump] else 'no'} | {shares(runs)} |"
            )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
