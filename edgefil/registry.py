"""Classes found by the name they declare: how learning methods plug in without a list to edit.

A base class keeps a `Registry` and adds each subclass that sets `name` as it is defined; the package holding the
built-in ones imports every one of its modules (`import_submodules`), so a new method is a new file. A class
defined elsewhere (a plugin, a test) registers the same way once its module is imported.
"""
from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Classes by name; `what` names the kind in error messages ("replay policy", "strategy")."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._classes: dict[str, type[T]] = {}

    def add(self, name: str, cls: type[T]) -> None:
        known = self._classes.get(name)
        if known is not None and known.__qualname__ != cls.__qualname__:
            raise ValueError(f"two {self.what} classes are named {name!r}: {known.__qualname__} and "
                             f"{cls.__qualname__}")
        self._classes[name] = cls

    def names(self) -> list[str]:
        return sorted(self._classes)

    def get(self, name: str) -> type[T]:
        """The class registered as `name`; ValueError naming every known name otherwise."""
        if name not in self._classes:
            raise ValueError(f"unknown {self.what} {name!r}; choose one of {', '.join(self.names())}")
        return self._classes[name]


def import_submodules(package: str, path: Iterable[str]) -> None:
    """Import every module of a package (its `__name__` and `__path__`), so that their classes register."""
    for module in pkgutil.iter_modules(path):
        importlib.import_module(f"{package}.{module.name}")
