"""The runtime never imports torch: import kda_rt and generate on the numpy backend in a fresh
interpreter, then check sys.modules."""

from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = """
import json, sys
from kda_rt import LLM, SamplingParams
from kda_rt.demo import demo_path
llm = LLM(str(demo_path()), backend="numpy")
out = llm.generate("hello", SamplingParams(max_tokens=4, temperature=0))[0]
try:  # structured outputs (the `structured` extra) stay torch-free too
    import llguidance
    llm.generate("hello", SamplingParams(max_tokens=4, structured_outputs={"regex": "[a-z]+"}))
except ImportError:
    pass
print(json.dumps({"tokens": len(out.outputs[0].token_ids),
                  "heavy": sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'triton'))}))
"""


def test_generate_without_importing_torch():
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["tokens"] >= 1
    assert report["heavy"] == [], f"runtime imported {report['heavy']}"
