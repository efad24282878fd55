"""vLLM's start-up messages that are known to be harmless here, filtered out of the console.

A vLLM engine start on CPU prints ~20 warnings plus one "Attempted to load weight ... float32 into
... bfloat16" line per parameter tensor (122 for SmolLM2-135M), each time an engine loads, and some
again every step. None asks the user to do anything: they describe choices rlcore makes on purpose
(chunked prefill off, eager mode, a bf16 engine fed fp32 weights that vLLM casts on load) or the CPU
build's missing optional parts (Triton, tcmalloc). docs/troubleshooting.md lists each with why it is
harmless; everything else vLLM says still shows.

How: ``quiet_vllm_logs()`` runs before vLLM is imported in a process. It points vLLM's own logging
setup (``VLLM_LOGGING_CONFIG_PATH``, unless the user set one) at a config with ``KnownNoise`` on its
handler, applied here at once too, so the filter is there from vLLM's first message (a few come while
it imports, before it configures its logging), and in the engine core subprocess that
``AsyncLLM`` starts (it inherits the environment and configures its logging the same way). Python
warnings from vLLM's modules get the same treatment through ``warnings`` filters here and
``PYTHONWARNINGS`` for child processes. A vLLM imported earlier in this process gets the filter on
its handlers directly.
"""

from __future__ import annotations

import builtins
import json
import logging
import logging.config
import os
import re
import sys
import tempfile
import warnings
from pathlib import Path

# (pattern of the message, why it is harmless); docs/troubleshooting.md says the same per line.
KNOWN_NOISE = (
    (r"Attempted to load weight .* with dtype torch\.float32 into parameter with dtype torch\.bfloat16",
     "the bf16 engine loads the fp32 checkpoint and casts each tensor (rollout.dtype picks the engine's dtype)"),
    (r"does not officially support disabling chunked prefill",
     "rlcore turns chunked prefill off on CPU on purpose: a seeded request prefilled in chunks crashes there"),
    (r"Triton is installed, but doesn't include CPU backend", "the CPU build runs without Triton"),
    (r"Triton is not installed\. triton-cpu is expected", "the CPU build runs without Triton"),
    (r"Triton is installed but 0 active driver\(s\) found", "the CPU build runs without Triton"),
    (r"Triton not installed or not compatible", "the CPU build runs without Triton"),
    (r"Model Runner V2 requires Triton", "the V1 model runner is the one the CPU build uses"),
    (r"Enforce eager set, disabling torch\.compile", "rollout.enforce_eager (the default) chose eager mode"),
    (r"Inductor compilation was disabled by user settings", "eager mode: nothing to compile"),
    (r"Reset SSM cache type to float32", "only concerns state-space (Mamba) models"),
    (r"The global random seed is set to", "rlcore seeds every request itself (rlcore.engines.seeding)"),
    (r"is not found in LD_PRELOAD", "a speed tip (tcmalloc / Intel OpenMP): docs/troubleshooting.md"),
    (r"is set; leaving Torch threads at", "the thread count rlcore set (trainer.cpus_per_proc) is kept"),
    (r"doesn't allow to use `torch\.set_num_threads` after the thread binding",
     "threads are bound once at engine start; later calls are no-ops"),
)
_PATTERN = re.compile("|".join(f"(?:{p})" for p, _ in KNOWN_NOISE))
# Python warnings raised inside vLLM's modules at import: (message prefix, category)
KNOWN_WARNINGS = (("`torch.distributed.reduce_op` is deprecated", "FutureWarning"),)
FORMAT = "(vllm pid=%(process)d) %(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
CONFIG_ENV = "VLLM_LOGGING_CONFIG_PATH"


def is_known_noise(message: str) -> bool:
    return _PATTERN.search(message) is not None


class KnownNoise(logging.Filter):
    """Drops the records of ``KNOWN_NOISE``."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not is_known_noise(record.getMessage())


def logging_config(level: str) -> dict:
    """vLLM's logging set-up (one stream handler on the ``vllm`` logger) with ``KnownNoise`` on it."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"rlcore_known_noise": {"()": f"{__name__}.KnownNoise"}},
        "formatters": {"vllm": {"format": FORMAT, "datefmt": "%m-%d %H:%M:%S"}},
        "handlers": {"vllm": {"class": "logging.StreamHandler", "formatter": "vllm", "level": level,
                              "stream": os.environ.get("VLLM_LOGGING_STREAM", "ext://sys.stdout"),
                              "filters": ["rlcore_known_noise"]}},
        "loggers": {"vllm": {"handlers": ["vllm"], "level": level, "propagate": False}},
    }


def quiet_vllm_logs() -> None:
    """Filter ``KNOWN_NOISE`` out of vLLM's logging in this process and the processes it starts
    (module docstring). Call before importing vLLM; harmless to call again."""
    for message, category in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message), category=getattr(builtins, category))
    child = ",".join(f"ignore:{message}:{category}" for message, category in KNOWN_WARNINGS)
    if child not in os.environ.get("PYTHONWARNINGS", ""):
        os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), child]))
    if CONFIG_ENV not in os.environ:
        level = os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper()
        path = Path(tempfile.gettempdir()) / f"rlcore_vllm_logging_{level}_{os.getuid()}.json"
        text = json.dumps(logging_config(level))
        if not path.is_file() or path.read_text() != text:
            partial = path.with_suffix(f".{os.getpid()}.tmp")
            partial.write_text(text)
            os.replace(partial, path)  # whole or absent, whoever reads it
        os.environ[CONFIG_ENV] = str(path)
    if "vllm.logger" in sys.modules:  # configured already: filter its handlers where they are
        for handler in logging.getLogger("vllm").handlers:
            if not any(isinstance(f, KnownNoise) for f in handler.filters):
                handler.addFilter(KnownNoise())
    elif os.environ[CONFIG_ENV].startswith(str(Path(tempfile.gettempdir()) / "rlcore_vllm_logging_")):
        # vLLM logs a few lines (Triton's) while importing, before it applies that config: apply it now
        logging.config.dictConfig(json.loads(Path(os.environ[CONFIG_ENV]).read_text()))
