"""Build the demo checkpoint's tiny tokenizer: 768 byte-level BPE tokens + 256 Kimi-style specials.

    python -m kda_rt.demo.make_vocab [--out DIR]      # default DIR = this package

Training is plain greedy BPE, deterministic: split SAMPLE_TEXT with the Kimi pre-tokenizer
regex (kda_rt.text.tokenizer.PAT_STR), start from the 256 single bytes (ranks 0..255), then
repeatedly merge the adjacent pair with the highest count (ties: the smaller concatenated
bytes) until 768 tokens exist.  The special ids copy Kimi's layout shifted from 163584 to 768,
so the demo vocabulary is 1024 ids.
"""

from __future__ import annotations

import argparse
import base64
import json
from collections import Counter
from itertools import pairwise
from pathlib import Path

import regex

from kda_rt.text.tokenizer import PAT_STR

__all__ = ["NUM_MERGEABLE", "SAMPLE_TEXT", "SPECIAL_TOKENS", "main", "rank_file_text", "tokenizer_config", "train_bpe"]

NUM_MERGEABLE = 768

# Kimi id - 163584 + 768 (spec §7.4); the unnamed slots get <|reserved_token_{id}|> at load time.
SPECIAL_TOKENS = {
    768: "[BOS]", 769: "[EOS]", 770: "<|im_end|>", 771: "<|im_user|>", 772: "<|im_assistant|>",
    774: "<|start_header_id|>", 775: "<|end_header_id|>", 777: "[EOT]", 778: "<|im_system|>",
    779: "<|tool_calls_section_begin|>", 780: "<|tool_calls_section_end|>", 781: "<|tool_call_begin|>",
    782: "<|tool_call_argument_begin|>", 783: "<|tool_call_end|>", 785: "<|im_middle|>",
    1022: "[UNK]", 1023: "[PAD]",
}

SAMPLE_TEXT = """\
You are a helpful assistant provided by Moonshot-AI. The user asks a question and the assistant
answers it. The system message sets the rules of the conversation, and the tool messages carry
the results of function calls back to the model.

The little lighthouse keeper woke before the sun every morning. She climbed the stairs, counted
them out loud, one hundred and twenty-three, and wiped the salt from the great glass lens. Then
she wrote in her notebook: the wind, the waves, the ships that passed, and the birds that rested
on the railing. In the evening she lit the lamp and watched the beam sweep over the water.

Is 123 a prime? No: 123 = 3 * 41. Is 127 a prime? Yes, it is. The first primes are 2, 3, 5, 7,
11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83, 89 and 97.
In 2024 the team trained a model with 48 billion parameters; only 3 billion are active per token.

def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)

for i in range(10):
    print(i, fibonacci(i))

{"name": "get_weather", "description": "Get the current weather in a city", "parameters":
{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}

A linear attention layer keeps a fixed-size state instead of a growing cache. Each new token
updates the state with a gated delta rule: the old memory decays, the key reads what is stored,
and the value writes the correction. The state never grows, so long contexts stay cheap. Every
fourth layer uses full attention over a compressed latent cache, which helps with recall.

Recipe for a simple tomato soup. Chop two onions and three cloves of garlic. Warm some olive oil
in a large pot, add the onions, and cook them slowly until they are soft and golden. Add the
garlic, then the tomatoes, a little water, salt and pepper. Let it simmer for twenty minutes,
blend it until smooth, and serve it warm with bread. It tastes even better the next day.

Questions people often ask: What time is it? Where is the station? How do I get there? Why is
the sky blue? Because the air scatters blue light more than red light. When will the train
arrive? It should arrive at 10:45, but it is running a few minutes late today.

The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX JUMPS OVER THE LAZY DOG.
Don't worry, we'll see; they're here, I'm sure it's fine, you've done well, she'd agree.

Café, naïve, résumé, façade, jalapeño, Ångström, über, Straße, smörgåsbord, crème brûlée.
Привет, мир! Как дела? Всё хорошо, спасибо. Сегодня хорошая погода.
你好，世界！今天天气很好。我们一起去公园散步吧。机器学习是人工智能的一个分支。
こんにちは、世界。今日はいい天気ですね。ありがとうございます。
안녕하세요, 세계! 오늘 날씨가 좋네요. 감사합니다.
Emoji: 🙂 😀 🚀 🌍 ❤️ 👍 🎉 ✨ 🔥 🤖 — and some symbols: € £ ¥ © ® ™ ° ± × ÷ → ← ≤ ≥ ≠ ∞.

Good morning! Thank you very much. Please let me know if you have any other questions.
I hope this helps. Here is a short summary of the main points, followed by an example.
First, read the problem carefully. Second, write down what you know. Third, check the answer.
"""


def train_bpe(text: str, num_tokens: int) -> list[bytes]:
    """Token bytes in rank order: 256 single bytes, then greedy merges up to num_tokens."""
    counts = Counter(regex.findall(PAT_STR, text, flags=regex.V1))
    words = [([bytes([b]) for b in piece.encode("utf-8")], n) for piece, n in counts.items()]
    vocab = [bytes([b]) for b in range(256)]
    known = set(vocab)
    while len(vocab) < num_tokens:
        pairs: Counter[tuple[bytes, bytes]] = Counter()
        for symbols, n in words:
            for pair in pairwise(symbols):
                pairs[pair] += n
        if not pairs:
            raise RuntimeError(f"sample text supports only {len(vocab)} tokens, need {num_tokens}")
        left, right = min(pairs, key=lambda p: (-pairs[p], p[0] + p[1], p[0]))
        merged = left + right
        if merged not in known:  # another split of the same bytes may already have produced it
            known.add(merged)
            vocab.append(merged)
        for symbols, _ in words:
            i = 0
            while i < len(symbols) - 1:
                if symbols[i] == left and symbols[i + 1] == right:
                    symbols[i:i + 2] = [merged]
                i += 1
    return vocab


def rank_file_text(vocab: list[bytes]) -> str:
    """Kimi `tiktoken.model` format: `<base64 bytes> <rank>` per line."""
    return "".join(f"{base64.b64encode(token).decode('ascii')} {rank}\n" for rank, token in enumerate(vocab))


def tokenizer_config() -> dict:
    """`tokenizer_config.json` with Kimi's special-token layout shifted to start at 768."""
    return {
        "added_tokens_decoder": {str(i): {"content": name, "special": True} for i, name in SPECIAL_TOKENS.items()},
        "bos_token": "[BOS]",
        "eos_token": "<|im_end|>",
        "pad_token": "[PAD]",
        "unk_token": "[UNK]",
        "model_max_length": 4096,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent, help="output directory")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tiktoken.model").write_text(rank_file_text(train_bpe(SAMPLE_TEXT, NUM_MERGEABLE)), encoding="ascii")
    config = json.dumps(tokenizer_config(), indent=2, ensure_ascii=False) + "\n"
    (args.out / "tokenizer_config.json").write_text(config, encoding="utf-8")
    print(f"wrote {args.out / 'tiktoken.model'} ({NUM_MERGEABLE} tokens) and tokenizer_config.json")


if __name__ == "__main__":
    main()
