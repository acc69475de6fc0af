"""Maps the top-level folders onto one import namespace, ``closedloop.<folder>``.

pyproject.toml cannot express "each folder is a subpackage, with its own subpackages found
automatically", so this file computes the package list; everything else is in pyproject.toml.
"""
from setuptools import find_packages, setup

FOLDERS = ["agents", "tools", "graphs", "trainers", "memory", "evals"]

packages = find_packages(include=["closedloop", "closedloop.*"])
package_dir = {"closedloop": "closedloop"}
for folder in FOLDERS:
    package_dir[f"closedloop.{folder}"] = folder
    packages.append(f"closedloop.{folder}")
    packages += [f"closedloop.{folder}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=package_dir, package_data={"": ["*.md", "*.jinja", "*.json", "*.yaml", "*.css", "*.js"]})
