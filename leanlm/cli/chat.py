"""`leanlm chat`: interactive chat, streaming tokens."""

from __future__ import annotations

import argparse
import sys

from leanlm.cli.common import (
    add_model_args,
    add_sampling_args,
    load_llm,
    sampling_params,
)
from leanlm.loading.chat_encoding import encode_chat


def cmd_chat(args: argparse.Namespace) -> int:
    params = sampling_params(args)
    llm = load_llm(args)
    engine, tokenizer = llm.llm_engine, llm.tokenizer
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    print(f"Chatting with {args.model}. /reset clears the history, /exit or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        text = line.strip()
        if text in ("/exit", "/quit"):
            break
        if text == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not text:
            continue
        messages.append({"role": "user", "content": text})
        _, prompt_ids = encode_chat(tokenizer, messages)  # control-token text in a message stays text
        request_id = engine.add_request(prompt_ids, params)
        shown, reply = 0, ""
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == request_id:
                    reply = out.outputs[0].text
                    print(reply[shown:], end="", flush=True)
                    shown = len(reply)
        print(flush=True)
        messages.append({"role": "assistant", "content": reply})
    return 0


def add_parser(sub) -> None:
    chat = sub.add_parser("chat", help="interactive chat, streaming tokens")
    chat.add_argument("--system", default=None, help="system prompt")
    add_model_args(chat)
    add_sampling_args(chat, max_tokens=256)
    chat.set_defaults(func=cmd_chat)
