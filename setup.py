"""Package discovery (the rest of the metadata is in setup.cfg).

Every package under kda_rt/ is found automatically; the top-level source folders loader/,
sampler/ and kernels_cu/ install as kda_rt.loader, kda_rt.sampler and kda_rt.kernels_cu (with
any subpackages they grow), never under their own top-level names.
"""

from setuptools import find_packages, setup

MAPPED = {"kda_rt.loader": "loader", "kda_rt.sampler": "sampler", "kda_rt.kernels_cu": "kernels_cu"}

packages = find_packages(include=["kda_rt", "kda_rt.*"])
package_dir = dict(MAPPED)
for name, folder in MAPPED.items():
    packages.append(name)
    for sub in find_packages(where=folder):
        packages.append(f"{name}.{sub}")
        package_dir[f"{name}.{sub}"] = f"{folder}/{sub.replace('.', '/')}"

setup(packages=packages, package_dir=package_dir)
