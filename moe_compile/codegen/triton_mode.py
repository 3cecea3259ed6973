"""Which kernels run the partitioned graph, and how Triton runs in this process.

    resolve_codegen(requested, device_type):
        "torch"  → torch kernels
        "auto"   → Triton on GPU (when triton >= 3.6 imports), torch ops on CPU
        "triton" → Triton; on CPU tensors under the Triton interpreter (tests, development)

The interpreter is a process-wide decision that must be taken before any ``@triton.jit`` function is
created: ``triton.jit`` returns an interpreted function only if ``TRITON_INTERPRET`` is set when the
decorator runs. So kernel modules (``moe_compile.codegen.kernels.*``) are never imported at package
import; :func:`kernel_module` imports them after :func:`use_triton` has fixed the mode, and sets
``TRITON_INTERPRET=1`` itself when the tensors live on the CPU (an explicit decision here, not an
environment variable read at import). Asking for native kernels after the interpreter was chosen in
this process (or the reverse) is an error, never a silent switch.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

from ..errors import OptionError

KERNEL_PACKAGE = "moe_compile.codegen.kernels"
FAMILIES = ("route_map", "permute", "unpermute", "grouped_gemm", "swiglu", "mxfp8")
MIN_TRITON = (3, 6)

_mode: str | None = None  # "interpret" | "native", once chosen in this process
_user_interpret = False  # TRITON_INTERPRET was set by the user: interpret every device's tensors


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_version() -> tuple[int, ...]:
    import triton

    return tuple(int(p) for p in triton.__version__.split("+")[0].split(".")[:2] if p.isdigit())


def resolve_codegen(requested: str, device_type: str) -> str:
    """"torch" or "triton" for the option value ``requested`` and tensors on ``device_type``."""
    if requested == "torch":
        return "torch"
    if requested == "auto":
        if device_type != "cuda" or not triton_available() or triton_version() < MIN_TRITON:
            return "torch"
        use_triton(device_type)
        return "triton"
    if requested != "triton":
        raise OptionError(f"codegen={requested!r}: supported values are 'auto', 'triton', 'torch'")
    if not triton_available():
        raise OptionError("codegen='triton' needs the triton package (pip install 'triton>=3.6')")
    use_triton(device_type)
    return "triton"


def use_triton(device_type: str) -> str:
    """Fix this process's Triton mode for tensors on ``device_type``: the interpreter for CPU tensors,
    native kernels for CUDA tensors. Returns the mode."""
    global _mode, _user_interpret
    want = "native" if device_type == "cuda" else "interpret"
    if device_type not in ("cpu", "cuda"):
        raise OptionError(f"codegen='triton' runs on cuda (kernels) or cpu (interpreter) tensors, not {device_type!r}")
    if _mode is None:
        if triton_version() < MIN_TRITON:
            raise OptionError(f"codegen='triton' needs triton >= {'.'.join(map(str, MIN_TRITON))}; "
                              f"this process has {'.'.join(map(str, triton_version()))}")
        env_interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        if want == "interpret" and not env_interpret:
            os.environ["TRITON_INTERPRET"] = "1"  # read by triton.jit when the kernel modules load
        _mode = "interpret" if (want == "interpret" or env_interpret) else "native"
        _user_interpret = env_interpret
    if want == "interpret" and _mode != "interpret":
        raise OptionError(
            "codegen='triton' on CPU tensors needs the Triton interpreter, but this process already built "
            "native Triton kernels; compile CPU and GPU programs in separate processes")
    if want == "native" and _mode == "interpret" and not _user_interpret:
        raise OptionError(
            "codegen='triton' on CUDA tensors needs native Triton kernels, but this process already chose the "
            "interpreter for CPU tensors; compile CPU and GPU programs in separate processes (or set "
            "TRITON_INTERPRET=1 to interpret both)")
    return _mode


def default_device_type() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def ensure_mode() -> str:
    """The mode, choosing it for this machine's default device if nothing chose it yet (importing a
    kernel module directly, e.g. from a benchmark or a test, goes through here)."""
    return _mode or use_triton(default_device_type())


def interpreting() -> bool:
    """Kernels run under the Triton interpreter (fixed configs, bf16 dot upcast)."""
    if _mode is None:
        raise OptionError("Triton kernels used before the codegen mode was chosen (call use_triton first)")
    return _mode == "interpret"


def kernel_module(family: str) -> ModuleType:
    """The kernel file ``family`` (imported only once the Triton mode is fixed)."""
    if family not in FAMILIES:
        raise KeyError(f"unknown kernel family {family!r}; known: {FAMILIES}")
    interpreting()  # raises if the mode is not chosen yet
    return importlib.import_module(f"{KERNEL_PACKAGE}.{family}")
