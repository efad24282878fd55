"""The GPU device check (scripts/device_check.sh) kept from rotting between the tasks lent a GPU.

The dry run is the device's code path with the device forced to CPU at tiny sizes: the same
processes, parts, comparison, recipes and pytest plugin, the vendor folder on PYTHONPATH (built here
when the checkout has none) and the import guard, under which `import ray` / `import vllm` fail
although both are installed here. A passing run proves the check needs neither, and that everything
it imports at module level is on the device image or in the vendor folder.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from scripts import device_guard
from scripts.device_throughput import SHAPES, flops_per_token, pass_flops

REPO = Path(__file__).resolve().parent.parent
PARTS = {"target.env", "target.workers_fp32", "target.workers_bf16", "reference.workers_fp32",
         "reference.workers_bf16", "recipes.compare", "recipes.grpo", "recipes.ppo", "recipes.check_bf16",
         "unit.pytest"}


@pytest.fixture(scope="module")
def vendor(tmp_path_factory) -> Path:
    built = REPO / ".device_vendor"
    if (built / "PINS.txt").exists():
        return built
    dest = tmp_path_factory.mktemp("device") / "vendor"
    subprocess.run(["bash", "scripts/vendor_for_device.sh", str(dest)], cwd=REPO, check=True, timeout=300,
                   env={**os.environ, "PYTHON": sys.executable})
    return dest


@pytest.mark.slow
def test_cpu_dry_run_passes_without_ray_or_vllm(tmp_path, vendor):
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "PYTHONPATH")}
    result = subprocess.run(["bash", "scripts/device_check.sh", "--cpu", "--out", str(tmp_path)], cwd=REPO,
                            env={**env, "PYTHON": sys.executable, "DEVICE_VENDOR": str(vendor)},
                            capture_output=True, text=True, timeout=900)
    output = result.stdout[-6000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "device_check.json").read_text())
    assert result.returncode == 0 and report["ok"], output
    assert set(report["parts"]) == PARTS and "rlcore device check: PASSED" in result.stdout
    for name, proc in report["procs"].items():
        imports = proc["imports"]
        assert imports["blocked_loaded"] == [] and imports["not_on_image"] == [], (name, imports)
        assert set(imports["vendored_from"].values()) == {str(vendor)}, (name, imports["vendored_from"])
    compare = report["parts"]["recipes.compare"]
    assert compare["fp32"]["ok"] and compare["bf16"]["ok"] and compare["fp32"]["greedy_rows_identical"] == 1.0
    for recipe in ("grpo", "ppo"):
        part = report["parts"][f"recipes.{recipe}"]
        assert part["steps"] == 2 and part["tokens_per_s"]["update_actor"] > 0, part
    check = report["parts"]["recipes.check_bf16"]  # bf16 on both sides: silent; the sync left out: named at step 1
    assert check["clean_warnings"] == [] and check["unsynced_first_verdict"] == [1, "weights_not_synced"], check
    assert report["parts"]["unit.pytest"]["counts"]["passed"] > 0
    assert (tmp_path / "device_check_log.txt").stat().st_size > 0


def test_guard_refuses_ray_vllm_and_vendored_packages_outside_the_vendor_folder(tmp_path):
    code = ("from scripts import device_guard; device_guard.install()\n"
            "for name in ('ray', 'vllm.config', 'omegaconf'):\n"
            "    try:\n        __import__(name)\n    except ModuleNotFoundError as e:\n        print('refused', name)\n"
            "import json; print(json.dumps(device_guard.audit()['blocked_attempts']))\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                            env={**os.environ, "RLCORE_DEVICE_VENDOR": str(tmp_path)})  # an empty vendor folder
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:3] == ["refused ray", "refused vllm.config", "refused omegaconf"]
    assert json.loads(lines[3]) == ["ray (from <string>)", "vllm (from <string>)"]  # the package first


def test_module_level_imports_leave_out_lazy_and_optional_ones(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("import os\nfrom pydantic import BaseModel\ntry:\n    import ray\nexcept ImportError:\n"
                      "    ray = None\nif True:\n    import yaml.constructor\n\ndef f():\n    import vllm\n")
    assert device_guard._module_level_imports(sample) == {"os", "pydantic", "yaml"}


def test_throughput_flops_per_token_and_the_qwen_shapes_match_their_published_sizes():
    counts = {"matmul_parameters": 10, "layers": 2, "q_width": 4}
    assert flops_per_token(counts, 3.0, training=False) == 2 * 10 + 4 * 2 * 4 * 3  # 116
    assert flops_per_token(counts, 3.0, training=True) == 3 * 116
    for shape, published in (("qwen2.5-0.5b", 494_032_768), ("qwen2.5-1.5b", 1_543_714_304)):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(Qwen2Config(**SHAPES[shape], tie_word_embeddings=True))
        assert sum(p.numel() for p in model.parameters()) == published, shape


def test_throughput_counts_a_shared_prompt_once():
    """MFU's FLOPs on the tokens computed: with nothing shared, the mean-context count; 2 rows of a
    4-token prompt and 2-token responses sharing the prompt (4 of 12 tokens not computed): 8 tokens,
    attention keys 1+2+3+4 for the prompt and 5+6 for each response, by hand."""
    counts = {"matmul_parameters": 10, "layers": 2, "q_width": 4}
    assert pass_flops(counts, 2, 4.0, 2.0, 0.0, training=True) == (12, 12 * flops_per_token(counts, 3.5, training=True))
    tokens, flops = pass_flops(counts, 2, 4.0, 2.0, 4 / 12, training=False)
    assert tokens == pytest.approx(8) and flops == pytest.approx(2 * 10 * 8 + 4 * 2 * 4 * (10 + 2 * 11))


@pytest.mark.slow
def test_cpu_dry_run_of_the_throughput_benchmark(tmp_path, vendor):
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "PYTHONPATH")}
    result = subprocess.run(["bash", "scripts/device_check.sh", "--cpu", "--only", "throughput", "--out", str(tmp_path)],
                            cwd=REPO, env={**env, "PYTHON": sys.executable, "DEVICE_VENDOR": str(vendor)},
                            capture_output=True, text=True, timeout=900)
    report = json.loads((tmp_path / "device_check.json").read_text())
    assert result.returncode == 0 and report["ok"], result.stdout[-6000:] + result.stderr[-3000:]
    assert set(report["parts"]) == {"throughput.throughput_0.5b", "throughput.throughput_1.5b"}
    for part in report["parts"].values():
        assert part["steps"] == 2 and part["response_tokens_mean"] == 8.0  # ignore_eos: every response full length
        assert {"gen", "update_actor", "sync_weights", "step"} <= set(part["stage_s"])
        assert part["trained_tokens_per_s"] > 0 and part["generated_tokens_per_s"] > 0 and part["weight_sync_s"] > 0
        assert 0 < part["mfu_update_vs_measured_matmul"] < 1
        # a group's prompt computed once, the kernel that ran counted (CPU: split rows where a pack shares a
        # prompt; rows where none does: the update's one-row stand-in when no group scored mixed), the varlen probe exact
        assert 0 < part["shared_prompt_frac"] < 1 and part["computed_tokens_per_s"] < part["trained_tokens_per_s"]
        calls = part["attention_kernel_calls"]
        assert calls.get("rows_split", 0) > 0 and set(calls) <= {"rows_split", "rows_sdpa"}, calls
        assert part["attention_kernel_planned"]["kernel"] == "rows_split" and part["shared_varlen_probe"]["ok"]
    assert report["procs"]["throughput"]["imports"]["blocked_loaded"] == []
