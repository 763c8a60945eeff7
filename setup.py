"""Packaging beyond pyproject.toml: the Hydra presets in conf/ (kept at the top of the repository, where the README
and their users find them) are built into the package as es_ray/conf, so a wheel (`pip install .`) finds them; an
editable install reads conf/ in place (es_ray.runtime.entry.CONF_DIR)."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

CONF = Path(__file__).resolve().parent / "conf"


class BuildWithPresets(build_py):
    """build_py, then conf/**/*.yaml copied to <build>/es_ray/conf/ (not for an editable install)."""

    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        for path in sorted(CONF.rglob("*.yaml")):
            target = Path(self.build_lib) / "es_ray" / "conf" / path.relative_to(CONF)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, target)


setup(cmdclass={"build_py": BuildWithPresets})
