"""`python -m kda_rt.serve` refuses bad flags by name before the model loads: empty --api-key /
--served-model-name / --host, a host that does not resolve, HTTPS files that are not a PEM certificate and its key,
a --model that is a file.  `serve` is replaced by a stub, so nothing loads and a missed check fails fast."""

from __future__ import annotations

import socket

import pytest

pytest.importorskip("uvicorn")

from kda_rt.server import __main__ as serve_main  # noqa: E402

# a self-signed P-256 certificate (CN kda-rt-test), its key, another key, and its key encrypted (pass phrase "pw")
CERT = """-----BEGIN CERTIFICATE-----
MIIBgjCCASmgAwIBAgIUIrWyk2F11ndmz7EBz7DjX/UPUV4wCgYIKoZIzj0EAwIw
FjEUMBIGA1UEAwwLa2RhLXJ0LXRlc3QwIBcNMjYxMjAzMTAzMTEyWhgPMjEyNjEx
MDkxMDMxMTJaMBYxFDASBgNVBAMMC2tkYS1ydC10ZXN0MFkwEwYHKoZIzj0CAQYI
KoZIzj0DAQcDQgAE1PTjUQVXSQUKJ+qZLmtO9VxL4/8FsKJyHe+Y9zxU0D61r6e1
WMgYPXo/Jhr7ivSBTJXFrEi0VYgBAbILa5JbsaNTMFEwHQYDVR0OBBYEFGkOfkEe
mxVfVauu3cinZ1Ba+DatMB8GA1UdIwQYMBaAFGkOfkEemxVfVauu3cinZ1Ba+Dat
MA8GA1UdEwEB/wQFMAMBAf8wCgYIKoZIzj0EAwIDRwAwRAIgG2WkAFXu1Dlc7IH6
TiQexK0QDFWTipQPY3B7Rkq6R9cCIFcVFw2VZVODUH3xdSQin2ZhJsVJVeU7R6sV
UE+wkAfN
-----END CERTIFICATE-----
"""
KEY = """-----BEGIN PRIVATE KEY-----
MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQgTtAyWDhl8Ui7u5RH
AXhF+0naFw9r2UxkUZ1TucwuJnOhRANCAATU9ONRBVdJBQon6pkua071XEvj/wWw
onId75j3PFTQPrWvp7VYyBg9ej8mGvuK9IFMlcWsSLRViAEBsgtrklux
-----END PRIVATE KEY-----
"""
OTHER_KEY = """-----BEGIN PRIVATE KEY-----
MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQgggd5INu9yq1V6zDT
IU5ZD1n3anI+7qjNqrSG+wH+fZehRANCAATq6QkaOZksrtFSiKA2C1jAlfzsaQG4
RumXzQdMPGO73+CqDZboltPqTVkWnZl69ICVvfbODMfSixgumgxjvC83
-----END PRIVATE KEY-----
"""
ENCRYPTED_KEY = """-----BEGIN EC PRIVATE KEY-----
Proc-Type: 4,ENCRYPTED
DEK-Info: AES-128-CBC,3432B86A73B40BB788D7DEEE327E8657

F5H2ajqYi6cmny3EKu43UxCSZvBpdNfGNA1PmZME1VSc2yyOF9bBHmYj5sYAu6pd
xn4SxkLdMHKeOE8kxSN/pLGk7yMLF4xGLMaHvzCK/m/ZQpH00z0yezvltzXMGhmd
XoiDZnoVlN6BOFZRA+EnEgn/9BFvrgFIbzCHcaVf5Qc=
-----END EC PRIVATE KEY-----
"""


@pytest.fixture
def started(monkeypatch):
    """The Namespaces `serve` was started with (a stub: nothing loads)."""
    calls = []

    async def fake_serve(args, settings):
        calls.append(args)
        return 0

    monkeypatch.setattr(serve_main, "serve", fake_serve)
    # main() configures logging: a root handler on capsys's stream, closed after the test (later tests' logs then
    # printed "--- Logging error --- I/O operation on closed file")
    monkeypatch.setattr(serve_main, "configure_logging", lambda level: None)
    return calls


@pytest.fixture
def pem(tmp_path):
    """name -> path of a file holding that PEM text ('text': a file that exists but is no PEM)."""
    files = {"cert": CERT, "key": KEY, "other_key": OTHER_KEY, "encrypted_key": ENCRYPTED_KEY, "text": "kda-rt\n"}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return {name: str(tmp_path / name) for name in files}


def _refused(argv, started, capsys) -> str:
    assert serve_main.main(argv) == 2
    assert not started, "the model would have loaded"
    return capsys.readouterr().err


@pytest.mark.parametrize(("argv", "needle"), [
    (["--api-key", ""], "--api-key is empty"),
    (["--served-model-name", ""], "--served-model-name: an empty name"),
    (["--served-model-name", "kimi", " "], "--served-model-name: an empty name"),
    (["--host", ""], "--host is empty"),
    (["--metrics-prefix", "vllm-x"], "--metrics-prefix 'vllm-x' is not a Prometheus name start"),
    (["--metrics-prefix", ""], "--metrics-prefix '' is not a Prometheus name start"),
], ids=["api-key", "served-model-name", "served-model-alias", "host", "metrics-prefix", "metrics-prefix-empty"])
def test_empty_values_refused(started, capsys, argv, needle):
    """Was: --api-key "" turned auth off (compare_digest of two empty strings), --served-model-name "" served the
    model as id "", --host "" listened on every interface."""
    assert needle in _refused(argv, started, capsys)


def test_empty_api_key_variable_means_no_key(started, monkeypatch):
    """An empty $KDA_RT_API_KEY / $VLLM_API_KEY counts as unset (as vLLM's `args.api_key or VLLM_API_KEY`): no key,
    not an error; a set one is the default."""
    monkeypatch.setenv("KDA_RT_API_KEY", "")
    monkeypatch.setenv("VLLM_API_KEY", "")
    assert serve_main.main([]) == 0 and started[-1].api_key is None
    monkeypatch.setenv("VLLM_API_KEY", "vk")
    assert serve_main.main([]) == 0 and started[-1].api_key == "vk"


def test_unresolvable_host_named(started, capsys, monkeypatch):
    """Was: '[Errno -2] Name or service not known' from uvicorn (exit 3) after the model had loaded."""
    def no_such_host(host, *args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(socket, "getaddrinfo", no_such_host)
    err = _refused(["--host", "999.1.1.1"], started, capsys)
    assert "--host '999.1.1.1': cannot resolve it (Name or service not known)" in err


@pytest.mark.parametrize(("cert", "key", "needle"), [
    ("text", "text", "--ssl-certfile '{text}': not a PEM certificate"),
    ("key", "key", "--ssl-certfile '{key}': not a PEM certificate"),
    ("cert", "text", "--ssl-keyfile '{text}': not a PEM private key"),
    ("cert", "other_key", "--ssl-keyfile '{other_key}' is not the key of --ssl-certfile '{cert}'"),
], ids=["neither-pem", "key-as-cert", "key-not-pem", "key-mismatch"])
def test_ssl_files_checked_before_loading(started, capsys, pem, cert, key, needle):
    """Was: a raw ssl.SSLError traceback from uvicorn after the model had loaded."""
    err = _refused(["--ssl-certfile", pem[cert], "--ssl-keyfile", pem[key]], started, capsys)
    assert needle.format(**pem) in err


def test_good_ssl_pair_starts(started, pem):
    """A matching pair passes; an encrypted key is left to uvicorn (OpenSSL asks for its pass phrase), not refused
    and not prompted for by the check."""
    assert serve_main.main(["--ssl-certfile", pem["cert"], "--ssl-keyfile", pem["key"]]) == 0 and started
    assert serve_main._ssl_problem(pem["cert"], pem["encrypted_key"]) is None


def test_model_file_refused(started, capsys, tmp_path):
    """Was: 'model directory ... does not exist' from the engine process, for a path that exists."""
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"")
    assert f"--model '{path}' is a file, not a checkpoint directory" in _refused(["--model", str(path)], started,
                                                                                  capsys)


def test_bad_store_settings_refused(started, capsys, monkeypatch):
    assert "--responses-store-size must be >= 1" in _refused(["--responses-store-size", "0"], started, capsys)
    assert "--responses-store-max-mib must be a number > 0" in _refused(["--responses-store-max-mib", "nan"], started,
                                                                         capsys)
    monkeypatch.setenv("VLLM_ENABLE_RESPONSES_API_STORE", "maybe")
    assert "VLLM_ENABLE_RESPONSES_API_STORE must be 0 or 1" in _refused([], started, capsys)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
