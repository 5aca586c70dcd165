"""Packages are derived from the folders, so a new subpackage can never be left out of the wheel.

The import names differ from the folder names (`autobyte` lives in client/, `autobyted.migrations`
in migrations/): each root is mapped here and in `package_dir`, and everything below it that is a
package (has an __init__.py) is found by setuptools. Metadata, dependencies and entry points are in
setup.cfg.
"""

from setuptools import find_packages, setup

# import name -> folder in this repository
ROOTS = {"autobyte": "client", "autobyted": "autobyted", "autobyted.migrations": "migrations"}


def packages() -> list[str]:
    found = []
    for name, folder in ROOTS.items():
        found.append(name)
        found += [f"{name}.{sub}" for sub in find_packages(folder)]
    return found


setup(package_dir=ROOTS, packages=packages())
