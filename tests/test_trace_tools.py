"""Tools of tests/gpu on the CPU: trace_decode.py's per-kernel "advance" (it reads CUPTI kernel records, here made
up) and kcache.py's kernel-cache round trip."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def trace_decode():
    path = Path(__file__).resolve().parent / "gpu" / "trace_decode.py"
    spec = importlib.util.spec_from_file_location("trace_decode", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_critical_advance_adds_up_to_the_span(trace_decode):
    # a (0-10), b starts early under programmatic launch and ends at 25, c inside b (ends 20: adds nothing),
    # d after a gap (30-32), a again (31-40): the frontier moves 10, 15, 0, 7 (30 -> 32 counts from 25), 8
    rep = [dict(ts=0.0, dur=10.0, name="a<float>"), dict(ts=5.0, dur=20.0, name="b"), dict(ts=12.0, dur=8.0, name="c"),
           dict(ts=30.0, dur=2.0, name="d"), dict(ts=31.0, dur=9.0, name="a<float>")]
    adv = trace_decode.critical_advance(list(reversed(rep)))  # any order in: sorted by start
    assert adv == {"a": 18.0, "b": 15.0, "c": 0.0, "d": 7.0}
    assert sum(adv.values()) == 40.0  # the span, first start to last end


def test_kernel_cache_round_trip(tmp_path, capsys):
    """tests/gpu/kcache.py (device_run.sh's kernel cache between device calls): pack keeps only the cubins touched
    after the stamp (built or loaded by this run), and nothing when the archive would pass the limit; unpack takes
    plain cubins only (no paths, no other files)."""
    import io
    import os
    import tarfile

    path = Path(__file__).resolve().parent / "gpu" / "kcache.py"
    spec = importlib.util.spec_from_file_location("kcache", path)
    kcache = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kcache)
    cache, stamp, archive = tmp_path / "cache", tmp_path / "stamp", str(tmp_path / "k.tar.xz")
    cache.mkdir()
    (cache / "old.cubin").write_bytes(b"o" * 1000)
    os.utime(cache / "old.cubin", (1e9, 1e9))
    stamp.touch()
    (cache / "used.cubin").write_bytes(os.urandom(4000))
    (cache / "manifest.msgpack").write_bytes(b"m")
    kcache.pack(str(cache), archive, str(stamp), 1 << 20)
    with tarfile.open(archive, "r:xz") as tar:
        assert tar.getnames() == ["used.cubin"]
    out = tmp_path / "out"
    kcache.unpack(archive, str(out))
    assert sorted(p.name for p in out.iterdir()) == ["used.cubin"]
    assert (out / "used.cubin").read_bytes() == (cache / "used.cubin").read_bytes()
    os.remove(archive)
    kcache.pack(str(cache), archive, str(stamp), 100)  # over the limit: no archive at all
    assert not os.path.exists(archive) and "over 100" in capsys.readouterr().out
    with tarfile.open(archive, "w:xz") as tar:  # a path outside the cache and a non-cubin are not unpacked
        for name in ("../evil.cubin", "x.txt", "ok.cubin"):
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, io.BytesIO(b"z"))
    kcache.unpack(archive, str(tmp_path / "out2"))
    assert sorted(p.name for p in (tmp_path / "out2").iterdir()) == ["ok.cubin"] and not (tmp_path / "evil.cubin").exists()
    # merge: the union of the archives' cubins, one of each name, into an archive that may be one of the inputs
    other = str(tmp_path / "o.tar.xz")
    with tarfile.open(other, "w:xz") as tar:
        for name, data in (("ok.cubin", b"z"), ("new.cubin", b"n" * 10)):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    kcache.merge(archive, [archive, other])
    with tarfile.open(archive, "r:xz") as tar:
        assert tar.getnames() == ["new.cubin", "ok.cubin"]
        assert tar.extractfile("new.cubin").read() == b"n" * 10


def test_ab_defines_must_be_read_by_the_kernel():
    """bench_kda_phases.py --ab and bench_moe_gemm.py --define refuse a define their kernel source (or a kernels_cu
    header) never spells (a typo would build one kernel twice); kda_intra_variants.sh has no default A/B (none is waiting
    to be measured): it stops, naming AB, when AB is unset."""
    import re

    from helpers.gpu import unused_defines

    assert unused_defines("kda_prefill.cu", ["E_SCAN", "T_ROWS", "SCALE_SCANN"]) == ["SCALE_SCANN"]
    assert unused_defines("kda_prefill.cu", ["SCALE_SCAN"]) == ["SCALE_SCAN"]  # dropped: only a comment names it
    assert unused_defines("moe_gemm_wg.cu", ["B_TMA", "A_TMA", "BTMA"]) == ["BTMA"]
    script = (Path(__file__).resolve().parent / "gpu" / "kda_intra_variants.sh").read_text()
    assert re.search(r"for ab in \$\{AB:\?", script) and not re.search(r"\$\{AB:-", script)


def test_device_scripts_parse_and_name_existing_files():
    """Every tests/gpu/*.sh (the one-call device scripts) parses (bash -n), and every repository path it names
    (tests/..., kernels_cu/..., kda_rt/...) exists: a typo there costs a device call."""
    import re
    import shutil
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    scripts = sorted((root / "tests" / "gpu").glob("*.sh"))
    assert scripts
    missing = []
    for script in scripts:
        if shutil.which("bash"):
            run = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
            assert run.returncode == 0, f"{script.name}: {run.stderr}"
        for path in re.findall(r"\b((?:tests|kernels_cu|kda_rt)/[\w./-]+\.(?:py|sh|cu|cuh))\b", script.read_text()):
            if not (root / path).exists():
                missing.append((script.name, path))
    assert not missing, missing
