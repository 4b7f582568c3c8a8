"""Text in and out: the tiktoken tokenizer (tokenizer.py), chat templates (chat.py, with the
built-in chat_template.jinja) and incremental detokenization (detokenizer.py)."""
