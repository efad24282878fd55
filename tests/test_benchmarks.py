"""The benchmarks still run: each one's --quick mode, end to end (timing is printed, never asserted)."""

import json
import subprocess
import sys
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
    ("benchmarks.rollout", {"hf_tokens_per_s", "vllm-fp32_tokens_per_s", "hf_sync_over_copy", "vllm-fp32_sync_over_copy",
                            "vllm-fp32-loader_sync_over_copy"}),
    ("benchmarks.step", {"stages", "fixed_s", "fixed_total_s", "wall_s", "worker_compute_s", "peak_rss_bytes",
                         "padding_share"}),
    ("benchmarks.packing", {"padding_share", "seconds", "valid_tokens"}),
    ("benchmarks.grpo_vs_trl", {"cpu", "step_s", "trl_over_rlcore", "results"}),
    ("benchmarks.watchdog", {"phase_watched_us", "call_recorded_us", "step_on_s", "step_off_s", "predicted_share"}),
    ("benchmarks.consistency", {"step_s", "mismatch_s", "driver_check_s_mean", "overhead_pct", "tokens_checked"}),
])
def test_quick_mode_runs_and_writes_its_json(module, keys, tmp_path):
    out = tmp_path / "result.json"
    proc = subprocess.run([sys.executable, "-m", module, "--quick", "--json", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert keys <= result.keys()
    assert all(result[k] > 0 for k in keys if isinstance(result[k], float))
