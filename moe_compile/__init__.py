"""moe_compile: compile a single-device Mixture-of-Experts model into an expert-parallel program."""

from .api import moe_compile
from .compiled import CompiledMoE
from .frontend.recognize import read_block, register_recognizer, unregister_recognizer
from .mesh import MeshSpec

__all__ = ["CompiledMoE", "MeshSpec", "moe_compile", "read_block", "register_recognizer", "unregister_recognizer"]
__version__ = "0.1.0"
