"""Loading errors name the file and the line or field (TokenizerError is a ValueError)."""

from __future__ import annotations

import json

import pytest

from kda_rt.text.tokenizer import Tokenizer, TokenizerError, load_rank_file


def _set_rank_lines(model_dir, edit):
    path = model_dir / "tiktoken.model"
    lines = path.read_text().splitlines()
    edit(lines)
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize(("edit", "match"), [
    (lambda lines: lines.__setitem__(2, "Ag=="), r"tiktoken\.model:3: expected '<base64> <rank>'"),
    (lambda lines: lines.__setitem__(2, "Ag== two"), r"tiktoken\.model:3: expected"),
    (lambda lines: lines.__setitem__(2, "A*g== 2"), r"tiktoken\.model:3: invalid base64"),
    (lambda lines: lines.__setitem__(2, "Ag= 2"), r"tiktoken\.model:3: invalid base64"),
    (lambda lines: lines.__setitem__(2, "IGZvbw== 1"), r"tiktoken\.model:3: duplicate rank 1 \(first on line 2\)"),
    (lambda lines: lines.__setitem__(2, "AA== 2"), r"tiktoken\.model:3: duplicate token"),
    (lambda lines: lines.pop(5), r"rank 5 is missing"),
    (lambda lines: lines.clear(), "no tokens"),
    (lambda lines: lines.__setitem__(2, "Ag== " + "9" * 5000), r"tiktoken\.model:3: expected"),  # issue 10 #11
    # a truncated file: its ranks are whole, so the specials' ids are what no longer fits (named with the cause)
    (lambda lines: lines.__delitem__(slice(100, None)), r"follows tiktoken\.model's 100 ranks \(is that file complete"),
], ids=["one-field", "rank-not-int", "bad-char", "bad-padding", "dup-rank", "dup-token",
        "gap", "empty", "5000-digit-rank", "truncated"])
def test_bad_rank_file(model_dir, edit, match):
    _set_rank_lines(model_dir, edit)
    with pytest.raises(TokenizerError, match=match):
        Tokenizer.from_dir(model_dir)


def test_missing_files(model_dir, tmp_path):
    (model_dir / "tokenizer_config.json").unlink()
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: cannot read"):
        Tokenizer.from_dir(model_dir)
    with pytest.raises(TokenizerError, match=r"tiktoken\.model: cannot read"):
        Tokenizer.from_dir(tmp_path / "nowhere")
    with pytest.raises(TokenizerError, match="cannot read"):
        load_rank_file(tmp_path / "nowhere" / "tiktoken.model")


def _write_config(model_dir, edit):
    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(("edit", "match"), [
    (lambda c: c["added_tokens_decoder"].__setitem__("700", {"content": "<|x|>"}), r"\['700'\]: id outside"),
    (lambda c: c["added_tokens_decoder"].__setitem__("1024", {"content": "<|x|>"}), r"\['1024'\]: id outside"),
    (lambda c: c["added_tokens_decoder"].__setitem__("abc", {"content": "<|x|>"}), r"\['abc'\]: key must be"),
    (lambda c: c["added_tokens_decoder"].__setitem__("800", {}), r"\['800'\]: needs a non-empty string 'content'"),
    (lambda c: c["added_tokens_decoder"].__setitem__("800", {"content": "[BOS]"}), "appears at ids 768 and 800"),
    (lambda c: c.__setitem__("added_tokens_decoder", []), "'added_tokens_decoder' must be an object"),
    (lambda c: c.__setitem__("eos_token", "<|nope|>"), "'eos_token' names '<|nope|>'"),
    (lambda c: c.__setitem__("bos_token", 5), "'bos_token' must be a string"),
    (lambda c: c.__setitem__("chat_template", 5), "'chat_template' must be"),
], ids=["id-below", "id-above", "id-not-int", "no-content", "dup-content", "decoder-list", "unknown-eos",
        "bos-int", "template-int"])
def test_bad_config(model_dir, edit, match):
    _write_config(model_dir, edit)
    with pytest.raises(TokenizerError, match=match):
        Tokenizer.from_dir(model_dir)


def test_bad_json(model_dir):
    (model_dir / "tokenizer_config.json").write_text('{\n  "bos_token": "[BOS]",\n  oops\n}')
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json:3:3: not valid JSON"):
        Tokenizer.from_dir(model_dir)
    (model_dir / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(TokenizerError, match="must be a JSON object"):
        Tokenizer.from_dir(model_dir)


def test_config_variants(model_dir):
    """AddedToken dicts for bos/eos, absent specials, and HF's list of named templates all load."""
    def edit(config):
        config["eos_token"] = {"content": "<|im_end|>", "special": True}
        config["bos_token"] = None
        config["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
        del config["added_tokens_decoder"]["769"]
    _write_config(model_dir, edit)
    tok = Tokenizer.from_dir(model_dir)
    assert (tok.bos_token_id, tok.eos_token_id, tok.stop_token_ids) == (None, 770, (770,))
    assert tok.token_to_id("<|reserved_token_769|>") == 769
    assert tok.apply_chat_template([]) == "D"



def test_pad_and_unk_outside_the_specials_are_dropped(model_dir):
    """pad_token / unk_token serve only the Hugging Face calls (text/hf_surface.py): a config naming one that is not
    a special token (an SPM-style "<unk>") loads, with that token None, where bos / eos are refused (test_bad_config)."""
    def edit(config):
        config["unk_token"] = "<unk>"
        config["pad_token"] = {"content": "<pad>"}
    _write_config(model_dir, edit)
    tok = Tokenizer.from_dir(model_dir)
    assert (tok.unk_token, tok.unk_token_id, tok.pad_token, tok.pad_token_id) == (None, None, None, None)
    assert tok.eos_token_id == 770

if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
