"""The sandbox (rlcore.rewards.sandbox and its bootstrap sandbox_child), the checks (code_checks) and
the `code` reward: hostile programs score 0 with a reason and leave no trace (no file written, no
connection made, no process left), in the mode the probe picked and in the guard mode forced; the
shipped code task's reference solutions score 1.0, also through the reward manager's process pool."""

import ast
import json
import os
import re
import select
import socket
import string
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from rlcore.data.code_tasks import DATA_SOURCE, TASKS, make_code_examples, write_code_tasks
from rlcore.models.tiny import build_char_tokenizer
from rlcore.protocol import DataProto
from rlcore.rewards import RuleRewardManager, get_reward_fn
from rlcore.rewards import code_checks, sandbox, sandbox_child
from rlcore.rewards.code_checks import check_program, extract_program, parse_tests
from rlcore.rewards.sandbox import SandboxLimits, run_sandboxed

pytestmark = pytest.mark.timeout(60)
MODES = sorted({sandbox.network_isolation(), "guard"})  # the probed mode, and the fallback forced
FAST = SandboxLimits(cpu_s=1, wall_s=3)
ADD_TESTS = json.dumps([{"call": "add(1, 2)", "expected": 3}, {"call": "add(-5, 5)", "expected": 0},
                        "assert add(2, 2) == 4"])


def reward(response, tests=ADD_TESTS, **kwargs):
    return get_reward_fn("code")(response, tests, **kwargs)


def processes_of(uids: set[int]) -> list[str]:
    """Processes running as one of ``uids`` (the fresh uids this test's runs used: none may outlive its
    run; other tests' sandboxed runs, in a parallel worker, have uids of their own)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            uid = os.stat(f"/proc/{pid}").st_uid
        except FileNotFoundError:
            continue
        if uid in uids:
            found.append(pid)
    return found


@pytest.fixture
def fresh_uids(monkeypatch) -> set[int]:
    """The fresh uids the sandbox picks during the test (sandbox._fresh_uid, recorded as it returns)."""
    picked, pick = set(), sandbox._fresh_uid

    def recorded() -> int:
        uid = pick()
        picked.add(uid)
        return uid

    monkeypatch.setattr(sandbox, "_fresh_uid", recorded)
    return picked


def test_the_isolation_mode_is_reported():
    assert sandbox.network_isolation() in ("namespace", "guard")
    assert sandbox.isolation_note().startswith(sandbox.network_isolation() + ": ")


def test_the_bootstrap_imports_the_standard_library_only():
    """It runs as `python -I -S sandbox_child.py SPEC`, maybe as a uid that cannot read the project."""
    tree = ast.parse(Path(sandbox_child.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {"." * node.level + (node.module or "").split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom)}
    assert imported and imported <= sys.stdlib_module_names, imported - sys.stdlib_module_names


def test_a_failed_probe_falls_back_to_the_guard_mode(monkeypatch):
    def no_namespaces(*args):
        raise OSError("no unshare here")

    monkeypatch.setattr(sandbox, "_run", no_namespaces)
    mode, why = sandbox._probe()
    assert mode == "guard" and "no unshare here" in why


@pytest.mark.parametrize("mode", MODES)
def test_a_clean_program_runs_with_its_stdin_in_its_own_directory(mode, monkeypatch):
    monkeypatch.setenv("HTTP_PROXY", "http://proxy.invalid:3128")  # the environment is scrubbed, proxies too
    result = run_sandboxed("import os, sys\nprint(sys.stdin.read().upper(), os.path.basename(os.getcwd()))\n"
                           "open('scratch.txt', 'w').write('ok')\nprint(os.environ.get('HTTP_PROXY'))",
                           stdin="abc", mode=mode)
    assert result.ok and result.reason == "" and result.violation is None, result
    assert result.stdout.split() == ["ABC", "work", "None"]


def test_correct_solutions_of_the_code_task_score_one():
    for task in TASKS:
        row = next(r for r in make_code_examples(len(TASKS), seed=3) if f"def {task.signature}" in r["prompt"])
        score = reward(row["solution"], row["answer"])
        assert score == 1.0 and score.passed == score.total == 5, (task.name, score)


def test_wrong_and_broken_solutions_score_zero_or_a_fraction():
    assert reward("```python\ndef add(a, b):\n    return a - b\n```") == 0.0
    assert reward("def add(a, b):\n    return a * b") == pytest.approx(1 / 3)  # only 2 * 2 == 4 holds
    broken = reward("def add(a, b) return a + b")
    assert broken == 0.0 and "SyntaxError" in broken.reason
    assert reward("no code at all") == 0.0


def test_faking_equality_or_exiting_early_does_not_pass_call_tests():
    tests = json.dumps([{"call": "add(1, 2)", "expected": 3}])
    fake_eq = "class Any:\n    def __eq__(self, other):\n        return True\ndef add(a, b):\n    return Any()"
    assert reward(fake_eq, tests) == 0.0
    assert reward("import os\nos._exit(0)", tests) == 0.0
    assert reward("def add(a, b):\n    return True", json.dumps([{"call": "add(0, 1)", "expected": 1}])) == 0.0


@pytest.mark.timeout(900)  # the wall limit below is 300 s per run
@pytest.mark.parametrize("mode", MODES)
def test_an_infinite_loop_is_stopped_by_cpu_time_and_a_sleep_by_wall_time(mode):
    # a wall clock far enough that even a crowded machine gives the loop its CPU second first: the reasons
    # below say which limit ended each run, so no wall-clock bound of the test's own is needed
    cpu_bound = SandboxLimits(cpu_s=1, wall_s=300)
    busy = run_sandboxed("while True:\n    pass", limits=cpu_bound, mode=mode)
    assert busy.violation == "cpu_time" and busy.reason == "cpu time 1s exceeded", busy
    asleep = run_sandboxed("import time\ntime.sleep(60)", limits=SandboxLimits(wall_s=1), mode=mode)
    assert asleep.timed_out and asleep.violation == "wall_time" and asleep.reason == "wall time 1s exceeded"
    score = check_program("def add(a, b):\n    while True:\n        pass", parse_tests(ADD_TESTS), cpu_bound,
                          mode=mode)
    assert score == 0.0 and score.reason == "cpu time 1s exceeded"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bomb", [
    "import os\nwhile True:\n    os.fork()",
    "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "import subprocess, sys\nwhile True:\n    subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])"])
def test_a_fork_bomb_scores_zero_and_leaves_the_machine_usable(mode, bomb, fresh_uids):
    result = run_sandboxed(bomb, limits=FAST, mode=mode)
    assert result.violation in ("processes", "cpu_time", "wall_time"), result  # a limit ended it
    assert check_program("import os\nwhile True:\n    os.fork()\ndef add(a, b): return a + b",
                         parse_tests(ADD_TESTS), FAST, mode=mode) == 0.0
    assert subprocess.run(["true"], timeout=10).returncode == 0  # the trainer can still start processes
    if os.geteuid() == 0 and mode == "namespace":
        assert fresh_uids and all(uid >= sandbox_child.FRESH_UID_BASE for uid in fresh_uids)
        assert processes_of(fresh_uids) == []


@pytest.mark.parametrize("mode", MODES)
def test_a_huge_allocation_scores_zero_with_the_memory_reason(mode):
    result = run_sandboxed("x = bytearray(64 * 2**30)", mode=mode)
    assert result.violation == "memory" and result.reason == "memory limit 512 MB exceeded", result
    score = reward("def add(a, b):\n    return len([0] * 10**10)")
    assert score == 0.0 and score.reason == "memory limit 512 MB exceeded"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["open({p!r}, 'w').write('x')",
                                 "import os\nos.close(os.open({p!r}, os.O_CREAT | os.O_WRONLY))",
                                 "import pathlib\npathlib.Path({p!r}).write_text('x')",
                                 "import subprocess\nsubprocess.run(['touch', {p!r}])\nopen({p!r})"])
def test_a_write_outside_the_sandbox_is_refused_and_leaves_no_file(mode, how, tmp_path):
    target = tmp_path / "outside.txt"
    (tmp_path / "existing.txt").write_text("keep")
    os.chmod(tmp_path, 0o777)  # writable by anyone: only the sandbox itself may stop the write
    result = run_sandboxed(how.format(p=str(target)) + f"\nimport os\nos.remove({str(tmp_path / 'existing.txt')!r})",
                           mode=mode)
    assert not result.ok and result.violation in ("filesystem", "processes"), result
    assert not target.exists() and (tmp_path / "existing.txt").read_text() == "keep"
    score = reward(f"open({str(target)!r}, 'w').write('x')\ndef add(a, b):\n    return a + b")
    assert score == 0.0 and score.reason == "write outside the sandbox refused" and not target.exists()


@pytest.mark.parametrize("mode", MODES)
def test_network_access_is_refused_and_the_listener_sees_no_connection(mode):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        program = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2).sendall(b'hi')"
        result = run_sandboxed(program, mode=mode)
        assert result.violation == "network" and result.reason == "network disabled", result
        score = reward(f"import socket\ndef add(a, b):\n    {program.splitlines()[1]}\n    return a + b")
        assert score == 0.0 and score.reason == "network disabled"
        assert select.select([listener], [], [], 0.2)[0] == []  # nobody connected


@pytest.mark.parametrize("mode", MODES)
def test_an_output_flood_is_cut_at_the_cap_in_bounded_time(mode):
    result = run_sandboxed("import sys\nwhile True:\n    sys.stdout.write('x' * 4096)", mode=mode,
                           limits=SandboxLimits(output_bytes=10_000))
    assert result.violation == "output" and result.reason == "output limit 10000 bytes exceeded", result
    assert len(result.stdout) == 10_000  # cut at the cap (the output limit ended it, not the wall clock)
    assert reward("print('y' * 10**6)\ndef add(a, b):\n    return a + b").reason == "output limit 65536 bytes exceeded"


@pytest.mark.parametrize("mode", MODES)
def test_a_file_past_the_size_limit_is_refused(mode):
    result = run_sandboxed("open('big', 'wb').write(b'x' * (3 * 2**20))", limits=SandboxLimits(file_size_mb=2),
                           mode=mode)
    assert result.violation == "file_size" and result.reason == "file size limit 2 MB exceeded", result


def test_the_namespace_mode_hides_processes_and_keeps_no_capability():
    if sandbox.network_isolation() != "namespace":
        pytest.skip(f"no namespaces here ({sandbox.isolation_note()})")
    result = run_sandboxed("import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
                           "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('CapEff')])")
    assert result.stdout.split("\n")[:2] == ["[1, 2]", "['0000000000000000']"], result


@pytest.mark.timeout(200)  # without the budget: five runs of 60 s each
def test_a_time_budget_bounds_all_runs_of_a_row():
    tests = json.dumps([{"stdin": "", "stdout": "never"}] * 5)
    score = reward("import time\ntime.sleep(60)\nprint('late')", tests, budget_s=2.5, sandbox_limits={"wall_s": 120})
    # the first run got what was left of the budget as its wall clock (not the 120 s limit) and hit it
    limit = re.fullmatch(r"wall time ([0-9.]+)s exceeded", score.reason)
    assert score == 0.0 and limit is not None and float(limit.group(1)) <= 2.5, score.reason


def test_stdin_stdout_tests():
    tests = json.dumps([{"stdin": "1 2\n", "stdout": "3\n"}, {"stdin": "5 5", "stdout": "10"}])
    assert reward("a, b = map(int, input().split())\nprint(a + b)", tests) == 1.0
    assert reward("print(3)", tests) == 0.5


def test_extract_program():
    assert extract_program("Here:\n```python\nx = 1\n```\nthen\n```py\nx = 2\n```") == "x = 2\n"
    assert extract_program("```\nprint(1)\n```") == "print(1)\n"
    assert extract_program("```python\ndef f():\n    return 1") == "def f():\n    return 1"
    assert extract_program("def f(): pass") == "def f(): pass"


def test_parse_tests_rejects_what_it_cannot_run():
    assert parse_tests('[{"call": "f()", "expected": [1]}, "assert f()", {"stdout": "1"}]') == [
        {"kind": "eval", "code": "f()", "expected": [1]}, {"kind": "exec", "code": "assert f()"},
        {"kind": "io", "stdin": "", "stdout": "1"}]
    for bad in ("[]", '{"a": 1}', '[{"call": "f()"}]', "not json"):
        with pytest.raises(ValueError):
            parse_tests(bad)


def test_same_value_is_strict_about_bools_and_lenient_about_float_rounding():
    same_value = code_checks.same_value
    assert same_value(0.30000000000000004, 0.3) and same_value([1, {"a": 2.0}], [1, {"a": 2}])
    assert not same_value(1, True) and not same_value([1], [1, 2]) and not same_value("1", 1)


def test_code_tasks_are_deterministic_and_written_as_parquet(tmp_path):
    assert make_code_examples(12, seed=1) == make_code_examples(12, seed=1) != make_code_examples(12, seed=2)
    rows = make_code_examples(len(TASKS), seed=0, tests_per_row=3)
    assert [r["data_source"] for r in rows] == [DATA_SOURCE] * len(TASKS) and len(json.loads(rows[0]["answer"])) == 3
    assert rows[0]["prompt"].endswith('def add(a, b):\n    """Return the sum of the integers a and b."""\n')
    train, val = write_code_tasks(tmp_path, n_train=18, n_val=9)
    table = pq.read_table(train)
    assert table.column_names == ["prompt", "answer", "data_source", "solution"] and table.num_rows == 18
    assert pq.read_table(val).num_rows == 9


def test_the_code_reward_through_the_manager_and_its_process_pool():
    tok = build_char_tokenizer(string.printable)
    row = make_code_examples(1, seed=5)[0]
    responses = [row["solution"], "```python\ndef add(a, b):\n    return 0\n```",
                 "```python\ndef add(a, b):\n    while True:\n        pass\n```",
                 "import os\nwhile True:\n    os.fork()"]
    ids = [tok(text)["input_ids"] for text in responses]
    width = max(map(len, ids))
    batch = DataProto.from_dict(
        {"responses": torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in ids]),
         "response_mask": torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in ids])},
        {"ground_truth": np.array([row["answer"]] * len(responses), dtype=object),
         "data_source": np.array([DATA_SOURCE] * len(responses), dtype=object)})
    manager = RuleRewardManager(tok, num_workers=2, timeout_s=20,
                                reward_kwargs={"sandbox_limits": {"cpu_s": 1, "wall_s": 3}})
    out = manager(batch)
    assert out.batch["reward_scores"].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert out.non_tensor_batch["response_text"][0] == row["solution"]
    assert out.meta_info["reward/code/mean"] == 0.25
