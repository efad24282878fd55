"""What keeps the GPU device check honest about its imports (standard library only).

The device machine has torch and transformers but no Ray, no vLLM and no registry; what else the
check needs travels in a vendor folder (``scripts/vendor_for_device.sh``). Here, where all of that
is installed, the CPU dry run must fail the same way the device would, so every process of the
check calls ``install()`` first:

- ``import ray`` / ``import vllm`` raise ``ModuleNotFoundError`` (an optional import that catches
  it, such as ``rlcore.engines.server``'s, is allowed and recorded in ``attempts``);
- with ``RLCORE_DEVICE_VENDOR`` set, the vendored packages load from that folder only, so a package
  missing from it fails here rather than after the device's start-up minutes.

``audit()`` then reports what the loaded project modules import at module level that is neither
the standard library, the project, the vendor folder, nor in the device image's package list: a
new top-level dependency shows up in the dry run instead of on the device.
"""

from __future__ import annotations

import ast
import importlib
import importlib.abc
import importlib.machinery
import os
import sys
from pathlib import Path

BLOCKED = ("ray", "vllm")
# Top-level modules of the vendored distributions (hydra-core, omegaconf, antlr4-python3-runtime,
# tensordict, pyvers): what scripts/vendor_for_device.sh installs.
VENDORED = ("hydra", "omegaconf", "antlr4", "tensordict", "pyvers")
REPO = Path(__file__).resolve().parent.parent
PROJECT = ("rlcore", "recipes", "scripts", "tests")
# The device image's Python packages (/work/.library/device/KINDS.md, read there 2026-11-17), as
# distribution names with "-" as "_", plus the import names that differ from them.
IMAGE_DISTRIBUTIONS = frozenset("""
    absl_py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated_doc anyio attrs
    botorch build certifi charset_normalizer chex click cloudpickle cmake colorama contourpy
    coverage cuda_bindings cuda_core cuda_pathfinder cuda_toolkit cupy_cuda13x cycler cython
    diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic
    frozenlist fsspec gpytorch grpcio h11 h5py hf_xet httpcore httpx huggingface_hub humanize
    hypothesis idna imageio iniconfig interface_meta jax jax_cuda13_pjrt jax_cuda13_plugin jaxlib
    jaxtyping jinja2 joblib kiwisolver lazy_loader lightning lightning_utilities linear_operator
    lineax llvmlite lxml markdown markdown_it_py markupsafe matplotlib mdurl meson ml_dtypes mpi4py
    mpmath msgpack multidict multipledispatch mypy_extensions nanobind narwhals networkx ninja
    numba numba_cuda numpy numpyro nvidia_cublas nvidia_cuda_cupti nvidia_cuda_nvrtc
    nvidia_cuda_runtime nvidia_cudnn_cu13 nvidia_cufft nvidia_cufile nvidia_curand nvidia_cusolver
    nvidia_cusparse nvidia_cusparselt_cu13 nvidia_ml_py nvidia_nccl_cu13 nvidia_nvjitlink
    nvidia_nvshmem_cu13 nvidia_nvtx onnx onnx_ir onnxruntime onnxscript opencv_python_headless
    opt_einsum opt_einsum_fx optax optimistix orbax_checkpoint packaging pandas pathspec patsy peft
    pillow pip pluggy portalocker prometheus_client propcache protobuf psutil py_cpuinfo pyarrow
    pybind11 pygments pyparsing pyproject_hooks pyre_extensions pytest pytest_benchmark pytest_cov
    pytest_mock pytest_timeout pytest_xdist python_dateutil pytorch_lightning pyyaml regex requests
    rich sacrebleu safetensors scikit_build_core scikit_image scikit_learn scipy seaborn
    sentence_transformers sentencepiece setuptools shellingham simplejson six sortedcontainers
    statsmodels sympy tabulate tensorboard tensorboard_data_server tensorstore threadpoolctl
    tifffile tiktoken timm tokenizers toolz torch torch_geometric torchaudio torchdiffeq
    torchmetrics torchvision tqdm transformers treescope triton typer typing_extensions
    typing_inspect urllib3 uvloop wadler_lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split())
IMAGE_IMPORT_ALIASES = frozenset("attr PIL yaml sklearn skimage cv2 google dateutil _pytest xdist cpuinfo absl".split())
IMAGE = IMAGE_DISTRIBUTIONS | IMAGE_IMPORT_ALIASES

attempts: list[str] = []  # "ray (from rlcore/engines/server.py)" for each blocked import tried


def _importer() -> str:
    """The file that ran the import: the first frame outside importlib and this module."""
    frame = sys._getframe(2)
    skip = (__file__, importlib.__file__)
    while frame and (frame.f_code.co_filename.startswith("<frozen") or frame.f_code.co_filename in skip):
        frame = frame.f_back
    if frame is None:
        return "?"
    name = Path(frame.f_code.co_filename)
    return str(name.relative_to(REPO)) if name.is_relative_to(REPO) else str(name)


class DeviceImportGuard(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path``: refuses the blocked packages; pins the vendored ones to ``vendor``."""

    def __init__(self, vendor: str | None) -> None:
        self.vendor = vendor

    def find_spec(self, fullname, path=None, target=None):
        top = fullname.partition(".")[0]
        if top in BLOCKED:
            attempts.append(f"{fullname} (from {_importer()})")
            raise ModuleNotFoundError(f"No module named {fullname!r} (the device check runs without {top}: "
                                      "scripts/device_guard.py)", name=fullname)
        if self.vendor and fullname in VENDORED:  # submodules follow their package's __path__
            spec = importlib.machinery.PathFinder.find_spec(fullname, [self.vendor])
            if spec is None:
                raise ModuleNotFoundError(f"{fullname!r} is not in the vendor folder {self.vendor}: rebuild it "
                                          "with scripts/vendor_for_device.sh", name=fullname)
            return spec
        return None


def install() -> None:
    """Put the guard first on ``sys.meta_path`` (once); fails if a blocked package is already loaded."""
    if any(isinstance(f, DeviceImportGuard) for f in sys.meta_path):
        return
    loaded = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED + VENDORED)
    if loaded:
        raise RuntimeError(f"install the device guard before importing {loaded}")
    sys.meta_path.insert(0, DeviceImportGuard(os.environ.get("RLCORE_DEVICE_VENDOR") or None))


def _module_level_imports(path: Path) -> set[str]:
    """Top-level names imported by ``path``'s module-level statements (not inside a function, a
    class or a ``try``: those are lazy or optional imports)."""
    names = set()
    for node in ast.parse(path.read_text(), filename=str(path)).body:
        if isinstance(node, ast.If):  # `if TYPE_CHECKING:` and the like: still module level
            nodes = node.body + node.orelse
        else:
            nodes = [node]
        for n in nodes:
            if isinstance(n, ast.Import):
                names |= {a.name.partition(".")[0] for a in n.names}
            elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
                names.add(n.module.partition(".")[0])
    return names


def audit() -> dict:
    """Where this process's imports stand: blocked attempts, the blocked or vendored modules loaded
    (and from where), and the module-level third-party imports of loaded project modules that the
    device image does not have (``not_on_image``: should stay empty)."""
    project_files = {Path(m.__file__) for m in list(sys.modules.values())
                     if getattr(m, "__file__", None) and m.__name__.partition(".")[0] in PROJECT}
    third_party = set()
    for path in project_files:
        if path.suffix == ".py" and path.exists():
            third_party |= _module_level_imports(path)
    third_party -= set(sys.stdlib_module_names) | set(PROJECT) | {"__future__"}
    vendored_from = {name: str(Path(sys.modules[name].__file__).parent.parent)
                     for name in VENDORED if name in sys.modules and getattr(sys.modules[name], "__file__", None)}
    return {
        "blocked_attempts": sorted(set(attempts)),
        "blocked_loaded": sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED),
        "vendored_from": vendored_from,
        "not_on_image": sorted(third_party - IMAGE - set(VENDORED)),
    }
