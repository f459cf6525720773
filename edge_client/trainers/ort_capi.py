"""ONNX Runtime's binding layer, imported without the torch and onnx that `import onnxruntime` would drag in."""
from __future__ import annotations

import sys
from types import ModuleType
from typing import Any


def _import_bindings() -> ModuleType:
    """`import onnxruntime` runs a build check that imports `onnxruntime.training.ortmodule`, which pulls in torch
    and onnx (about 5 s) wherever they are installed. The device needs neither: the check is shown an ImportError
    (which it treats as "no ORTModule"), and the package is importable again afterwards for host code (export)."""
    if "onnxruntime" in sys.modules or "onnxruntime.training" in sys.modules:
        from onnxruntime.capi import _pybind_state

        return _pybind_state
    sys.modules["onnxruntime.training"] = None  # type: ignore[assignment]  # makes its import raise ImportError
    try:
        from onnxruntime.capi import _pybind_state
    finally:
        del sys.modules["onnxruntime.training"]
    return _pybind_state


C: Any = _import_bindings()  # a binary module: its names are not known to a type checker
