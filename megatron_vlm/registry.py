"""A typed name -> implementation registry, filled by a decorator.

Why a class and not a dict per family: every family gets the same checks (a name registered twice is an
error, not a silent override; an unknown name is a ValueError that lists the registered ones, naming the
config key) and the config reads the choices from the registry instead of a copied tuple.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    """Implementations of one algorithm family by name. `key`: the config key that selects one (named in
    errors)."""

    def __init__(self, family: str, key: str):
        self.family, self.key = family, key
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: `@REGISTRY.register("name")` above the implementation (returned unchanged)."""
        if not name or not isinstance(name, str):
            raise ValueError(f"{self.family}: a registered name must be a non-empty string, got {name!r}")

        def add(impl: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.family}: {name!r} is registered already ({self._entries[name]!r})")
            self._entries[name] = impl
            return impl
        return add

    def get(self, name: str) -> T:
        """The implementation of `name`; a ValueError naming the key and the choices otherwise."""
        try:
            return self._entries[name]
        except (KeyError, TypeError):
            raise ValueError(f"{self.key}: must be one of {self.names()}, got {name!r}") from None

    def names(self) -> list[str]:
        """Registered names, in registration order."""
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)
