"""Text and token ids: the tokenizers (SentencePiece, tokenizer.json), chat templates and stop strings."""
