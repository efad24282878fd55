"""The trajectory inspector: ``python -m rlcore.inspect <run folder>`` makes one self-contained web
page of a run (curves from metrics.jsonl, the sampled trajectories token by token from
trajectories/), written as a file or served on loopback behind a token. See docs/inspector.md.

Why its own layer, above the trainer: it only reads what a run wrote (the file format is the
trainer's, ``rlcore.trainer.trajectories``); nothing in training imports it.
"""

from rlcore.inspect.page import render_page, write_page
from rlcore.inspect.run_data import RunFolderError, load_run

__all__ = ["RunFolderError", "load_run", "render_page", "write_page"]
