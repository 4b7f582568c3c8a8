"""Fixtures for the server tests: a real `python -m kda_rt.serve` on loopback (NumPy backend, the
bundled demo checkpoint), started once per test module."""

from __future__ import annotations

import importlib.util

import pytest

# The server tests need the `server` extra and httpx/openai (all in the `test` extra); without
# them only the dependency-closure test is collected.
MISSING = [m for m in ("httpx", "openai", "starlette", "uvicorn", "msgspec") if importlib.util.find_spec(m) is None]
collect_ignore_glob = [f for f in ("test_errors.py", "test_fuzz.py", "test_load.py", "test_openai_client.py",
                                   "test_openai_structured.py", "test_shutdown.py",
                                   "test_prefix_cache_server.py")] if MISSING else []


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    """The shared server of a test module (16 sequences, API key set)."""
    from helpers.server import ServerProc, pid_gone

    srv = ServerProc(tmp_path_factory.mktemp("server") / "server.log")
    yield srv
    assert srv.stop() == 0, srv.log()
    assert pid_gone(srv.engine_pid), "engine process outlived the server"


@pytest.fixture(scope="module")
def reference_llm():
    """The same checkpoint and limits in-process: `LLM.generate` is the oracle for seeded requests."""
    from helpers.server import MAX_MODEL_LEN
    from kda_rt import LLM
    from kda_rt.demo import demo_path

    return LLM(str(demo_path()), backend="numpy", max_model_len=MAX_MODEL_LEN, max_num_seqs=16,
               enable_prefix_caching=False)
