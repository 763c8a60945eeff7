"""A registry is a named list of options, and it is also their validator: ``check`` refuses a name it does not
hold with the accepted ones, ``get`` returns what was registered.

One style for every registry in the project: a table, ``NAME = Registry("config.key", {"name": obj, ...})``, written
beside the definitions it lists (below them in their module, or in their package's ``__init__``), its entries the
objects themselves, imported. A table reads as the whole list at once, and needs no module imported for its
side effect, as a decorator registry would. Where an entry's module is heavy and must stay unimported until it is
used (vLLM, or torch in the drivers), the entry is a small object whose methods import it (``es_ray.engines``),
never a "module:attr" string (tests/repo/test_registries.py checks both)."""

from __future__ import annotations

from typing import Any, Generic, Iterator, Mapping, TypeVar

from es_ray.core.config import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, key: str, entries: Mapping[str, T]):
        self.key = key
        """The config key whose values these are, e.g. es.shaping (named in errors)."""
        self._entries: dict[str, T] = dict(entries)

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def items(self) -> tuple[tuple[str, T], ...]:
        return tuple(self._entries.items())

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __contains__(self, name: Any) -> bool:
        return name in self._entries

    def check(self, name: str, key: str | None = None) -> None:
        """ConfigError unless ``name`` is registered, listing what is; ``key``: the config key to name when the
        options serve several (task.answer and eval.answer), else ``self.key``."""
        if name not in self._entries:
            key = key or self.key
            raise ConfigError(f"{key}={name!r} is not one of {', '.join(self._entries)}; set {key}= to one of them")

    def get(self, name: str) -> T:
        self.check(name)
        return self._entries[name]
