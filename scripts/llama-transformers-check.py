#!/usr/bin/env python3
"""Checks that Hugging Face transformers loads a model directory written by `accel_llama` and computes what
accel_llama computed with it.

What it proves, for a directory DIR that `accel_llama --output-dir DIR` saved (config.json, model.safetensors or
shards with model.safetensors.index.json, tokenizer.json, tokenizer_config.json):

  1. load: `AutoTokenizer.from_pretrained(DIR)` and `AutoModelForCausalLM.from_pretrained(DIR, dtype=float32,
     attn_implementation="eager", output_loading_info=True)` load it with no missing, unexpected or mismatched key
     (and no loading error); the tokenizer's bos/eos/pad tokens are those of tokenizer_config.json and its bos/eos
     ids those of config.json.
  2. tokenizer: the AutoTokenizer's ids for --text equal the `tokenizers` library's ids from DIR/tokenizer.json
     (what accel_llama tokenizes with), both without special tokens.
  3. validation loss: transformers' loss on accel_llama's validation batches — the last 5 % of the text's ids
     (cut = len * 95 // 100), non-overlapping windows of --seq-len tokens (inputs ids[i*s : i*s+s], targets one
     token further), batches of --batch-size consecutive windows, the first min(--eval-batches, windows //
     batch) batches, each batch's mean token cross-entropy averaged over the batches (model.eval(), no_grad) —
     equals --expect (the `validation loss X` accel_llama printed) within --tol, relative: it fails when
     |ours - transformers| > tol * |ours|. accel_llama prints 6 decimals; the default 1e-4 is ~6e-4 absolute at a
     loss of 6, far above float32 noise and far below any real disagreement.
  4. greedy sample (with --generate PROMPT): transformers' greedy continuation of PROMPT (tokenized without special
     tokens): `generate(max_new_tokens=N, min_new_tokens=N, do_sample=False)` with eos switched off, as accel_llama
     decodes (it never stops at eos), the prompt plus N ids decoded without skipping special tokens; it is also
     recomputed by a plain argmax loop over full forwards (no KV cache) and must agree with it. With
     --expect-sample FILE (the sample text exactly) or --expect-sample-log LOG (accel_llama's stdout: the text after
     its `greedy sample:` line, `[rank 0] ` launcher prefixes removed) the decoded text must equal accel_llama's.

It exits 1 on any failed check (every check runs; each failure is printed as `FAIL: ...`), and ends with one line:

    transformers loads DIR: validation loss ours X, transformers Y, |Δ| Z; greedy sample equal: yes|no

Warnings that transformers logs or raises while loading, tokenizing or generating are printed
(`transformers warning: ...`), never hidden. `scripts/llama-transformers-check.sh` runs accel_llama and then this.

Run (from the repository root; needs torch, transformers and tokenizers; CPU, no network):

    python3 scripts/llama-transformers-check.py runs/accel_llama --expect 6.1409
    python3 scripts/llama-transformers-check.py runs/accel_llama --generate "ROMEO:" --tokens 40 \\
        --expect-sample-log accel_llama.log
"""

import argparse
import json
import logging
import math
import os
import sys
import warnings

import tokenizers
import torch
import torch.nn.functional as F
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

DEFAULT_TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "shakespeare",
                            "shakespeare8.txt")


class Collect(logging.Handler):
    """Keeps what transformers logs at WARNING and above."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(f"{record.name}: {record.getMessage()}")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="See the module docstring (the top of this file) for what each check proves.")
    p.add_argument("model_dir", help="a directory written by accel_llama --output-dir")
    p.add_argument("--text", default=os.path.normpath(DEFAULT_TEXT),
                   help="the text accel_llama trained on (default: data/shakespeare/shakespeare8.txt)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per validation window (accel_llama's --seq-len)")
    p.add_argument("--batch-size", type=int, default=8, help="windows per validation batch (accel_llama's --batch-size)")
    p.add_argument("--eval-batches", type=int, default=8, help="validation batches (accel_llama's --eval-batches)")
    p.add_argument("--expect", type=float, help="accel_llama's printed validation loss: fail when transformers' differs")
    p.add_argument("--tol", type=float, default=1e-4,
                   help="relative tolerance of --expect: fail when |ours - transformers| > tol * |ours| (default 1e-4)")
    p.add_argument("--generate", metavar="PROMPT", help="also print transformers' greedy continuation of PROMPT")
    p.add_argument("--tokens", type=int, default=40, help="new tokens for --generate (accel_llama's --sample-tokens)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--expect-sample", metavar="FILE", help="a file holding accel_llama's greedy sample text exactly")
    g.add_argument("--expect-sample-log", metavar="LOG",
                   help="accel_llama's stdout: its greedy sample is the text after the `greedy sample:` line")
    args = p.parse_args(argv)
    if (args.expect_sample or args.expect_sample_log) and args.generate is None:
        p.error("--expect-sample/--expect-sample-log need --generate PROMPT")
    for flag in ("seq_len", "batch_size", "eval_batches"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.tokens < 1:
        p.error("--tokens must be at least 1")
    return args


def sample_from_log(path):
    """accel_llama's greedy sample in its stdout LOG: the lines after `greedy sample:` up to the end (the text then
    println's newline). Under the launcher every line is `[rank R] `-prefixed: rank 0's prefix is removed and other
    ranks' lines dropped. None when the log has no sample (accel_llama prints none under pp > 1)."""
    with open(path, encoding="utf-8") as f:
        out = f.read()
    lines = out.split("\n")
    if out.endswith("\n"):
        lines.pop()  # the final newline ends the last line, it is not an empty line
    prefixed = bool(lines) and lines[0].startswith("[rank ")
    if prefixed:
        lines = [l[len("[rank 0] "):] for l in lines if l.startswith("[rank 0] ")]
    try:
        start = lines.index("greedy sample:")
    except ValueError:
        return None
    return "\n".join(lines[start + 1:])


def validation_batches(ids, seq_len, batch_size, eval_batches):
    """accel_llama's validation batches: (inputs, targets) LongTensors [batch_size, seq_len] each."""
    cut = len(ids) * 95 // 100
    val = ids[cut:]
    s = seq_len
    windows = 0 if len(val) <= s else (len(val) - s - 1) // s + 1
    n = min(eval_batches, windows // batch_size)
    out = []
    for b in range(n):
        rows = range(b * batch_size, (b + 1) * batch_size)
        x = torch.tensor([val[i * s:i * s + s] for i in rows], dtype=torch.long)
        y = torch.tensor([val[i * s + 1:i * s + s + 1] for i in rows], dtype=torch.long)
        out.append((x, y))
    return out, len(val), windows


def main():
    args = parse_args()
    failures = []

    def fail(msg):
        failures.append(msg)
        print(f"FAIL: {msg}", flush=True)

    transformers.utils.logging.disable_progress_bar()
    collect = Collect()
    logging.getLogger("transformers").addHandler(collect)
    warnings.simplefilter("always")
    caught = []
    shown = warnings.showwarning
    warnings.showwarning = lambda message, category, *rest, **kw: caught.append(f"{category.__name__}: {message}")

    def report_warnings(stage):
        for m in collect.messages + caught:
            print(f"transformers warning ({stage}): {m}", flush=True)
        collect.messages.clear()
        caught.clear()

    d = args.model_dir
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, tokenizers {tokenizers.__version__}")

    # 1. Load.
    try:
        tok = AutoTokenizer.from_pretrained(d)
    except Exception as e:  # no tokenizer.json, or one the backend cannot read
        report_warnings("load")
        print(f"FAIL: AutoTokenizer.from_pretrained({d}) raised {type(e).__name__}: {e}")
        return 1
    try:
        model, info = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager",
                                                           output_loading_info=True)
    except Exception as e:  # a shape mismatch or an unreadable file raises
        report_warnings("load")
        print(f"FAIL: AutoModelForCausalLM.from_pretrained({d}) raised {type(e).__name__}: {e}")
        return 1
    report_warnings("load")
    bad = {k: sorted(map(str, v)) for k, v in info.items() if v}
    if bad:
        print(f"FAIL: loading {d}: {json.dumps(bad)}")
        return 1
    print(f"loaded {d}: {type(model).__name__} ({sum(p.numel() for p in model.parameters())} parameters, "
          f"{model.config.num_hidden_layers} layers, vocabulary {model.config.vocab_size}), tokenizer "
          f"{type(tok).__name__}: no missing, unexpected or mismatched key")
    tok_config_path = os.path.join(d, "tokenizer_config.json")
    if os.path.isfile(tok_config_path):
        with open(tok_config_path, encoding="utf-8") as f:
            tok_config = json.load(f)
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            want = tok_config.get(name)
            if isinstance(want, dict):
                want = want.get("content")
            if want is not None and getattr(tok, name) != want:
                fail(f"tokenizer_config.json's {name} is {want!r}, AutoTokenizer's {getattr(tok, name)!r}")
    else:
        fail(f"{d} has no tokenizer_config.json")
    for name in ("bos_token_id", "eos_token_id"):
        ours = getattr(model.config, name)
        if ours is not None and getattr(tok, name) != ours:
            fail(f"config.json's {name} is {ours}, the tokenizer's {getattr(tok, name)} ({getattr(tok, name[:-3])!r})")
    print(f"special tokens: bos {tok.bos_token!r}={tok.bos_token_id}, eos {tok.eos_token!r}={tok.eos_token_id}, "
          f"pad {tok.pad_token!r}={tok.pad_token_id} (config.json: bos {model.config.bos_token_id}, eos "
          f"{model.config.eos_token_id}, pad {model.config.pad_token_id})")

    # 2. Tokenizer: AutoTokenizer against the tokenizers library (accel_llama's), both without special tokens.
    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    raw = tokenizers.Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
    ids_raw = raw.encode(text, add_special_tokens=False).ids
    ids = tok.encode(text, add_special_tokens=False)
    report_warnings("tokenize")
    if ids != ids_raw:
        first = next((i for i, (a, b) in enumerate(zip(ids, ids_raw)) if a != b), min(len(ids), len(ids_raw)))
        fail(f"AutoTokenizer's ids for {args.text} differ from tokenizer.json's: {len(ids)} vs {len(ids_raw)} ids, "
             f"first difference at {first}")
    else:
        print(f"tokenizer: AutoTokenizer's {len(ids)} ids for {args.text} equal tokenizer.json's (tokenizers library)")

    # 3. Validation loss, with the AutoTokenizer's ids (transformers' side throughout).
    batches, n_val, windows = validation_batches(ids, args.seq_len, args.batch_size, args.eval_batches)
    model.eval()
    theirs = None
    if not batches:
        fail(f"the validation ids ({n_val}) hold no batch of {args.batch_size} windows of {args.seq_len} tokens")
    else:
        losses = []
        with torch.no_grad():
            for x, y in batches:
                logits = model(input_ids=x).logits
                losses.append(F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1)).item())
        theirs = sum(losses) / len(losses)
        print(f"transformers validation loss {theirs:.6f} (perplexity {math.exp(theirs):.2f}) over {len(batches)} "
              f"batches of {args.batch_size} x {args.seq_len} tokens ({n_val} validation ids, {windows} windows)")
    report_warnings("forward")
    delta = None
    if args.expect is not None and theirs is not None:
        delta = abs(args.expect - theirs)
        ok = delta <= args.tol * abs(args.expect)
        print(f"validation loss: ours {args.expect:.6f}, transformers {theirs:.6f}, |Δ| {delta:.2e} "
              f"({'within' if ok else 'OVER'} the relative tolerance {args.tol:g}: {args.tol * abs(args.expect):.2e})")
        if not ok:
            fail(f"validation loss ours {args.expect} vs transformers {theirs:.6f}: |Δ| {delta:.2e} > "
                 f"{args.tol:g} x {abs(args.expect):g}")

    # 4. Greedy sample.
    sample_equal = None
    if args.generate is not None:
        prompt = tok.encode(args.generate, add_special_tokens=False)
        if prompt != raw.encode(args.generate, add_special_tokens=False).ids:
            fail(f"AutoTokenizer's ids for the prompt {args.generate!r} differ from tokenizer.json's")
        if not prompt:
            fail(f"the prompt {args.generate!r} has no tokens")
        else:
            x = torch.tensor([prompt], dtype=torch.long)
            gen_eos = model.generation_config.eos_token_id
            model.generation_config.eos_token_id = None  # accel_llama never stops at eos: for this call only
            try:
                with torch.no_grad():
                    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=args.tokens,
                                         min_new_tokens=args.tokens, do_sample=False, eos_token_id=None,
                                         pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 0)
            finally:
                model.generation_config.eos_token_id = gen_eos
            report_warnings("generate")
            # The same ids by an argmax loop over full forwards, so the check doesn't lean on generate's cache.
            loop = x
            with torch.no_grad():
                for _ in range(args.tokens):
                    nxt = model(input_ids=loop).logits[:, -1].argmax(-1, keepdim=True)
                    loop = torch.cat([loop, nxt], dim=1)
            if not torch.equal(out, loop):
                fail(f"generate's greedy ids {out[0].tolist()} differ from an argmax loop's {loop[0].tolist()}")
            gen_ids = out[0].tolist()
            sample = tok.decode(gen_ids, skip_special_tokens=False)
            raw_sample = raw.decode(gen_ids, skip_special_tokens=False)
            if sample != raw_sample:
                fail(f"AutoTokenizer decodes the sample as {sample!r}, tokenizer.json as {raw_sample!r}")
            print(f"transformers greedy sample ({len(prompt)} prompt + {args.tokens} ids {gen_ids[len(prompt):]}):")
            print(sample)
            expected = None
            if args.expect_sample:
                with open(args.expect_sample, encoding="utf-8") as f:
                    expected = f.read()
            elif args.expect_sample_log:
                expected = sample_from_log(args.expect_sample_log)
                if expected is None:
                    fail(f"{args.expect_sample_log} has no `greedy sample:` line")
            if expected is not None:
                sample_equal = sample == expected
                if sample_equal:
                    print(f"greedy sample: equal to accel_llama's ({len(sample)} characters)")
                else:
                    fail(f"greedy sample differs: accel_llama {expected!r}, transformers {sample!r}")
    report_warnings("end")
    warnings.showwarning = shown

    parts = [f"transformers loads {d}: validation loss "]
    if args.expect is not None:
        parts.append(f"ours {args.expect:.6f}, ")
    parts.append(f"transformers {theirs:.6f}" if theirs is not None else "transformers none")
    if delta is not None:
        parts.append(f", |Δ| {delta:.1e}")
    parts.append("; greedy sample equal: " + {True: "yes", False: "no", None: "not checked"}[sample_equal])
    print("".join(parts))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
