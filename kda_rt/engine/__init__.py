"""The engine: requests in, outputs out, one model step at a time, over any backend's runner.

    llm_engine.py  LLMEngine (add_request / step / abort / score) and EngineConfig (the settings)
    scheduler.py   which sequences run this step (pure Python), pages and slots via allocator.py
    sequence.py    one sample of a request: tokens, status, slot, pages
    batch.py       ForwardBatch (what the model reads) and SamplingBatch (what the sampler reads)
    runner.py      the Runner contract both backends implement, and backend selection
    pools.py       cache-pool planning and max_model_len resolution
    postprocess.py accept tokens, detokenize, stop checks, RequestOutputs
"""

from kda_rt.engine.llm_engine import EngineConfig, LLMEngine

__all__ = ["EngineConfig", "LLMEngine"]
