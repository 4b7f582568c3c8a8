"""kda_rt: a torch-free inference runtime for Kimi Linear (KDA + MLA + MoE) checkpoints.

    from kda_rt import LLM, SamplingParams
"""

from __future__ import annotations

import os as _os

# loader/ and sampler/ sit beside kda_rt/ in the source tree and install as kda_rt.loader and
# kda_rt.sampler (setup.cfg package_dir).  When kda_rt is imported straight from a checkout (the
# current directory shadows the installed copy, or an editable-install finder that does not map
# subpackages), let the import system find them there: our own directory stays first in __path__.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_checkout, "setup.cfg")) and _os.path.isdir(_os.path.join(_checkout, "loader")):
    __path__.append(_checkout)

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob",
           "BeamSearchParams", "BeamSearchOutput", "AsyncLLM", "LLMEngine"]
_LAZY = {"LLM": "kda_rt.llm", "SamplingParams": "kda_rt.sampler.params",
         "StructuredOutputsParams": "kda_rt.sampler.params",
         "RequestOutput": "kda_rt.outputs", "CompletionOutput": "kda_rt.outputs", "Logprob": "kda_rt.outputs",
         "BeamSearchParams": "kda_rt.beam_search", "BeamSearchOutput": "kda_rt.beam_search",
         "AsyncLLM": "kda_rt.async_llm", "LLMEngine": "kda_rt.engine.llm_engine"}


def __getattr__(name: str):
    """Import the public API on first use, so `import kda_rt.cuda.ops...` stays light."""
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kda_rt' has no attribute {name!r}")
__version__ = "0.1.0"
