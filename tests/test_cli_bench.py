"""`leanlm bench serve` end to end against the stub server: flags -> LoadConfig -> table and JSON."""

from __future__ import annotations

import json

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from leanlm.cli import build_parser, main
from leanlm.loading.tokenizer import Tokenizer
from tests.analysis.stub_server import MODEL_ID, StubState, build_app, serve_in_thread

WORDS = "the quick brown fox jumps over lazy dog".split()


def word_tokenizer_dir(path):
    """A word-level tokenizer directory whose end token is id 0 (loads in milliseconds, unlike a GGUF's)."""
    vocab = {"<eos>": 0, "<unk>": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    backend = HFTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    Tokenizer(backend, bos_token=None, eos_token="<eos>", chat_template=None).save(path)
    return path


def test_bench_serve_prints_table_and_writes_json(tmp_path, capsys):
    data = tmp_path / "text.txt"
    data.write_text(" ".join(WORDS * 100))
    tokenizer = word_tokenizer_dir(tmp_path / "tokenizer")
    state = StubState()
    with serve_in_thread(build_app(state)) as url:
        code = main(
            [
                "bench",
                "serve",
                "--url",
                url,
                "--num-requests",
                "4",
                "--max-concurrency",
                "2",
                "--input-len",
                "16",
                "--output-len",
                "5",
                "--data",
                str(data),
                "--tokenizer",
                str(tokenizer),
                "--json",
                str(tmp_path / "out.json"),
                "--no-progress",
            ]
        )
    assert code == 0
    table = capsys.readouterr().out
    assert f"model: {MODEL_ID}" in table and f"| metric | {url} |" in table
    assert "| completed / failed | 4 / 0 |" in table
    assert state.max_active <= 2 and len(state.payloads) == 4
    assert state.payloads[0]["logit_bias"] == {"0": -100}
    assert {p["prompt"] for p in state.payloads} == {" ".join(WORDS * 2)}  # 16-token pieces of the text
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["summary"]["total_output_tokens"] == 20
    assert out["config"]["max_concurrency"] == 2 and len(out["records"]) == 4


def test_bench_is_a_group_of_subcommands():
    args = build_parser().parse_args(["bench", "serve", "--request-rate", "inf", "--no-ignore-eos"])
    assert args.bench_command == "serve" and args.request_rate == float("inf") and not args.ignore_eos
