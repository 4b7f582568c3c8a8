"""`python -m kda_rt.run_batch` (vLLM's run_batch): an OpenAI batch file through the server's app offline: answers
in input order equal the in-process engine's (greedy), bad lines answered with errors naming them while the rest run,
a full engine queue (429) waited out, and flags checked before the model loads."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from kda_rt import SamplingParams


def _line(cid, url, body):
    return json.dumps({"custom_id": cid, "method": "POST", "url": url, "body": {"model": "demo", **body}})


def test_a_batch_file_is_answered_in_order(tmp_path, reference_llm):
    prompts = [[5 + i, 40 + i, 77, 9 * i + 3] for i in range(8)]
    lines = [_line(f"c{i}", "/v1/completions", {"prompt": p, "max_tokens": 5, "temperature": 0.0, "ignore_eos": True})
             for i, p in enumerate(prompts)]
    lines.insert(3, "{not json")
    lines.insert(5, _line("bad", "/v1/completions", {"prompt": "x", "max_tokens": -1}))
    lines.append(_line("chat", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                         "max_tokens": 3, "temperature": 0.0}))
    lines.append(_line("streamed", "/v1/completions", {"prompt": "x", "stream": True}))
    # lines json.loads takes but no JSON encoder sends again: the server's own 400s, the rest still run
    lines.append('{"custom_id": "inf", "method": "POST", "url": "/v1/completions", "body": {"model": "demo", '
                 '"prompt": "x", "max_tokens": 2, "temperature": Infinity}}')
    lines.append('{"custom_id": "surrogate", "method": "POST", "url": "/v1/completions", "body": {"model": "demo", '
                 '"prompt": "\\ud800", "max_tokens": 2}}')
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines) + "\n\n")
    # one waiting sequence at most: most requests are refused with 429 first and sent again
    done = subprocess.run([sys.executable, "-m", "kda_rt.run_batch", "-i", str(src), "-o", str(out), "--backend",
                           "numpy", "--max-model-len", "256", "--max-waiting", "1", "--max-concurrency", "8"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


    retried = re.search(r"(\d+) sent again after a full queue", done.stderr)
    assert retried and int(retried.group(1)) > 0, done.stderr[-2000:]
    results = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(results) == len(lines)
    by_id = {r["custom_id"]: r for r in results if r["custom_id"] is not None}
    for i, p in enumerate(prompts):
        r = by_id[f"c{i}"]
        assert r["response"]["status_code"] == 200 and r["error"] is None
        want = reference_llm.generate({"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=5,
                                                                             ignore_eos=True))[0].outputs[0].text
        assert r["response"]["body"]["choices"][0]["text"] == want
    assert [r["custom_id"] for r in results] == [*(f"c{i}" for i in range(3)), None, "c3", "bad",
                                                 *(f"c{i}" for i in range(4, 8)), "chat", "streamed", "inf",
                                                 "surrogate"]
    assert results[3]["error"]["message"].startswith("line 4: not JSON")
    assert by_id["bad"]["response"]["status_code"] == 400 and "max_tokens" in by_id["bad"]["error"]["message"]
    assert by_id["chat"]["response"]["body"]["object"] == "chat.completion"
    assert "stream is not supported" in by_id["streamed"]["error"]["message"]
    assert by_id["inf"]["response"]["status_code"] == 400 and "not valid JSON" in by_id["inf"]["error"]["message"]
    assert by_id["surrogate"]["response"]["status_code"] == 400 and "surrogate" in by_id["surrogate"]["error"]["message"]


def test_flags_checked_before_loading(tmp_path):
    done = subprocess.run([sys.executable, "-m", "kda_rt.run_batch", "-i", str(tmp_path / "missing.jsonl"), "-o",
                           str(tmp_path / "o.jsonl")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--input-file" in done.stderr and "No such file" in done.stderr
    (tmp_path / "in.jsonl").write_text("")
    done = subprocess.run([sys.executable, "-m", "kda_rt.run_batch", "-i", str(tmp_path / "in.jsonl"), "-o",
                           str(tmp_path / "o.jsonl"), "--max-concurrency", "0"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and "--max-concurrency must be >= 1" in done.stderr
    done = subprocess.run([sys.executable, "-m", "kda_rt.run_batch", "-i", str(tmp_path / "in.jsonl"), "-o",
                           str(tmp_path / "missing" / "o.jsonl")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--output-file" in done.stderr and "cannot be written" in done.stderr


def test_a_line_not_utf8_is_its_own_error(tmp_path):
    # (was: a UnicodeDecodeError traceback, exit 1, before any line ran)
    good = _line("good", "/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "temperature": 0.0})
    bad = _line("latin1", "/v1/completions", {"prompt": "caf\u00e9", "max_tokens": 2})
    bad = bad.replace("\\u00e9", "\u00e9").encode("latin-1")  # a file written in Latin-1: b"caf\xe9"
    assert b"caf\xe9" in bad
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_bytes(good.encode() + b"\n" + bad + b"\n" + good.replace('"good"', '"good2"').encode() + b"\n")
    done = subprocess.run([sys.executable, "-m", "kda_rt.run_batch", "-i", str(src), "-o", str(out), "--backend",
                           "numpy", "--max-model-len", "256"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["custom_id"] for r in results] == ["good", None, "good2"]
    assert results[0]["error"] is None and results[2]["error"] is None
    assert results[1]["response"]["status_code"] == 400
    assert results[1]["error"]["message"].startswith("line 2: not UTF-8 text")
