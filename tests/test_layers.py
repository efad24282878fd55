"""The layers of the package (pyproject.toml [tool.importlinter]): each folder imports only the layers
below it, no recipe imports another, and no import of the project hides inside a function, where
import-linter would still see it but a reader of the module's header would not; and no module of rlcore
reaches 500 lines."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PROJECT = ("rlcore", "recipes")


def test_import_linter_contracts_are_kept():
    lint_imports = Path(sys.executable).parent / "lint-imports"
    if not lint_imports.exists():
        pytest.fail(f"{lint_imports} is missing: install the test extra (pip install -e '.[test]')")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([str(lint_imports), "--no-cache", "--no-logo"], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    broken = re.search(r"Contracts: (\d+) kept, (\d+) broken", output)
    assert broken is not None, output
    assert int(broken.group(1)) >= 2 and int(broken.group(2)) == 0, output


def function_level_project_imports(path: Path) -> list[str]:
    """'path:line: statement' for each import of an rlcore/recipes module inside a function body
    (relative imports count: they are always of the project)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for func in ast.walk(tree):
        if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(func):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = ["." * node.level + (node.module or "")]
            else:
                continue
            if any(m.startswith(".") or m.split(".")[0] in PROJECT for m in modules):
                found.append((node.lineno, f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)}"))
    return [hit for _, hit in sorted(set(found))]  # a nested function's imports are walked twice


def test_function_level_import_finder_sees_project_imports_only(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    sample = tmp_path / "sample.py"
    sample.write_text("import os\nfrom rlcore import protocol\n\n"
                      "def f():\n    import ray\n    from vllm import LLM\n    import rlcore.algos\n"
                      "    class C:\n        def g(self):\n            from recipes import grpo\n"
                      "    from . import sibling\n")
    assert function_level_project_imports(sample) == [
        "sample.py:7: import rlcore.algos", "sample.py:10: from recipes import grpo", "sample.py:11: from . import sibling"]


def test_no_function_level_imports_of_the_project():
    files = sorted(p for package in PROJECT for p in (REPO / package).rglob("*.py"))
    assert len(files) > 20  # the packages were found
    found = [hit for path in files for hit in function_level_project_imports(path)]
    assert found == [], "import these at the top of the module (a layer may import only the ones below it):\n" + \
        "\n".join(found)


MAX_MODULE_LINES = 500  # the house rule: a module longer than this is doing more than one job


def test_every_module_of_the_package_stays_under_500_lines():
    files = sorted((REPO / "rlcore").rglob("*.py"))
    assert len(files) > 20  # the package was found
    long = {str(p.relative_to(REPO)): n for p in files if (n := len(p.read_text().splitlines())) >= MAX_MODULE_LINES}
    assert long == {}, f"split these modules (one job each, under {MAX_MODULE_LINES} lines): {long}"
