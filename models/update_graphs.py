"""The portable backend's optimiser updates, written as ONNX nodes rather than traced through torch's exporter.

Each update (models/portable_export.py's docstring says what each computes) is a few elementwise operations on
flat float32 vectors of the model's length and on scalars: the same graph for every model but for that length.
Through torch's exporter (the trace, the translation, the optimiser passes) each took 0.06-0.3 s here once the
exporter was warm and 1.6 s as a process's first graph: four of the seven graphs of a fleet's cold export, CPU spent
on what no model changes; written here they take milliseconds. The expressions below are the torch ones they
replace, operator for operator and in Python's order of evaluation (`a * b * c` is `(a * b) * c`), with Python's
float constants as float32 scalars as torch takes them: the nodes the exporter wrote, in its order (the outputs of
both on random inputs were the same to the bit when this replaced it). onnxruntime computes them as torch does:
SGD's update to the bit, AdamW's within a rounding (onnxruntime's vectorised float32 square root is not correctly
rounded: off numpy's on 42 % of values here, by up to 3 ulps, torch's on 0.7 % by 1; tests/test_export.py, and a
whole step against torch.optim in tests/test_portable.py and tests/test_parity.py)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from onnx import TensorProto, checker, helper, numpy_helper

from models.manifest import MAX_IR_VERSION, PORTABLE_OPSET

SGD_INPUTS = ("weights", "gradient", "velocity", "lr", "momentum", "proximal_mu", "reference", "lr_scale")
ADAMW_INPUTS = ("weights", "gradient", "exp_avg", "exp_avg_sq", "lr", "beta1", "beta2", "eps", "weight_decay",
                "step_size", "bias_correction2_sqrt", "proximal_mu", "reference", "lr_scale")
SGD_PLAIN_INPUTS = ("weights", "gradient", "lr")
ADAMW_PLAIN_INPUTS = ADAMW_INPUTS[:11]
# inputs that are scalars (0-d); the others are vectors of the model's length
SCALARS = frozenset({"lr", "momentum", "proximal_mu", "beta1", "beta2", "eps", "weight_decay", "step_size",
                     "bias_correction2_sqrt"})


class _Value:
    """A value of the graph being written: Python's arithmetic on it appends the ONNX node that computes it."""

    __slots__ = ("graph", "name")

    def __init__(self, graph: _Graph, name: str) -> None:
        self.graph, self.name = graph, name

    def _node(self, op: str, other: _Value | float, reflected: bool = False) -> _Value:
        operand = other if isinstance(other, _Value) else self.graph.constant(other)
        return self.graph.node(op, operand, self) if reflected else self.graph.node(op, self, operand)

    def __add__(self, other: _Value | float) -> _Value:
        return self._node("Add", other)

    def __sub__(self, other: _Value | float) -> _Value:
        return self._node("Sub", other)

    def __rsub__(self, other: float) -> _Value:
        return self._node("Sub", other, reflected=True)

    def __mul__(self, other: _Value | float) -> _Value:
        return self._node("Mul", other)

    def __truediv__(self, other: _Value | float) -> _Value:
        return self._node("Div", other)

    def sqrt(self) -> _Value:
        return self.graph.node("Sqrt", self)


class _Graph:
    """The nodes, constants and inputs of one update graph, in the order its expressions wrote them."""

    def __init__(self, size: int, inputs: tuple[str, ...]) -> None:
        self.nodes: list[Any] = []
        self.initializers: list[Any] = []
        self.inputs = [helper.make_tensor_value_info(name, TensorProto.FLOAT, [] if name in SCALARS else [size])
                       for name in inputs]
        self.values = {name: _Value(self, name) for name in inputs}
        self.size = size

    def constant(self, value: float) -> _Value:
        name = f"constant_{len(self.initializers)}"
        self.initializers.append(numpy_helper.from_array(np.array(value, np.float32), name))
        return _Value(self, name)

    def node(self, op: str, *operands: _Value) -> _Value:
        name = f"{op.lower()}_{len(self.nodes)}"
        self.nodes.append(helper.make_node(op, [v.name for v in operands], [name], name=name))
        return _Value(self, name)

    def model(self, outputs: dict[str, _Value], name: str) -> Any:
        """The graph with each output's node writing it under its own name."""
        renamed = {value.name: output for output, value in outputs.items()}
        for node in self.nodes:
            node.input[:] = [renamed.get(n, n) for n in node.input]
            node.output[:] = [renamed.get(n, n) for n in node.output]
        graph = helper.make_graph(
            self.nodes, name, self.inputs,
            [helper.make_tensor_value_info(output, TensorProto.FLOAT, [self.size]) for output in outputs],
            self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", PORTABLE_OPSET)],
                                  ir_version=MAX_IR_VERSION, producer_name="edgefil")
        checker.check_model(model)
        return model


def _sgd(v: dict[str, _Value]) -> dict[str, _Value]:
    """torch.optim.SGD (momentum, no dampening), then the proximal pull, each at the parameter's rate."""
    rate = v["lr"] * v["lr_scale"]
    velocity = v["momentum"] * v["velocity"] + v["gradient"]
    stepped = v["weights"] - rate * velocity
    return {"new_weights": stepped - rate * v["proximal_mu"] * (v["weights"] - v["reference"]),
            "new_velocity": velocity}


def _adamw(v: dict[str, _Value]) -> dict[str, _Value]:
    """torch.optim.AdamW's update (bias corrections fed by the device), then the proximal pull."""
    rate = v["lr"] * v["lr_scale"]
    decayed = v["weights"] * (1.0 - rate * v["weight_decay"])
    exp_avg = v["exp_avg"] + (v["gradient"] - v["exp_avg"]) * (1.0 - v["beta1"])
    exp_avg_sq = v["exp_avg_sq"] * v["beta2"] + v["gradient"] * v["gradient"] * (1.0 - v["beta2"])
    denom = exp_avg_sq.sqrt() / v["bias_correction2_sqrt"] + v["eps"]
    stepped = decayed - v["step_size"] * v["lr_scale"] * (exp_avg / denom)
    return {"new_weights": stepped - rate * v["proximal_mu"] * (v["weights"] - v["reference"]),
            "new_exp_avg": exp_avg, "new_exp_avg_sq": exp_avg_sq}


def _sgd_plain(v: dict[str, _Value]) -> dict[str, _Value]:
    """SGD where momentum is 0, no proximal pull and every rate lr (models/manifest.py PLAIN_UPDATES): the same
    floats (the whole graph's other terms add exactly 0 then), in 2 passes over the weights instead of 9."""
    return {"new_weights": v["weights"] - v["lr"] * v["gradient"]}


def _adamw_plain(v: dict[str, _Value]) -> dict[str, _Value]:
    """AdamW without the proximal pull and with every rate lr: the same floats, 14 passes instead of 24."""
    decayed = v["weights"] * (1.0 - v["lr"] * v["weight_decay"])
    exp_avg = v["exp_avg"] + (v["gradient"] - v["exp_avg"]) * (1.0 - v["beta1"])
    exp_avg_sq = v["exp_avg_sq"] * v["beta2"] + v["gradient"] * v["gradient"] * (1.0 - v["beta2"])
    denom = exp_avg_sq.sqrt() / v["bias_correction2_sqrt"] + v["eps"]
    return {"new_weights": decayed - v["step_size"] * (exp_avg / denom), "new_exp_avg": exp_avg,
            "new_exp_avg_sq": exp_avg_sq}


UPDATES: dict[str, tuple[tuple[str, ...], Callable[[dict[str, _Value]], dict[str, _Value]]]] = {
    "sgd": (SGD_INPUTS, _sgd),
    "adamw": (ADAMW_INPUTS, _adamw),
    "sgd_plain": (SGD_PLAIN_INPUTS, _sgd_plain),
    "adamw_plain": (ADAMW_PLAIN_INPUTS, _adamw_plain),
}


def update_graph(update: str, size: int) -> Any:
    """The ONNX model of `update` (a key of UPDATES) for weights of `size` float32 values."""
    inputs, expressions = UPDATES[update]
    graph = _Graph(size, inputs)
    return graph.model(expressions(graph.values), f"portable_{update}")
