"""Packaging beyond pyproject.toml. One installed package, es_ray: the repository's top-level grpo/ and launch/
folders (where the layout puts them) are built into it as es_ray.grpo and es_ray.launch (package_dir), so the wheel
adds no other top-level name to site-packages; es_ray/__init__.py maps the same names in a source checkout. The
Hydra presets in conf/ (kept at the top of the repository, where the README and their users find them) are built
in as es_ray/conf, so a wheel (`pip install .`) finds them; an editable install reads conf/ in place
(es_ray.runtime.entry.CONF_DIR)."""

import shutil
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
CONF = ROOT / "conf"
MAPPED = {"es_ray.grpo": "grpo", "es_ray.launch": "launch"}
"""Installed package -> the repository folder it is built from."""
PACKAGES = find_packages(include=["es_ray", "es_ray.*"]) + [
    name for pkg, folder in MAPPED.items() for name in [pkg] + [f"{pkg}.{sub}" for sub in find_packages(folder)]
]


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


setup(
    packages=PACKAGES,
    package_dir=MAPPED,
    package_data={"es_ray.launch": ["runtime_env.yaml"]},
    cmdclass={"build_py": BuildWithPresets},
)
