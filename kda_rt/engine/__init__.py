"""The engine: requests in, outputs out, one model step at a time, over any backend's runner.

    config.py      EngineConfig: every runtime setting (and the CLI flags made from it)
    llm_engine.py  LLMEngine: add_request / step / abort / score
    scheduler.py   which sequences run this step (pure Python), pages and slots via allocator.py
    sequence.py    one sample of a request: tokens, status, slot, pages
    batch.py       ForwardBatch: what the model reads (sampler/batch.py: what the sampler reads)
    runner.py      the Runner contract both backends implement, and backend selection
    pools.py       cache-pool planning and max_model_len resolution
    postprocess.py accept tokens, detokenize, stop checks, RequestOutputs
"""

from kda_rt.engine.config import EngineConfig
from kda_rt.engine.llm_engine import LLMEngine

__all__ = ["EngineConfig", "LLMEngine"]
