"""The `leanlm` command: generate | chat | serve | models | bench | estimate | eval ppl|kld|tasks | quantize,
one module per command; `main` (cli/main.py) parses and maps every failure to one line on stderr."""

from leanlm.cli.evaluate import cmd_eval_kld, cmd_eval_ppl, cmd_eval_tasks
from leanlm.cli.main import build_parser, failure_message, main

__all__ = ["build_parser", "cmd_eval_kld", "cmd_eval_ppl", "cmd_eval_tasks", "failure_message", "main"]
