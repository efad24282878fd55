"""The documentation's examples run: every ```python block of README.md and docs/*.md, the blocks
of one page in order in one namespace (a page reads as one session), in a process of its own: a child of
the preloaded interpreter (tests/preloaded_python.py), so each page does not pay torch's and rlcore's
imports again (~3-5 s of CPU), with an environment of only PYTHONPATH, PATH, HOME and one setting.

A block whose first line is ``# fragment`` is an excerpt that cannot run on its own (it is shown
inside a larger context) and is skipped; each page still has to run at least one block.
"""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def runnable_blocks(page: Path) -> list[str]:
    return [b for b in BLOCK.findall(page.read_text()) if not b.startswith("# fragment")]


@pytest.mark.slow
@pytest.mark.parametrize("page", [p for p in PAGES if BLOCK.search(p.read_text())], ids=lambda p: p.name)
def test_page_examples_run(page, tmp_path, preloaded_python):
    blocks = runnable_blocks(page)
    assert blocks, f"{page.name}: every python block is a fragment; at least one must run"
    script = "\n\n".join(blocks)
    proc = preloaded_python.run(None, code=script, cwd=tmp_path, timeout=600,
                                env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
                                     "TOKENIZERS_PARALLELISM": "false"})
    assert proc.returncode == 0, f"{page.name}'s examples failed:\n{proc.stderr[-3000:]}"


def test_ci_runs_exactly_the_readmes_test_command():
    """CI (``.ci/run``) runs the README's second command, so what a reader runs is what CI checked."""
    readme = (REPO / "README.md").read_text()
    first_block = re.search(r"^```bash\n(.*?)^```", readme, re.S | re.M).group(1)
    commands = [line for line in first_block.splitlines() if line and not line.startswith("#")]
    assert len(commands) == 2 and "pytest" in commands[1], commands
    ci = [line for line in (REPO / ".ci" / "run").read_text().splitlines() if line and not line.startswith(("#", "set ", "cd "))]
    assert ci == [commands[1]], (ci, commands[1])
