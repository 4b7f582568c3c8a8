"""Whole-model parity with transformers' native `KimiLinearForCausalLM` (pure-torch CPU path, fp32).

Tiny random checkpoints in the hub layout (config.json + safetensors) are loaded by both sides:
transformers via `from_pretrained` (its own key conversion, no trust_remote_code) and kda_rt via
`load_config` + `load_checkpoint`.  For each layer schedule / MoE variant:

  (a) prefill logits of a 150-token prompt (crosses the 64-token KDA chunk boundaries) agree,
      max|ours − ref| / max|ref| ≤ 1e-4, at every position;
  (b) 16 greedy decode steps, one token each, through transformers' cache and our pools (paged
      MLA with a shuffled block table, KDA state slot): the logits agree at every step;
  (c) the greedy tokens are identical.

kda_rt also runs the prompt in two chunks and next to a second sequence in the same varlen batch,
so chunked prefill and batching are checked against the same reference.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest

from helpers.configs import tiny_config
from kda_rt.engine.batch import ForwardBatch
from kda_rt.loader.config import load_config
from kda_rt.loader.weights import load_checkpoint
from kda_rt.random_checkpoint import write_random_checkpoint
from kda_rt.reference.kimi_linear import KimiLinearModel, make_pools

pytestmark = pytest.mark.parity
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if importlib.util.find_spec("fla") is not None:
    pytest.skip("fla is installed: transformers would pick its GPU kernels, not the torch path", allow_module_level=True)

PROMPT, DECODE, BLOCK = 150, 16, 16
TOL = 1e-4


def _lac(kinds: str) -> dict:
    """linear_attn_config for a schedule string such as 'kkmk' (k = KDA, m = MLA), 1-based lists."""
    return {"num_heads": 2, "head_dim": 32, "short_conv_kernel_size": 4,
            "kda_layers": [i + 1 for i, c in enumerate(kinds) if c == "k"],
            "full_attn_layers": [i + 1 for i, c in enumerate(kinds) if c == "m"]}


CASES = {
    "kkmk-dense0-G1": {},
    "mk-allmoe-G4top2": dict(num_hidden_layers=2, linear_attn_config=_lac("mk"), first_k_dense_replace=0,
                             num_experts=8, num_experts_per_token=3, num_expert_group=4, topk_group=2),
    "kmm-dense0-G2top1-2shared": dict(num_hidden_layers=3, linear_attn_config=_lac("kmm"), num_experts=8,
                                      num_experts_per_token=2, num_expert_group=2, topk_group=1, num_shared_experts=2),
    "kkm-dense01-norenorm": dict(num_hidden_layers=3, linear_attn_config=_lac("kkm"), first_k_dense_replace=2,
                                 moe_renormalize=False, routed_scaling_factor=1.5),
}


def rel_err(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(ours - ref)) / np.max(np.abs(ref)))


@pytest.fixture(scope="module", params=list(CASES))
def models(request, tmp_path_factory):
    path = write_random_checkpoint(tiny_config(**CASES[request.param]), tmp_path_factory.mktemp(request.param), seed=7)
    torch.manual_seed(0)
    ref = transformers.KimiLinearForCausalLM.from_pretrained(
        path, dtype=torch.float32, experts_implementation="eager", attn_implementation="eager"
    ).eval()
    config = load_config(path)
    ours = KimiLinearModel(config, load_checkpoint(path, config), np.float32)
    return ref, ours


class _Seq:
    """Our side of one sequence: a state slot, a shuffled page list and the tokens folded in so far."""

    def __init__(self, slot: int, pages: list[int]) -> None:
        self.slot, self.pages, self.done = slot, pages, 0


def _step(model: KimiLinearModel, pools, seqs: list[_Seq], chunks: list[list[int]], all_logits: bool = False) -> np.ndarray:
    batch = ForwardBatch.build(chunks, [s.done for s in seqs], [s.slot for s in seqs], [s.pages for s in seqs],
                               all_logits=all_logits)
    logits = model.forward(batch, *pools)
    for s, c in zip(seqs, chunks, strict=True):
        s.done += len(c)
    return logits


@pytest.mark.slow
def test_prefill_then_greedy_decode(models) -> None:
    ref, ours = models
    vocab = ours.config.vocab_size
    rng = np.random.default_rng(11)
    prompt = rng.integers(0, vocab, PROMPT).tolist()
    other = rng.integers(0, vocab, 37).tolist()  # a second sequence sharing our batches

    with torch.no_grad():
        out = ref(input_ids=torch.tensor([prompt]), use_cache=True)
    ref_logits, cache = out.logits[0].numpy(), out.cache

    pages_per_seq = -(-(PROMPT + DECODE) // BLOCK)
    pages = rng.permutation(2 * pages_per_seq + 3).tolist()
    pools = make_pools(ours.config, num_slots=3, num_blocks=len(pages), block_size=BLOCK)
    seq, seq_b = _Seq(2, pages[:pages_per_seq]), _Seq(0, pages[pages_per_seq:2 * pages_per_seq])
    # (a) prefill in two chunks; chunk 1 shares the batch with another sequence's prefill
    first = _step(ours, pools, [seq_b, seq], [other, prompt[:100]], all_logits=True)
    second = _step(ours, pools, [seq], [prompt[100:]], all_logits=True)
    ours_logits = np.concatenate([first[len(other):], second])
    err = rel_err(ours_logits, ref_logits)
    assert err <= TOL, f"prefill logits rel err {err:.2e}"

    # (b) + (c) greedy decode, one token per step; seq_b keeps decoding in the same batch
    tok_ref = tok_ours = int(np.argmax(ref_logits[-1]))
    assert tok_ours == int(np.argmax(ours_logits[-1]))
    errs = []
    for step in range(DECODE):
        with torch.no_grad():
            out = ref(input_ids=torch.tensor([[tok_ref]]), cache=cache, use_cache=True)
        ref_step, cache = out.logits[0, -1].numpy(), out.cache
        ours_step = _step(ours, pools, [seq, seq_b], [[tok_ours], [step % vocab]])[0]
        errs.append(rel_err(ours_step, ref_step))
        tok_ref, tok_ours = int(np.argmax(ref_step)), int(np.argmax(ours_step))
        assert tok_ours == tok_ref, f"greedy token differs at decode step {step}"
    assert max(errs) <= TOL, f"decode logits rel err per step: {[f'{e:.1e}' for e in errs]}"


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q", "-s"]))
