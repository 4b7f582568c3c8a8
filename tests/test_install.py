"""The package installs whole from a wheel (no `-e`): every subpackage, every kernel source, and
`python -m kda_rt.generate` runs from a directory outside the source tree (issue 8)."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

CHECK = textwrap.dedent("""
    import hashlib, json, pathlib, sys
    import kda_rt, kda_rt.cuda, kda_rt.cuda.ops, kda_rt.loader, kda_rt.sampler, kda_rt.server, kda_rt.reference, kda_rt.engine, kda_rt.text
    from kda_rt.cuda.ops import compile as comp
    site = pathlib.Path(sys.argv[1]).resolve()
    mods = {m.__name__: m.__file__ for m in (kda_rt, kda_rt.cuda, kda_rt.cuda.ops, kda_rt.loader, kda_rt.sampler,
                                             kda_rt.server, kda_rt.reference, kda_rt.engine, kda_rt.text)}
    kernels = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in comp.KERNEL_DIR.iterdir()}
    print(json.dumps({"modules": mods, "kernel_dir": str(comp.KERNEL_DIR), "kernels": kernels,
                      "site": str(site), "torch": "torch" in sys.modules}))
""")


def run(cmd, **kw):
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kw)
    assert res.returncode == 0, f"{cmd} failed:\n{res.stdout[-3000:]}\n{res.stderr[-3000:]}"
    return res


def test_wheel_installs_whole(tmp_path):
    import json
    import shutil

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    # built from a copy: an in-tree build leaves build/ (whose stale build/lib files a later wheel would ship) and
    # *.egg-info in the checkout
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", ".whl", ".kcache", "build", "*.egg-info", "__pycache__", ".hypothesis", ".pytest_cache",
        ".ruff_cache"))
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"), str(src)], env=env)
    (wheel,) = (tmp_path / "dist").glob("kda_rt-*.whl")
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)], env=env)
    py = venv / "bin" / "python"
    site = Path(run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)], env=env)
    # the dependencies (numpy, tiktoken, ...) come from this environment's site-packages as plain path
    # entries: their .pth files (an editable kda_rt among them) are not processed, so kda_rt can only
    # come from the wheel
    deps = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "_test_deps.pth").write_text("\n".join(sorted(deps)) + "\n")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    res = run([str(py), "-c", CHECK, str(site)], cwd=outside, env=env)
    info = json.loads(res.stdout)
    for name, path in info["modules"].items():
        assert Path(path).resolve().is_relative_to(site), f"{name} imported from {path}, not the installed wheel"
    assert Path(info["kernel_dir"]).resolve() == site / "kda_rt" / "kernels_cu"
    sources = {p.name for p in (REPO / "kernels_cu").iterdir() if p.suffix in (".cu", ".cuh")}
    assert sources and sources <= set(info["kernels"]), f"missing kernel sources: {sources - set(info['kernels'])}"
    import hashlib

    for name in sources:
        assert info["kernels"][name] == hashlib.sha256((REPO / "kernels_cu" / name).read_bytes()).hexdigest(), name
    assert not info["torch"]
    assert not (site / "loader").exists() and not (site / "sampler").exists(), "top-level loader/sampler installed"
    gen = run([str(py), "-m", "kda_rt.generate", "--max-tokens", "4", "--backend", "numpy"], cwd=outside, env=env)
    assert "generated 4 tokens" in gen.stderr, gen.stderr


def test_dockerfile_copies_what_the_build_reads():
    """The image installs the same way (a regular `pip install .`), so every file the build reads
    must be copied in: setup.py, setup.cfg, pyproject.toml, the README (long_description), the
    license file, and the package source folders."""
    import configparser
    import re

    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    needed = {"setup.py", "setup.cfg", "pyproject.toml", "kda_rt", "loader", "sampler", "kernels_cu"}
    needed |= set(re.findall(r"file:\s*(\S+)", cfg["metadata"].get("long_description", "")))
    needed |= set(cfg["metadata"].get("license_files", "").split())
    copied = set()
    for line in (REPO / "Dockerfile").read_text().splitlines():
        if line.startswith("COPY "):
            copied |= {p.rstrip("/").removeprefix("./") for p in line.split()[1:-1]}
    assert needed <= copied, f"Dockerfile does not copy {sorted(needed - copied)}"
    assert "pip install" in (REPO / "Dockerfile").read_text() and " -e " not in (REPO / "Dockerfile").read_text()
