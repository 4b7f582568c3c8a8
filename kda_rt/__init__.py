"""kda_rt: a torch-free inference runtime for Kimi Linear (KDA + MLA + MoE) checkpoints.

    from kda_rt import LLM, SamplingParams
"""

from __future__ import annotations

from kda_rt.llm import LLM
from kda_rt.outputs import CompletionOutput, RequestOutput
from kda_rt.sampler.params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"
