"""kda_rt: a torch-free inference runtime for Kimi Linear (KDA + MLA + MoE) checkpoints."""

from __future__ import annotations
