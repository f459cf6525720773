"""ONNX Runtime, imported without the torch and onnx that `import onnxruntime` drags in on a training build."""
from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any


def _import_onnxruntime() -> ModuleType:
    """On onnxruntime-training, `import onnxruntime` runs a build check that imports
    `onnxruntime.training.ortmodule`, which pulls in torch and onnx (about 5 s) wherever they are installed. The
    device needs neither: the check is shown an ImportError (which it treats as "no ORTModule"), and the package
    is importable again afterwards for host code (export). Plain onnxruntime has no such check."""
    if "onnxruntime" in sys.modules or "onnxruntime.training" in sys.modules:
        return importlib.import_module("onnxruntime")
    sys.modules["onnxruntime.training"] = None  # type: ignore[assignment]  # makes its import raise ImportError
    try:
        return importlib.import_module("onnxruntime")
    finally:
        del sys.modules["onnxruntime.training"]


ORT: Any = _import_onnxruntime()  # the onnxruntime package: InferenceSession, OrtValue, IOBinding
C: Any = ORT.capi._pybind_state  # its binding layer (a binary module), where the training API lives
