"""es_ray: Evolution Strategies vs GRPO for LLM reasoning on Ray.

The GRPO method and the launch tools live in the repository's top-level grpo/ and launch/ folders and are the
subpackages ``es_ray.grpo`` and ``es_ray.launch``: a wheel installs them inside es_ray (setup.py's package_dir), so
it adds no top-level name beside es_ray to site-packages. In a source checkout (an editable install, a Ray Job's
copy of the working directory, or the repository on sys.path) the finder below maps the two names onto those
folders, so every checkout imports the same modules a wheel does.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
_MAPPED = {f"{__name__}.{name}": _HERE.parent / name for name in ("grpo", "launch")}


class _CheckoutFinder(importlib.abc.MetaPathFinder):
    """es_ray.grpo -> <checkout>/grpo, es_ray.launch -> <checkout>/launch (their submodules then follow the
    package's own __path__)."""

    def find_spec(self, fullname, path=None, target=None):
        folder = _MAPPED.get(fullname)
        if folder is None or not (folder / "__init__.py").is_file():
            return None
        return importlib.util.spec_from_file_location(
            fullname, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )


if not (_HERE / "grpo").is_dir() and not any(isinstance(f, _CheckoutFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _CheckoutFinder())
