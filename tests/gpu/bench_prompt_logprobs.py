"""Time `LLM.prompt_logprobs` on a Kimi-Linear-48B-shaped random checkpoint (few layers: the lm_head and vocabulary
are the full model's, 163,840 tokens) against the path before the sixty-fifth session: `LLM.score` (the prompt's
[T, vocab] float32 logits to the host) and the row-by-row float64 host loop.  One JSON line per prompt length.

    PYTHONPATH=. python tests/gpu/bench_prompt_logprobs.py CKPT_DIR [--lengths 512,2048] [--num 5]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def host_loop(logits: np.ndarray, ids: list[int], num: int) -> None:
    for i in range(1, len(ids)):  # (the earlier LLM.prompt_logprobs body)
        row = logits[i - 1].astype(np.float64)
        lp = row - row.max()
        lp -= np.log(np.exp(lp).sum())
        top = np.argpartition(-lp, num - 1)[:num]
        top[np.argsort(-lp[top], kind="stable")]
        int((lp > lp[ids[i]]).sum())


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--lengths", default="512,2048")
    ap.add_argument("--num", type=int, default=5)
    args = ap.parse_args()
    from kda_rt import LLM

    llm = LLM(args.ckpt, backend="cuda", max_num_seqs=2, max_model_len=8192, enable_prefix_caching=False)
    rng = np.random.default_rng(0)
    for T in (int(t) for t in args.lengths.split(",")):
        ids = rng.integers(3, 150000, T).tolist()
        llm.prompt_logprobs({"prompt_token_ids": ids}, args.num)  # warm-up (kernel builds, buffers)
        t0 = time.perf_counter()
        llm.prompt_logprobs({"prompt_token_ids": ids}, args.num)
        new = time.perf_counter() - t0
        t0 = time.perf_counter()
        logits = llm.score(ids)
        score = time.perf_counter() - t0
        t0 = time.perf_counter()
        host_loop(logits, ids, args.num)
        loop = time.perf_counter() - t0
        print(json.dumps({"tokens": T, "num": args.num, "new_s": round(new, 4), "old_score_s": round(score, 4),
                          "old_host_loop_s": round(loop, 4), "old_total_s": round(score + loop, 4)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
