"""Check a program against test cases in the sandbox: the scoring behind the ``code`` reward
(``rlcore.rewards.registry``).

Why the comparison happens here and not in the sandbox: a call test's result travels back as JSON and
is compared by ``same_value`` in the trainer, so the expected values never enter the sandbox and code
that fakes ``==`` or exits early gains nothing. A run that hits a limit or the isolation scores 0 for
the whole row, and the score's ``reason`` says which.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import secrets
import time
from typing import Any

from rlcore.rewards.sandbox import SandboxLimits, SandboxResult, describe, run_sandboxed, violation_in


class CodeScore(float):
    """A code reward's score: a float, as reward functions return, that also says why (``reason``)."""

    def __new__(cls, score: float, passed: int, total: int, reason: str) -> "CodeScore":
        self = super().__new__(cls, score)
        self.passed, self.total, self.reason = passed, total, reason
        return self

    def __reduce__(self):
        return CodeScore, (float(self), self.passed, self.total, self.reason)

    def __repr__(self) -> str:
        return f"CodeScore({float(self)!r}, passed={self.passed}, total={self.total}, reason={self.reason!r})"


_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)```", re.S)


def extract_program(response: str) -> str:
    """The last ```python (or ```py) block of a response, else its last fenced block of any kind, else the
    text after an unclosed ```python fence (a response cut at the token limit), else the whole response."""
    blocks = _FENCE.findall(response)
    python = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    if python or blocks:
        return (python or [body for _, body in blocks])[-1]
    opened = re.search(r"```[ \t]*(?:python|py|python3)[ \t]*\n", response, re.I)
    if opened:
        return response[opened.end():]
    return response


def parse_tests(ground_truth: Any) -> list[dict[str, Any]]:
    """The test cases of a code row: a JSON string (or an already decoded list) whose items are each
    {"call": "f(1, 2)", "expected": 3}, {"stdin": "1 2\\n", "stdout": "3\\n"} or a statement string such
    as "assert f(1, 2) == 3"."""
    tests = json.loads(ground_truth) if isinstance(ground_truth, (str, bytes)) else ground_truth
    if hasattr(tests, "tolist"):
        tests = tests.tolist()
    if isinstance(tests, dict) and "tests" in tests:
        tests = tests["tests"]
    if not isinstance(tests, list) or not tests:
        raise ValueError(f"code tests must be a non-empty JSON list, got {str(ground_truth)[:200]!r}")
    parsed = []
    for i, test in enumerate(tests):
        if isinstance(test, str):
            parsed.append({"kind": "exec", "code": test})
        elif isinstance(test, dict) and "call" in test and "expected" in test:
            parsed.append({"kind": "eval", "code": test["call"], "expected": test["expected"]})
        elif isinstance(test, dict) and "stdout" in test:
            parsed.append({"kind": "io", "stdin": test.get("stdin", ""), "stdout": test["stdout"]})
        else:
            raise ValueError(f"code test {i} is neither a statement, {{call, expected}} nor {{stdin, stdout}}: "
                             f"{test!r}")
    return parsed


_HARNESS = """\
import json as _json
_g = {{"__name__": "solution"}}
try:
    exec(compile({source!r}, "solution.py", "exec"), _g)
except BaseException as _e:
    print({nonce!r}, _json.dumps(["load", (type(_e).__name__ + ": " + str(_e))[:500]]), flush=True)
    raise SystemExit(1)
for _i, (_kind, _code) in enumerate({tests!r}):
    try:
        if _kind == "eval":
            _value = eval(_code, _g)
            try:
                _line = _json.dumps([_i, "ok", _value])
            except (TypeError, ValueError):
                _line = _json.dumps([_i, "error", "the result is not JSON data: " + repr(_value)[:200]])
        else:
            exec(_code, _g)
            _line = _json.dumps([_i, "ok", None])
    except BaseException as _e:
        _line = _json.dumps([_i, "error", (type(_e).__name__ + ": " + str(_e))[:500]])
    print({nonce!r}, _line, flush=True)
"""


def check_program(program: str, tests: list[dict[str, Any]], limits: SandboxLimits | None = None, *,
                  budget_s: float | None = None, mode: str | None = None) -> CodeScore:
    """Score = the fraction of `tests` (from parse_tests) the program passes; 0.0 if any run hit a limit
    or the isolation (wall/CPU time, memory, processes, output, file size, network, writes outside).

    Call and statement tests run in one sandboxed run after the program (as module "solution"); each
    {stdin, stdout} test runs the program once. A call's result travels back as JSON and is compared
    here, so the expected values never enter the sandbox: code that fakes ``==`` or exits early gains
    nothing. Statement tests (asserts) run inside, so they are only as strong as Python lets them be.
    `budget_s` caps the total wall time of all runs (tests left when it is spent fail).
    """
    limits = limits or SandboxLimits()
    start = time.monotonic()
    outcomes: dict[int, tuple[bool, str]] = {}

    def run(code: str, stdin: str = "") -> SandboxResult | None:
        left = math.inf if budget_s is None else budget_s - (time.monotonic() - start)
        if left < 0.5:
            return None
        return run_sandboxed(code, stdin, dataclasses.replace(limits, wall_s=min(limits.wall_s, left)), mode=mode)

    inline = [i for i, t in enumerate(tests) if t["kind"] in ("eval", "exec")]
    if inline:
        nonce = secrets.token_hex(8)
        harness = _HARNESS.format(source=program, nonce=nonce,
                                  tests=[(tests[i]["kind"], tests[i]["code"]) for i in inline])
        result = run(harness)
        if result is not None and result.violation:
            return CodeScore(0.0, 0, len(tests), result.reason)
        outcomes.update(_inline_outcomes(result, nonce, [tests[i] for i in inline], inline))
    for i, test in enumerate(tests):
        if test["kind"] != "io":
            continue
        result = run(program, test["stdin"])
        if result is not None and result.violation:
            return CodeScore(0.0, 0, len(tests), result.reason)
        if result is None:
            outcomes[i] = (False, f"time budget {budget_s:g}s spent")
        elif not result.ok:
            outcomes[i] = (False, result.reason + _last_line(result.stderr))
        else:
            same = _normalized(result.stdout) == _normalized(test["stdout"])
            outcomes[i] = (same, "" if same else f"printed {result.stdout[:100]!r}")
    for ok, why in outcomes.values():
        violation = None if ok else violation_in(why)
        if violation:
            return CodeScore(0.0, 0, len(tests), describe(violation, limits))
    passed = sum(ok for ok, _ in outcomes.values())
    failures = [f"test {i}: {why}" for i, (ok, why) in sorted(outcomes.items()) if not ok]
    reason = f"{passed}/{len(tests)} tests passed" + (f"; first failure: {failures[0]}" if failures else "")
    return CodeScore(passed / len(tests), passed, len(tests), reason)


def _inline_outcomes(result: SandboxResult | None, nonce: str, tests: list[dict],
                     indices: list[int]) -> dict[int, tuple[bool, str]]:
    """{test index: (passed, why not)} from the nonce-tagged lines the harness printed."""
    if result is None:
        return {i: (False, "time budget spent") for i in indices}
    reported: dict[Any, list] = {}
    for line in result.stdout.splitlines():
        if line.startswith(nonce + " "):
            try:
                item = json.loads(line[len(nonce) + 1:])
            except ValueError:
                continue
            if isinstance(item, list) and item:
                reported[item[0]] = item  # the last report of a test counts
    if "load" in reported:
        why = f"the program raised {reported['load'][1]}"
        return {i: (False, why) for i in indices}
    outcomes = {}
    for n, (i, test) in enumerate(zip(indices, tests, strict=True)):
        item = reported.get(n)
        if item is None or len(item) != 3:
            outcomes[i] = (False, "no result (" + (result.reason or "the program ended early") + ")")
        elif item[1] != "ok":
            outcomes[i] = (False, str(item[2]))
        elif test["kind"] == "eval" and not same_value(item[2], test["expected"]):
            outcomes[i] = (False, f"{test['code']} returned {json.dumps(item[2])[:100]}")
        else:
            outcomes[i] = (True, "")
    return outcomes


def same_value(got: Any, expected: Any) -> bool:
    """JSON values equal: numbers by value (floats to 1e-9 relative), bools only to bools, lists, dicts."""
    if isinstance(expected, bool) or isinstance(got, bool):
        return type(got) is type(expected) and got == expected
    if isinstance(expected, (int, float)) and isinstance(got, (int, float)):
        if isinstance(expected, int) and isinstance(got, int):
            return got == expected
        return math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-12)
    if isinstance(expected, list) and isinstance(got, list):
        return len(got) == len(expected) and all(map(same_value, got, expected))
    if isinstance(expected, dict) and isinstance(got, dict):
        return got.keys() == expected.keys() and all(same_value(got[k], expected[k]) for k in expected)
    return type(got) is type(expected) and got == expected


def _normalized(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _last_line(text: str) -> str:
    lines = text.strip().splitlines()
    return f": {lines[-1][:200]}" if lines else ""
