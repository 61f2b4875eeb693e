#!/usr/bin/env python3
"""Trains the byte-level BPE tokenizer of the Llama examples (GPT-2's and Llama 3's kind of tokenizer) on
data/shakespeare/shakespeare8.txt and writes data/shakespeare/tokenizer.json, in the `tokenizers` format that
Hugging Face's `tokenizers` (Rust and Python) and transformers' `PreTrainedTokenizerFast` read.

Vocabulary: 2048 ids — three special tokens first, `<s>` (0, bos), `</s>` (1, eos), `<pad>` (2), then the 256
byte symbols and the merges. The text is split GPT-2's way (ByteLevel pre-tokenizer, no added prefix space) and
decodes back byte for byte (asserted).

Rerun from the repository root (needs the Python `tokenizers` package; deterministic for one version of it):
    python3 scripts/train-tokenizer.py
"""

import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

TEXT = "data/shakespeare/shakespeare8.txt"
OUT = "data/shakespeare/tokenizer.json"
VOCAB = 2048
SPECIAL = ["<s>", "</s>", "<pad>"]

tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(
    vocab_size=VOCAB,
    special_tokens=SPECIAL,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
)
tok.train([TEXT], trainer)
tok.save(OUT)

text = open(TEXT, encoding="utf-8").read()
ids = tok.encode(text).ids
assert tok.decode(ids) == text, "byte-level BPE must decode to the text it encoded"
print(f"{OUT}: vocabulary {tok.get_vocab_size()}, {len(text)} characters -> {len(ids)} tokens "
      f"({len(text) / len(ids):.2f} characters per token), tokenizers {tokenizers.__version__}")
