"""The benchmarks still run: each one's --quick mode, end to end (timing is printed, never asserted)."""

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
@pytest.mark.parametrize("module, keys", [
    ("benchmarks.agentic", {"lockstep", "async", "bare", "async_over_lockstep", "async_over_bare", "async_over_bare_runs"}),
    ("benchmarks.weight_sync", {"plain_copy_s", "push_s", "push_over_copy", "peak_bucket_bytes"}),
    ("benchmarks.chat_proxy", {"proxy_requests_per_s", "bare_requests_per_s", "proxy_over_bare_requests"}),
    ("benchmarks.balance", {"plain_s", "balanced_s", "plain_over_balanced"}),
    ("benchmarks.lora_memory", {"full_adam_bytes", "lora_adam_bytes", "full_over_lora_adam"}),
    ("benchmarks.checkpointing", {"off", "on", "on_over_off"}),
    ("benchmarks.rollout", {"hf_tokens_per_s", "vllm-fp32_tokens_per_s", "hf_sync_over_copy", "vllm-fp32_sync_over_copy"}),
    ("benchmarks.step", {"stages", "fixed_s", "fixed_total_s", "wall_s", "worker_compute_s", "peak_rss_bytes",
                         "padding_share", "memory"}),
    ("benchmarks.packing", {"padding_share", "seconds", "valid_tokens"}),
    ("benchmarks.grpo_vs_trl", {"cpu", "step_s", "trl_over_rlcore", "results"}),
    ("benchmarks.watchdog", {"phase_watched_us", "call_recorded_us", "step_on_s", "step_off_s", "predicted_share"}),
    ("benchmarks.consistency", {"step_s", "mismatch_s", "driver_check_s_mean", "overhead_pct", "tokens_checked"}),
])
def test_quick_mode_runs_and_writes_its_json(module, keys, tmp_path, preloaded_python):
    """``python -m <module> --quick --json FILE`` in a process of its own, forked from an interpreter that
    imported torch, Ray & co. once (tests/preloaded_python.py: ~6 s of CPU less per benchmark)."""
    out = tmp_path / "result.json"
    proc = preloaded_python.run(module, "--quick", "--json", str(out), cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert keys <= result.keys()
    assert all(result[k] > 0 for k in keys if isinstance(result[k], float))


def test_useful_flops_of_smollm2_by_hand():
    """SmolLM2-135M's shape (hidden 576, 30 layers, MLP 1536, 9 heads of 64, 3 KV heads, 49152 tokens):
    per layer q, o 576x576, k, v 576x192, MLP 3 x 576x1536; the tied head 576x49152."""
    from types import SimpleNamespace

    from benchmarks.machine_limit import ModelShape, mfu

    config = SimpleNamespace(hidden_size=576, num_hidden_layers=30, intermediate_size=1536, num_attention_heads=9,
                             num_key_value_heads=3, vocab_size=49152)
    shape = ModelShape.from_config(config)
    per_layer = 2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536
    assert shape.matmul_params == 30 * per_layer + 576 * 49152 == 134_479_872
    assert shape.attention_width == 576
    # 10 tokens attending to 4 positions each: 2 x params + 4 x layers x width x 4 per token
    assert shape.forward_flops(10, 4.0) == 10 * (2 * 134_479_872 + 4 * 30 * 576 * 4)
    # 2 groups of a 6-token prompt (prefilled once each), 4 responses of 3 tokens
    sampled = 2 * shape.forward_flops(6, 3.0) + 4 * shape.forward_flops(3, 6 + 1.5)
    assert shape.sampling_flops(6, 2, 4, 3) == sampled
    assert shape.training_flops(6, 2, 4, 3) == 3 * sampled
    assert mfu(100.0, 2.0, 100.0) == 0.5


def test_the_measured_peak_is_the_best_kernel_and_window_per_dtype(monkeypatch):
    from benchmarks import machine_limit

    readings = iter([{"torch.mm": 151e9, "oneDNN": 170e9}, {"torch.mm": 400e9},  # start: fp32, bf16
                     {"torch.mm": 176e9, "oneDNN": 160e9}, {"torch.mm": 380e9}])  # end
    monkeypatch.setattr(machine_limit, "kernel_peaks", lambda dtype, size, seconds: next(readings))
    peaks = machine_limit.MeasuredPeak(("float32", "bfloat16"))
    assert peaks.measure("start") == {"float32": 170e9, "bfloat16": 400e9}
    peaks.measure("end")
    assert peaks.best == {"float32": 176e9, "bfloat16": 400e9}
    assert peaks.describe() == ("float32 176 GFLOP/s (start: torch.mm 151, oneDNN 170; end: torch.mm 176, oneDNN 160), "
                                "bfloat16 400 GFLOP/s (start: torch.mm 400; end: torch.mm 380)")


def test_a_dtype_has_one_name_for_the_peaks():
    import torch

    from benchmarks.machine_limit import dtype_name

    assert {dtype_name(d) for d in ("fp32", "float32", "torch.float32", torch.float32)} == {"float32"}
    assert {dtype_name(d) for d in ("bf16", "bfloat16", torch.bfloat16)} == {"bfloat16"}


def test_every_kernel_is_timed_and_the_peak_is_the_fastest():
    from benchmarks.machine_limit import kernel_peaks, matmul_peak

    rates = kernel_peaks("float32", size=64, seconds=0.01)
    assert set(rates) == {"torch.mm", "oneDNN"} and all(r > 0 for r in rates.values())  # oneDNN: in torch's x86 builds
    assert matmul_peak("float32", size=64, seconds=0.01) > 0


def test_matmul_peak_is_a_rate_per_dtype():
    from benchmarks.machine_limit import matmul_peak

    assert matmul_peak("float32", size=64, seconds=0.01) > 0
    assert matmul_peak("bf16", size=64, seconds=0.01) > 0


def test_useful_flops_of_the_as_run_update_count_the_trained_groups_prompts_once():
    """grpo_vs_trl's as-run update (zero-advantage rows skipped) is credited with the trained rows only,
    each trained group's prompt once: 2 groups of 2 rows, prompts of 3 and 5 tokens, responses of 2;
    the second group's advantages are zero, so its rows (and its prompt) earn nothing."""
    import numpy as np
    import torch

    from benchmarks.grpo_vs_trl import useful_flops
    from benchmarks.machine_limit import ModelShape
    from rlcore.protocol import DataProto

    shape = ModelShape(matmul_params=1000, layers=2, attention_width=8)
    attention_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1],
                                   [1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    batch = DataProto.from_dict({"attention_mask": attention_mask, "response_mask": torch.ones(4, 2),
                                 "advantages": torch.tensor([[0.7, 0.7], [-0.7, -0.7], [0.0, 0.0], [0.0, 0.0]])},
                                {"uid": np.array(["a", "a", "b", "b"], dtype=object)})
    as_run = useful_flops(shape, batch, skip_zero_advantage_rows=True)
    assert as_run["update"] == shape.training_flops(3, 1, 2, 2)  # one prompt of 3 tokens, two responses of 2
    every_row = useful_flops(shape, batch, skip_zero_advantage_rows=False)
    assert every_row["update"] == shape.training_flops(4, 2, 4, 2)  # both prompts (mean 4 tokens), four responses
    assert as_run["generate"] == every_row["generate"] == shape.sampling_flops(4, 2, 4, 2)
