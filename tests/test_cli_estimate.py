"""`leanlm estimate` end to end on presets: flags -> EstimateSettings -> table, JSON and roofline PNG."""

from __future__ import annotations

import json

import pytest

from leanlm.cli import main


def test_estimate_prints_the_table(capsys):
    assert main(["estimate", "--model", "llama-2-70b", "--hardware", "h100", "--dtype", "int4"]) == 0
    out = capsys.readouterr().out
    assert "llama-2-70b (preset): 80 layers, d=8192, 64 heads / 8 KV heads of 128" in out
    assert "weights int4 (4.125 bits), KV bf16 (16 bits)" in out
    assert "total              68,976,648,192  100.0%" in out
    assert "KV cache per token         327.68 kB" in out
    assert "decode b=1 @ 2048" in out and "memory" in out


def test_estimate_json_is_machine_readable(capsys):
    assert (
        main(
            [
                "estimate",
                "--model",
                "llama-7b",
                "--hardware",
                "a100",
                "--kv-dtype",
                "fp16",
                "--batch",
                "64",
                "--context",
                "2048",
                "--json",
                "--tokens-per-s",
                "500",
            ]
        )
        == 0
    )
    r = json.loads(capsys.readouterr().out)
    assert r["memory"]["kv_cache_bytes"] == 2 * 2 * 32 * 4096 * 2048 * 64
    assert r["params"]["total"] == 6_738_415_616
    assert r["hardware"]["memory_bandwidth"] == 2.039e12
    assert [st["batch"] for st in r["steps"] if st["phase"] == "decode"] == sorted({1, 8, 64, r["memory"]["max_batch"]})
    assert 0 < r["utilization"]["mbu"] < 1 and 0 < r["utilization"]["mfu"] < 1


def test_estimate_moe_shows_active_params(capsys):
    assert main(["estimate", "--model", "mixtral-8x7b", "--hardware", "h200"]) == 0
    out = capsys.readouterr().out
    assert "MoE 8 experts top-2" in out and "active per token" in out and "router" in out


def test_estimate_plot_writes_a_png(tmp_path, capsys):
    out = tmp_path / "roofline.png"
    assert main(["estimate", "--model", "gpt-3-175b", "--hardware", "h100", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_estimate_long_context_compares_window_and_budget_with_full_attention(capsys):
    argv = [
        "estimate",
        "--model",
        "llama-3.1-8b",
        "--attention-window",
        "1024",
        "--attention-sinks",
        "4",
        "--kv-budget",
        "32768",
    ]
    assert main([*argv, "--json"]) == 0
    lc = json.loads(capsys.readouterr().out)["long_context"]
    kv_token = 2 * 32 * 8 * 128 * 2  # 2 (K, V) x L x Hkv x D x 2 bytes
    assert [r["context"] for r in lc["rows"]] == [4096, 8192, 16384, 32768, 65536, 131072]
    last = lc["rows"][-1]
    assert last["full"]["kv_bytes"] == 131072 * kv_token
    assert last["window"]["kv_bytes"] == 1028 * kv_token and last["budget"]["kv_bytes"] == 32768 * kv_token
    assert last["window"]["decode_flops"] == 4 * 32 * 1028 * 4096
    assert last["budget"]["prefill_flops"] == last["full"]["prefill_flops"] == 4 * 32 * 4096 * 131072 * 131073 / 2
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "KV cache per sequence" in out and "window 1024+4" in out and "budget 32768" in out
    assert "131,072*" in out and "17.18 GB" in out  # the model's own context; 131072 tokens x 131072 B


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--hardware", "a100", "--measure"], "--measure measures this machine"),
        (["--dtype", "int3"], "unknown weight format"),
        (["--batch", "0"], "--batch must be >= 1"),
        (["--model", "no-such-model"], "preset"),
        (["--sinks", "4"], "--attention-sinks keep the first tokens beside a window: set --attention-window too"),
        (["--kv-budget", "0"], "--kv-budget must be >= 1"),
    ],
)
def test_estimate_bad_flags_say_what_to_do(argv, message, capsys):
    assert main(["estimate", "--model", "llama-7b", *argv]) == 2
    assert message in capsys.readouterr().err
