"""Package discovery for the four source roots (metadata lives in pyproject.toml).

``patches/``, ``eval/`` and ``configs/`` sit at the top level of the repository but import as
``retrofit.patches``, ``retrofit.eval`` and ``retrofit.configs``; every package under each root is
found here, so a new sub-package cannot be left out of a wheel (``scripts/check-wheel.sh`` builds
one and compares it with the tree).
"""
from setuptools import find_packages, setup

ROOTS = {"retrofit": "retrofit", "retrofit.patches": "patches", "retrofit.eval": "eval", "retrofit.configs": "configs"}


def packages() -> list[str]:
    found = []
    for name, folder in ROOTS.items():
        found += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]
    return sorted(found)


if __name__ == "__main__":  # setuptools runs this file as __main__; the tests only read packages()
    setup(packages=packages(), package_dir=ROOTS)
