"""The kernel cache's round trip between device calls (tests/gpu/device_run.sh), with Python's tarfile (xz by the
standard library's lzma: no xz binary needed on the machine).

  python tests/gpu/kcache.py unpack ARCHIVE DIR         the cubins of ARCHIVE into DIR (made if absent)
  python tests/gpu/kcache.py pack DIR ARCHIVE STAMP MAX  the cubins of DIR touched after STAMP (built, or loaded:
                                                         compile_cubin touches a hit) into ARCHIVE if the archive
                                                         stays under MAX bytes; otherwise none
  python tests/gpu/kcache.py merge ARCHIVE IN...          (here, between calls) the cubins of every IN archive (the
                                                         carried .kcache/kcache.tar.xz and the calls' returned ones)
                                                         into ARCHIVE, one of each name (a name is the cubin's key:
                                                         source, options, arch, NVRTC); ARCHIVE may be one of the IN
"""

from __future__ import annotations

import io
import os
import sys
import tarfile
from pathlib import Path


def unpack(archive: str, directory: str) -> None:
    Path(directory).mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "r:xz") as tar:
        members = [m for m in tar.getmembers() if m.isfile() and m.name.endswith(".cubin") and "/" not in m.name]
        tar.extractall(directory, members=members, filter="data")
    print(f"kernel cache: {len(members)} cubins from {archive}")


def pack(directory: str, archive: str, stamp: str, limit: int) -> None:
    since = os.stat(stamp).st_mtime
    cubins = sorted(p for p in Path(directory).glob("*.cubin") if p.stat().st_mtime >= since) if Path(directory).is_dir() else []
    if not cubins:
        print(f"kernel cache: no cubin used in {directory}: nothing returned")
        return
    tmp = archive + ".tmp"
    with tarfile.open(tmp, "w:xz") as tar:
        for p in cubins:
            tar.add(p, arcname=p.name)
    size = os.path.getsize(tmp)
    if size < limit:
        os.replace(tmp, archive)
        print(f"kernel cache: {len(cubins)} cubins used this run, {size} bytes -> {archive}")
    else:
        os.remove(tmp)
        print(f"kernel cache: the {len(cubins)} cubins used this run are {size} bytes compressed, over {limit}: "
              "not returned")


def merge(archive: str, inputs: list[str]) -> None:
    cubins: dict[str, bytes] = {}
    for path in inputs:
        with tarfile.open(path, "r:xz") as tar:
            for m in tar.getmembers():
                if m.isfile() and m.name.endswith(".cubin") and "/" not in m.name:
                    cubins.setdefault(m.name, tar.extractfile(m).read())
    tmp = archive + ".tmp"
    with tarfile.open(tmp, "w:xz") as tar:
        for name in sorted(cubins):
            info = tarfile.TarInfo(name)
            info.size = len(cubins[name])
            tar.addfile(info, io.BytesIO(cubins[name]))
    os.replace(tmp, archive)
    print(f"kernel cache: {len(cubins)} cubins from {len(inputs)} archives, {os.path.getsize(archive)} bytes -> {archive}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["unpack"] and len(sys.argv) == 4:
        unpack(sys.argv[2], sys.argv[3])
    elif sys.argv[1:2] == ["pack"] and len(sys.argv) == 6:
        pack(sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5]))
    elif sys.argv[1:2] == ["merge"] and len(sys.argv) >= 4:
        merge(sys.argv[2], sys.argv[3:])
    else:
        sys.exit(__doc__)
