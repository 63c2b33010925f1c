"""The package list, found rather than kept by hand: every package under gradsched/, and passes/ (a sibling
of gradsched/ in the checkout, so the passes read as a library of their own) installed as gradsched.passes.
Everything else about the package is in pyproject.toml."""
from setuptools import find_packages, setup

passes = ["gradsched." + p for p in find_packages(include=["passes", "passes.*"])]
setup(packages=find_packages(include=["gradsched", "gradsched.*"]) + passes,
      package_dir={"gradsched.passes": "passes"})
