"""Packaging (issue 13 #5): the `kda-rt` console command, LICENSE, runtime dependencies = what
runtime code imports."""

from __future__ import annotations

import ast
import configparser
import sys
import types
from pathlib import Path

import pytest

from kda_rt import cli

ROOT = Path(__file__).resolve().parents[1]
RUNTIME_DIRS = ("kda_rt", "loader", "sampler")
# distribution name -> import name, where they differ
IMPORT_NAMES = {"jinja2": "jinja2", "ml_dtypes": "ml_dtypes", "msgpack": "msgpack", "numpy": "numpy",
                "tiktoken": "tiktoken", "tqdm": "tqdm"}
NOT_RUNTIME = ("kda_rt/demo/make_vocab.py", "kda_rt/demo/make_demo.py")  # maintainer scripts


@pytest.mark.parametrize("argv, expect", [
    (["serve", "/models/k", "--port", "9"], ["--model", "/models/k", "--port", "9"]),
    (["serve", "--model", "/m"], ["--model", "/m"]),
    (["generate", "/m", "--prompt", "hi"], ["--model", "/m", "--prompt", "hi"]),
    (["bench"], []),
], ids=["serve-positional", "serve-flag", "generate-positional", "bench-bare"])
def test_subcommand_forwards_model(monkeypatch, argv, expect):
    seen = []
    fake = types.SimpleNamespace(main=lambda rest: seen.append(rest) or 0)
    module = cli._COMMANDS[argv[0]][0]
    monkeypatch.setitem(sys.modules, module, fake)
    assert cli.main(argv) == 0
    assert seen == [expect]


@pytest.mark.parametrize("extra", [["--model", "/b"], ["--model=/b"]])
def test_model_given_twice_is_refused(monkeypatch, capsys, extra):
    seen = []
    monkeypatch.setitem(sys.modules, cli._COMMANDS["generate"][0], types.SimpleNamespace(main=seen.append))
    assert cli.main(["generate", "/a", *extra]) == 2
    assert "given twice" in capsys.readouterr().err and not seen


def test_usage_and_unknown(capsys):
    assert cli.main([]) == 0
    assert "kda-rt {serve,generate,bench,run-batch}" in capsys.readouterr().out
    assert cli.main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err


def test_console_script_declared():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert "kda-rt = kda_rt.cli:main" in cfg["options.entry_points"]["console_scripts"]


def test_license_file():
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0" in text
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    assert cfg["metadata"]["license"] == "Apache-2.0"
    assert (ROOT / "kda_rt" / "py.typed").exists()


def _third_party_imports() -> set[str]:
    found = set()
    for folder in RUNTIME_DIRS:
        for path in (ROOT / folder).rglob("*.py"):
            if str(path.relative_to(ROOT)) in NOT_RUNTIME:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    found |= {a.name.split(".")[0] for a in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    found.add(node.module.split(".")[0])
    return found - set(sys.stdlib_module_names) - {"kda_rt", "loader", "sampler"}


def test_runtime_dependencies_match_imports():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    required = {line.split(">")[0].split("=")[0].strip() for line in cfg["options"]["install_requires"].split("\n")
                if line.strip()}
    optional = {"cupy", "cupy_backends", "nvidia", "starlette", "uvicorn", "msgspec", "prometheus_client", "httpx", "openai",
                "llguidance", "httptools"}  # extras (cuda12/13: cupy, its nvidia wheels; server; structured);
    # httptools: uvicorn's optional parser, only probed (kda_rt/server/http.py)
    imported = _third_party_imports()
    assert {IMPORT_NAMES[d] for d in required} <= imported, "a runtime dependency no runtime code imports"
    assert imported - optional <= {IMPORT_NAMES[d] for d in required}, "runtime code imports an undeclared package"


@pytest.mark.parametrize(("argv", "needle"), [
    (["--port", "99999"], "--port must be in [0, 65535]"), (["--port", "-1"], "--port must be in [0, 65535]"),
    (["--engine-start-timeout", "-5"], "--engine-start-timeout must be"),
    (["--engine-start-timeout", "nan"], "--engine-start-timeout must be"),
    (["--engine-timeout", "nan"], "--engine-timeout must be"), (["--body-timeout", "inf"], "--body-timeout must be"),
    (["--shutdown-timeout", "nan"], "--shutdown-timeout must be"),
    (["--allow-credentials"], "--allow-credentials needs the origins named"),
    (["--ssl-keyfile", "k.pem"], "go together"), (["--ssl-keyfile", "/no/k", "--ssl-certfile", "/no/c"], "no such file"),
])
def test_serve_flag_bounds(capsys, argv, needle):
    """Out-of-range serve flags are refused by name before the model loads (was: --port 99999 an OverflowError
    traceback after loading; --engine-start-timeout -5 'engine process did not start ()'; NaN timeouts accepted)."""
    from kda_rt.server.__main__ import main

    assert main(argv) == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "needle"), [
    (["--chat", "--prompt-token-ids", "1,2"], "--prompt-token-ids does not go with --chat"),
    (["--prompt", "hi", "--prompt-token-ids", "1,2"], "--prompt-token-ids does not go with --prompt"),
    (["--system", "hi"], "--system needs --chat"),
    (["--prompt-token-ids", ""], "argument --prompt-token-ids: no token ids given"),
    (["--prompt-token-ids", "1,x"], "argument --prompt-token-ids: 'x' in '1,x' is not a token id"),
    (["--prompt-token-ids", "1,,2"], "argument --prompt-token-ids: '' in '1,,2' is not a token id"),
    (["--model", "{file}"], "--model '{file}' is a file, not a checkpoint directory"),
    (["--model", "{file}/nope"], "--model '{file}/nope': no such directory"),
], ids=["chat-and-ids", "prompt-and-ids", "system-without-chat", "ids-empty", "ids-not-int", "ids-empty-item",
        "model-file", "model-missing"])
def test_generate_bad_flags_named(capsys, tmp_path, argv, needle):
    """Refused by name before the model loads (was: --chat chatted the default prompt and ignored the ids, --system
    without --chat was ignored, --prompt-token-ids '' ran the default text prompt, 1,x gave "invalid literal for
    int() with base 10: 'x'", 1,,2 dropped an id)."""
    from kda_rt.generate import main

    file = tmp_path / "config.json"
    file.write_text("{}")
    with pytest.raises(SystemExit) as exc:
        main([a.format(file=file) for a in argv])
    assert exc.value.code == 2 and needle.format(file=file) in capsys.readouterr().err


def test_bench_model_file_named(capsys, tmp_path):
    """Was: '.../config.json: cannot read (Not a directory)' for --model naming a file."""
    from kda_rt.bench import main

    file = tmp_path / "passwd"
    file.write_text("root:x:0:0\n")
    with pytest.raises(SystemExit) as exc:
        main(["--model", str(file)])
    assert exc.value.code == 2 and f"--model '{file}' is a file, not a checkpoint directory" in capsys.readouterr().err


@pytest.mark.parametrize(("text", "needle"), [
    ("{bad", ":1:2: not valid JSON (Expecting property name"), ("[" * 100_000, ": not valid JSON (maximum recursion"),
    (b"\xff\xfe", ": not valid JSON ('utf-8' codec"), (None, ": no such file, nor a preset (kimi-linear-48b-a3b)"),
], ids=["malformed", "deep", "not-utf8", "missing"])
def test_bench_config_file_named(capsys, tmp_path, text, needle):
    """Was: "error: Expecting property name enclosed in double quotes: line 1 column 2 (char 1)", no file named."""
    from kda_rt.bench import main

    path = tmp_path / "bad.json"
    if isinstance(text, bytes):
        path.write_bytes(text)
    elif text is not None:
        path.write_text(text)
    assert main(["--config", str(path), "--random-weights"]) == 2
    assert f"error: --config '{path}'{needle}" in capsys.readouterr().err


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))


def test_run_batch_command_is_vllms(tmp_path, capsys):
    """`kda-rt run-batch -i IN -o OUT` is `python -m kda_rt.run_batch` (vLLM's `vllm run-batch`); its flags are
    checked before anything loads."""
    from kda_rt.cli import main

    assert main(["run-batch", "-i", str(tmp_path / "none.jsonl"), "-o", str(tmp_path / "o.jsonl")]) == 2
    assert "--input-file" in capsys.readouterr().err


def test_generate_exits_1_when_the_request_fails(capsys, monkeypatch):
    """A request that ends with finish_reason "error" (non-finite logits: NaN weights, an overflow) makes generate exit
    1 naming the failure (was: 0, as if it had worked); a good run exits 0."""
    from kda_rt import LLM, generate

    assert generate.main(["--max-tokens", "2"]) == 0
    real = LLM.generate

    def failing(self, *a, **k):
        outs = real(self, *a, **k)
        outs[0].outputs[0].finish_reason, outs[0].outputs[0].stop_reason = "error", "non-finite logits"
        return outs

    monkeypatch.setattr(LLM, "generate", failing)
    capsys.readouterr()
    assert generate.main(["--max-tokens", "2"]) == 1
    assert "error: the request failed: non-finite logits" in capsys.readouterr().err
