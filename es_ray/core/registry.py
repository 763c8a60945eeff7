"""A registry is a named list of options, and it is also their validator: ``check`` refuses a name it does not
hold with the accepted ones, ``get`` returns what was registered (an object, or an import path "module:attr"
resolved on first use, so listing the names imports nothing heavy; any other string is returned as it is)."""

from __future__ import annotations

import importlib
from typing import Any, Callable

from es_ray.core.config import ConfigError


class Registry:
    def __init__(self, key: str, entries: dict[str, Any] | None = None):
        self.key = key
        """The config key whose values these are, e.g. es.shaping (named in errors)."""
        self._entries: dict[str, Any] = dict(entries or {})

    def register(self, name: str) -> Callable[[Any], Any]:
        """Decorator: ``@SHAPERS.register("zscore")``."""

        def add(obj: Any) -> Any:
            if name in self._entries:
                raise ValueError(f"{self.key}: {name!r} is registered twice")
            self._entries[name] = obj
            return obj

        return add

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def __iter__(self):
        return iter(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def check(self, name: str, key: str | None = None) -> None:
        """ConfigError unless ``name`` is registered, listing what is; ``key``: the config key to name when the
        options serve several (task.answer and eval.answer), else ``self.key``."""
        if name not in self._entries:
            key = key or self.key
            raise ConfigError(f"{key}={name!r} is not one of {', '.join(self._entries)}; set {key}= to one of them")

    def get(self, name: str) -> Any:
        self.check(name)
        obj = self._entries[name]
        if isinstance(obj, str) and ":" in obj:
            module, _, attr = obj.partition(":")
            obj = self._entries[name] = getattr(importlib.import_module(module), attr)
        return obj
