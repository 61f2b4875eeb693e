#!/usr/bin/env python3
"""Reference fixture for the Llama implementation, made by Hugging Face transformers' LlamaForCausalLM.

What it makes (`make`): two small random Llama models, built offline on the CPU in float32 with eager attention,
each saved by transformers itself (`save_pretrained`: config.json, generation_config.json, model.safetensors, all
unchanged) beside a `reference.safetensors` holding what transformers computes with that model:

    input_ids   int64 [2, 8]             fixed token ids in [3, vocab)
    logits      f32   [2, 8, vocab]      model(input_ids).logits, train mode (every dropout is 0)
    loss        f32   [1]                model(input_ids, labels=input_ids).loss: transformers shifts the labels
                                         inside, so the mean cross-entropy over the 2 x 7 predicted positions
    grad.<name> f32   (parameter shape)  loss.backward() of that loss, one per parameter, <name> exactly as in
                                         model.safetensors (for a tied model the embedding's gradient includes the
                                         head's contribution and is named grad.model.embed_tokens.weight)
    prompt_ids  int64 [1, 4]             fixed prompt
    greedy_ids  int64 [1, 16]            model.generate(prompt_ids, max_new_tokens=12, min_new_tokens=12,
                                         do_sample=False) with eos switched off for that call

Models (torch.manual_seed(0) before each is built):
    gqa   4 layers, 4 query heads over 2 key/value heads, untied lm_head, default RoPE (theta 10000), eps 1e-6
    tied  2 layers, 4 heads (no grouping), lm_head tied to the embedding, RoPE theta 500000 with llama3 scaling
          (factor 8, low_freq_factor 0.125, high_freq_factor 4, original_max_position_embeddings 32: one frequency
          kept, one blended, two divided — every branch of the scaling), eps 1e-5

It also writes OUT_DIR/README.md (contents, configs, the versions that made it, its size).

`check DIR REFERENCE` loads a model directory written by someone else (our Rust code) with
LlamaForCausalLM.from_pretrained(DIR, attn_implementation="eager", float32), runs it on REFERENCE's input_ids and
compares with REFERENCE's logits: prints the max absolute difference, exits 1 when it is over --tol (1e-4).

Rerun (from the repository root; needs torch, transformers, safetensors, numpy — no network, no GPU):

    python3 scripts/llama-fixture.py make                        # -> crates/accel/tests/fixtures/llama
    python3 scripts/llama-fixture.py check crates/accel/tests/fixtures/llama/gqa \\
        crates/accel/tests/fixtures/llama/gqa/reference.safetensors
"""

import argparse
import copy
import hashlib
import math
import os
import sys

import numpy as np
import safetensors
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

DEFAULT_OUT = "crates/accel/tests/fixtures/llama"
BATCH, SEQ = 2, 8
PROMPT_LEN, NEW_TOKENS = 4, 12
INPUT_SEED, PROMPT_SEED = 1234, 5678
TRANSFORMERS_MAJOR = int(transformers.__version__.split(".")[0])

COMMON = dict(
    vocab_size=96,
    hidden_size=32,
    max_position_embeddings=64,
    initializer_range=0.1,
    attention_dropout=0.0,
    bos_token_id=1,
    eos_token_id=2,
    hidden_act="silu",
)

LLAMA3_SCALING = dict(
    rope_type="llama3",
    factor=8.0,
    low_freq_factor=0.125,
    high_freq_factor=4.0,
    original_max_position_embeddings=32,
)

# name -> (config kwargs, rope theta, rope scaling or None)
MODELS = {
    "gqa": (
        dict(intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             rms_norm_eps=1e-6, tie_word_embeddings=False),
        10000.0,
        None,
    ),
    "tied": (
        dict(intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
             rms_norm_eps=1e-5, tie_word_embeddings=True),
        500000.0,
        LLAMA3_SCALING,
    ),
}


def versions():
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
        "numpy": np.__version__,
    }


def rope_kwargs(theta, scaling):
    """RoPE settings in the form this transformers accepts: `rope_parameters` (5.x) or rope_theta/rope_scaling (4.x)."""
    if TRANSFORMERS_MAJOR >= 5:
        params = {"rope_type": "default", "rope_theta": theta}
        if scaling is not None:
            params = dict(scaling, rope_theta=theta)
        return {"rope_parameters": params}
    kw = {"rope_theta": theta}
    if scaling is not None:
        kw["rope_scaling"] = dict(scaling)
    return kw


def build_config(name):
    kwargs, theta, scaling = MODELS[name]
    cfg = LlamaConfig(**COMMON, **kwargs, **rope_kwargs(theta, scaling))
    cfg._attn_implementation = "eager"
    return cfg


def build_model(name):
    cfg = build_config(name)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.config._attn_implementation = "eager"
    # transformers starts every RMSNorm weight at one; perturbed, a loader that swaps two norms' weights (or
    # drops one) changes the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn(p.shape))
    return model.to(torch.float32)


def llama3_inv_freq(theta, head_dim, factor, low_freq_factor, high_freq_factor, old_context_len):
    """Llama 3.1's frequency scaling written out independently (float64), to check what transformers did."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    low_wavelen, high_wavelen = old_context_len / low_freq_factor, old_context_len / high_freq_factor
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(f)
        elif wavelen > low_wavelen:
            out.append(f / factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append((1 - smooth) * f / factor + smooth * f)
    return np.array(out)


def verify_rope(name, model, out_dir):
    """From the saved config.json: the rotary embedding it gives is the model's, and scaling changed it when asked."""
    _, theta, scaling = MODELS[name]
    saved = LlamaConfig.from_pretrained(out_dir)
    inv_model = model.model.rotary_emb.inv_freq.detach().double().numpy()
    inv_saved = type(model.model.rotary_emb)(saved).inv_freq.double().numpy()
    assert np.array_equal(inv_model, inv_saved), (name, inv_model, inv_saved)
    head_dim = saved.hidden_size // saved.num_attention_heads
    plain = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    plain_cfg = copy.deepcopy(saved)
    if TRANSFORMERS_MAJOR >= 5:
        plain_cfg.rope_parameters = {"rope_type": "default", "rope_theta": theta}
    else:
        plain_cfg.rope_scaling = None
    inv_plain = type(model.model.rotary_emb)(plain_cfg).inv_freq.double().numpy()
    np.testing.assert_allclose(inv_plain, plain, rtol=1e-6)
    if scaling is None:
        np.testing.assert_allclose(inv_model, plain, rtol=1e-6)
        print(f"{name}: rope unscaled, theta {theta}, inv_freq {inv_model.tolist()}")
    else:
        assert not np.allclose(inv_model, inv_plain), f"{name}: llama3 scaling was not applied"
        want = llama3_inv_freq(theta, head_dim, scaling["factor"], scaling["low_freq_factor"],
                               scaling["high_freq_factor"], scaling["original_max_position_embeddings"])
        np.testing.assert_allclose(inv_model, want, rtol=1e-5)
        print(f"{name}: rope llama3-scaled, theta {theta}\n  unscaled inv_freq {inv_plain.tolist()}\n"
              f"  scaled   inv_freq {inv_model.tolist()}")


def make_reference(name, model, out_dir):
    vocab = model.config.vocab_size
    input_ids = torch.randint(3, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(INPUT_SEED))
    prompt_ids = torch.randint(3, vocab, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(PROMPT_SEED))

    model.train()  # every dropout is 0.0: train mode changes nothing but is what a training step runs
    model.zero_grad(set_to_none=True)
    logits = model(input_ids).logits.detach().clone()
    out = model(input_ids, labels=input_ids)
    assert torch.equal(out.logits.detach(), logits), f"{name}: logits differ between the two forwards"
    loss = out.loss
    loss.backward()

    tensors = {
        "input_ids": input_ids.to(torch.int64).contiguous(),
        "logits": logits.to(torch.float32).contiguous(),
        "loss": loss.detach().reshape(1).to(torch.float32).contiguous(),
    }
    for pname, p in model.named_parameters():  # tied weights appear once, under the embedding's name
        assert p.grad is not None, f"{name}: no gradient for {pname}"
        tensors[f"grad.{pname}"] = p.grad.detach().to(torch.float32).clone().contiguous()

    gen_eos = model.generation_config.eos_token_id
    model.generation_config.eos_token_id = None  # eos must not end it early: for this call only
    try:
        greedy = model.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), max_new_tokens=NEW_TOKENS,
                                min_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    finally:
        model.generation_config.eos_token_id = gen_eos
    assert greedy.shape == (1, PROMPT_LEN + NEW_TOKENS), greedy.shape
    assert torch.equal(greedy[:, :PROMPT_LEN], prompt_ids)
    # the same tokens by plain argmax over full forwards, so the reference doesn't lean on generate's cache
    ids = prompt_ids
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(ids, greedy), f"{name}: generate {greedy.tolist()} != argmax loop {ids.tolist()}"
    tensors["prompt_ids"] = prompt_ids.to(torch.int64).contiguous()
    tensors["greedy_ids"] = greedy.to(torch.int64).contiguous()

    # every parameter of model.safetensors has its gradient, under the same name, and nothing else
    saved = load_file(os.path.join(out_dir, "model.safetensors"))
    grads = {k[len("grad."):] for k in tensors if k.startswith("grad.")}
    assert grads == set(saved), f"{name}: grad names {sorted(grads ^ set(saved))} differ from model.safetensors"
    for k, v in saved.items():
        assert tensors[f"grad.{k}"].shape == v.shape, k
        assert v.dtype == torch.float32, (k, v.dtype)

    # one metadata entry only: safetensors writes several in no fixed order, and reruns should be byte-identical
    # (the versions are in README.md)
    save_file(tensors, os.path.join(out_dir, "reference.safetensors"), metadata={"made_by": "scripts/llama-fixture.py"})
    return tensors, saved


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def cmd_make(a):
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    os.makedirs(a.out_dir, exist_ok=True)
    summary = {}
    for name in MODELS:
        d = os.path.join(a.out_dir, name)
        os.makedirs(d, exist_ok=True)
        for f in os.listdir(d):  # a clean directory: nothing left from an earlier layout
            os.remove(os.path.join(d, f))
        model = build_model(name)
        model.save_pretrained(d, safe_serialization=True)
        verify_rope(name, model, d)
        tensors, saved = make_reference(name, model, d)
        summary[name] = (tensors, saved)
        print(f"{name}: loss {tensors['loss'].item():.8f}  greedy_ids {tensors['greedy_ids'].tolist()}")
    write_readme(a.out_dir, summary)
    total = 0
    for root, _, files in sorted(os.walk(a.out_dir)):
        for f in sorted(files):
            p = os.path.join(root, f)
            total += os.path.getsize(p)
            print(f"{os.path.getsize(p):8d}  {sha256(p)[:16]}  {os.path.relpath(p, a.out_dir)}")
    print(f"{total:8d}  total")


def dir_size(path):
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def write_readme(out_dir, summary):
    v = versions()
    lines = [
        "# Llama reference fixture",
        "",
        "Made by `scripts/llama-fixture.py make` with Hugging Face transformers' `LlamaForCausalLM` (PyTorch, CPU,",
        "float32, eager attention): the reference our Llama implementation is tested against, as llm.c's",
        "test_gpt2 checks its GPT-2 against PyTorch's debug state. Do not edit these files by hand: regenerate them.",
        "",
        "Made with: " + ", ".join(f"{k} {val}" for k, val in v.items()) + ".",
        "",
        "Regenerate (from the repository root, no network or GPU needed):",
        "",
        "    python3 scripts/llama-fixture.py make crates/accel/tests/fixtures/llama",
        "",
        "Check that a model directory written by someone else (e.g. our Rust code) loads in transformers and gives",
        "the reference logits (exit 1 when the max absolute difference is over `--tol`, default 1e-4):",
        "",
        "    python3 scripts/llama-fixture.py check DIR crates/accel/tests/fixtures/llama/gqa/reference.safetensors",
        "",
        "## Each directory",
        "",
        "- `config.json`, `generation_config.json`, `model.safetensors`: exactly as `model.save_pretrained(dir,",
        "  safe_serialization=True)` wrote them; the model was built by `torch.manual_seed(0)` then",
        "  `LlamaForCausalLM(LlamaConfig(...))` (transformers' own random initialisation: normal(0, 0.1) for",
        "  linear and embedding weights), then every RMSNorm weight perturbed to 1 + 0.1·randn (so that swapped or",
        "  dropped norm weights change the logits).",
        "- `reference.safetensors` (safetensors.torch.save_file):",
        "  - `input_ids` int64 [2, 8]: fixed ids in [3, vocab) (torch.randint, generator seeded 1234)",
        "  - `logits` f32 [2, 8, vocab]: `model(input_ids).logits` in train mode (every dropout is 0)",
        "  - `loss` f32 [1]: `model(input_ids, labels=input_ids).loss`; transformers shifts the labels inside, so it",
        "    is the mean cross-entropy over the 2 x 7 predicted positions",
        "  - `grad.<name>` f32: the gradient of that loss for every parameter, `<name>` exactly as in",
        "    `model.safetensors`; for the tied model the embedding's gradient includes the head's contribution",
        "    and is `grad.model.embed_tokens.weight`",
        "  - `prompt_ids` int64 [1, 4] (generator seeded 5678) and `greedy_ids` int64 [1, 16]:",
        "    `model.generate(prompt_ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)` with eos off;",
        "    checked equal to an argmax loop over full forwards",
        "",
    ]
    for name, (tensors, saved) in summary.items():
        d = os.path.join(out_dir, name)
        with open(os.path.join(d, "config.json")) as f:
            cfg = f.read().strip()
        lines += [
            f"## `{name}/` ({dir_size(d)} bytes)",
            "",
            f"Loss {tensors['loss'].item():.8f}; greedy_ids {tensors['greedy_ids'].tolist()}.",
            "",
            "config.json:",
            "",
            "```json",
            cfg,
            "```",
            "",
            "model.safetensors:",
            "",
            "| name | dtype | shape |",
            "| --- | --- | --- |",
        ]
        lines += [f"| `{k}` | {str(t.dtype).replace('torch.', '')} | {list(t.shape)} |" for k, t in sorted(saved.items())]
        lines.append("")
    readme = os.path.join(out_dir, "README.md")
    with open(readme, "w") as f:
        f.write("\n".join(lines))
    # the total counts the README itself: write it once more with the size that now holds
    for _ in range(3):
        total = dir_size(out_dir)
        text = "\n".join(lines[:8] + [f"Total size of the fixture: {total} bytes (this README included).", ""]
                         + lines[8:]) + "\n"
        with open(readme, "w") as f:
            f.write(text)
        if dir_size(out_dir) == total:
            break


def cmd_check(a):
    torch.set_num_threads(1)
    transformers.logging.disable_progress_bar()
    dtype_kw = {"dtype": torch.float32} if TRANSFORMERS_MAJOR >= 5 else {"torch_dtype": torch.float32}
    model, info = LlamaForCausalLM.from_pretrained(a.dir, attn_implementation="eager", output_loading_info=True,
                                                   **dtype_kw)
    # a weight transformers could not place (missing: it would be left randomly initialised) fails the check
    bad = {k: sorted(v) for k, v in info.items() if k != "error_msgs" and v}
    if bad or info.get("error_msgs"):
        print(f"{a.dir} did not load cleanly: {bad} {info.get('error_msgs') or ''}")
        return 1
    ref = load_file(a.reference)
    input_ids, want = ref["input_ids"], ref["logits"]
    with torch.no_grad():
        got = model(input_ids).logits.to(torch.float32)
    if got.shape != want.shape:
        print(f"logits shape {list(got.shape)} != reference {list(want.shape)}")
        return 1
    diff = (got - want).abs().max().item()
    ok = diff <= a.tol
    print(f"max |logits - reference| = {diff:.3e} (tol {a.tol:g}): {'ok' if ok else 'FAIL'}")
    return 0 if ok else 1


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make", help="write the fixture")
    m.add_argument("out_dir", nargs="?", default=DEFAULT_OUT)
    c = sub.add_parser("check", help="load DIR in transformers and compare its logits with REFERENCE")
    c.add_argument("dir")
    c.add_argument("reference")
    c.add_argument("--tol", type=float, default=1e-4)
    a = p.parse_args()
    if a.cmd == "make":
        cmd_make(a)
        return 0
    return cmd_check(a)


if __name__ == "__main__":
    sys.exit(main())
