"""PyTorch twins of the accel-rs benchmark models and data readers (scripts/bench-levels.sh, bench-step.sh).

- `Mlp`: examples/src/lib.rs's `Mlp` — standardise with MNIST's mean/std, then Linear → ReLU → ... → Linear(…, 10),
  layers named fc1, fc2, ...; nn.Linear's default initialisation (uniform ±1/sqrt(fan_in), as `seed_parameters`).
- `CharGpt`: examples/src/gpt.rs's `CharGpt` at tp = 1 — learned token and position embeddings, pre-LN blocks
  (LayerNorm eps 1e-5), separate q/k/v linears with bias, causal softmax(q kᵀ/√hd + mask) v written out with
  matmuls (PyTorch's fused `F.scaled_dot_product_attention(is_causal=True)` was slower here: 86–94 against
  86–89 ms per step at 1 thread, 59–60 against 52–55 at 2; docs/benchmarks.md), c_proj, MLP c_fc → GELU (tanh approximation, candle's `gelu`) →
  c_proj, ln_f, an untied lm_head without bias; GPT-2's initialisation (Normal(0, 0.02), residual projections
  0.02/√(2·n_layer), zero biases). `num_parameters` is GptConfig::num_parameters's formula; the constructor asserts
  the module has exactly that many.
- `load_mnist`: the repository's data/mnist IDX files (gzip), pixels / 255 as float32 `[n, 784]`, labels int64.
- `shakespeare`: the text split as `accel_examples::split_text_datasets` does — vocabulary = the sorted distinct
  characters of the whole text, the first 95 % of the characters for training, the last 5 % for validation,
  non-overlapping windows of `block` characters with targets shifted by one.
No downloads: everything is read from the repository.
"""

import gzip
import math
import os
import struct

import torch
import torch.nn as nn
import torch.nn.functional as F

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
MNIST_MEAN = 0.1307
MNIST_STD = 0.3081
GPT_BLOCK = 64


def _open(path):
    if os.path.exists(path):
        return open(path, "rb")
    if os.path.exists(path + ".gz"):
        return gzip.open(path + ".gz", "rb")
    raise FileNotFoundError(f"{path}[.gz] not found (the repository's MNIST files; see data/mnist)")


def load_mnist(split, data_dir=None):
    """(images float32 [n, 784] in [0, 1], labels int64 [n]) of `split` ("train10k" or "t10k")."""
    d = data_dir or os.path.join(REPO, "data", "mnist")
    with _open(os.path.join(d, f"{split}-images-idx3-ubyte")) as f:
        magic, n, rows, cols = struct.unpack(">IIII", f.read(16))
        if magic != 2051:
            raise ValueError(f"{split} images: magic {magic}, expected 2051 (an IDX3 file)")
        images = torch.frombuffer(bytearray(f.read(n * rows * cols)), dtype=torch.uint8).view(n, rows * cols)
    with _open(os.path.join(d, f"{split}-labels-idx1-ubyte")) as f:
        magic, m = struct.unpack(">II", f.read(8))
        if magic != 2049 or m != n:
            raise ValueError(f"{split} labels: magic {magic} / count {m}, expected 2049 / {n}")
        labels = torch.frombuffer(bytearray(f.read(m)), dtype=torch.uint8).to(torch.int64)
    return images.to(torch.float32) / 255.0, labels


class Mlp(nn.Module):
    """784 → hidden… → 10 with ReLU; input standardised inside, as ours."""

    def __init__(self, hidden=(512, 512)):
        super().__init__()
        widths = [784, *hidden, 10]
        for i in range(len(widths) - 1):
            self.add_module(f"fc{i + 1}", nn.Linear(widths[i], widths[i + 1]))
        self.n = len(widths) - 1

    def forward(self, x):
        h = (x - MNIST_MEAN) / MNIST_STD
        for i in range(self.n):
            h = getattr(self, f"fc{i + 1}")(h)
            if i != self.n - 1:
                h = torch.relu(h)
        return h


def mlp_num_parameters(hidden):
    widths = [784, *hidden, 10]
    return sum(a * b + b for a, b in zip(widths, widths[1:]))


def shakespeare(block=GPT_BLOCK, path=None):
    """(train_tokens, val_tokens, vocab): int64 token tensors and the sorted character list."""
    path = path or os.path.join(REPO, "data", "shakespeare", "shakespeare8.txt")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    ids = torch.tensor([index[c] for c in text], dtype=torch.int64)
    cut = len(text) * 95 // 100
    return ids[:cut], ids[cut:], vocab


def num_windows(tokens, block=GPT_BLOCK):
    """Non-overlapping windows of `block` tokens with a next token: TextDataset::len's arithmetic."""
    t = tokens.numel()
    return 0 if t <= block else (t - block - 1) // block + 1


def windows(tokens, idx, block=GPT_BLOCK):
    """Inputs and targets `[len(idx), block]` of the windows `idx` (window i starts at i·block)."""
    starts = torch.as_tensor(idx, dtype=torch.int64).view(-1, 1) * block
    offs = torch.arange(block).view(1, -1)
    return tokens[starts + offs], tokens[starts + offs + 1]


class TextWindows(torch.utils.data.Dataset):
    """The windows as a map-style dataset (what a DataLoader user writes)."""

    def __init__(self, tokens, block=GPT_BLOCK, as_dict=False):
        self.tokens, self.block, self.as_dict = tokens, block, as_dict

    def __len__(self):
        return num_windows(self.tokens, self.block)

    def __getitem__(self, i):
        s = i * self.block
        x, y = self.tokens[s : s + self.block], self.tokens[s + 1 : s + self.block + 1]
        return {"input_ids": x, "labels": y} if self.as_dict else (x, y)


class GptConfig:
    def __init__(self, vocab_size, block_size=GPT_BLOCK, n_layer=4, n_head=4, d_model=128, d_ff=512):
        self.vocab_size, self.block_size, self.n_layer = vocab_size, block_size, n_layer
        self.n_head, self.d_model, self.d_ff = n_head, d_model, d_ff

    def num_parameters(self):
        """GptConfig::num_parameters of examples/src/gpt.rs."""
        v, d, f = self.vocab_size, self.d_model, self.d_ff
        ln = 2 * d
        block = ln + 3 * (d * d + d) + (d * d + d) + ln + (d * f + f) + (f * d + d)
        return v * d + self.block_size * d + self.n_layer * block + ln + v * d


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d = cfg.d_model
        self.q, self.k, self.v, self.c_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.n_head, self.head_dim = cfg.n_head, d // cfg.n_head

    def forward(self, x, mask):
        b, s, d = x.shape

        def heads(t):
            return t.view(b, s, self.n_head, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        att = torch.softmax(scores + mask, dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, s, d)
        return self.c_proj(y)


class GptMlp(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(cfg.d_model, cfg.d_ff), nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1, self.attn = nn.LayerNorm(cfg.d_model, eps=1e-5), Attention(cfg)
        self.ln_2, self.mlp = nn.LayerNorm(cfg.d_model, eps=1e-5), GptMlp(cfg)

    def forward(self, x, mask):
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class CharGpt(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.wpe = nn.Parameter(torch.zeros(cfg.block_size, cfg.d_model))
        self.h = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.d_model, eps=1e-5)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        residual_std = 0.02 / math.sqrt(2 * cfg.n_layer)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("c_proj.weight"):
                    p.normal_(0.0, residual_std)
                elif name.endswith(".bias") and "ln_" not in name:
                    p.zero_()
                elif "ln_" in name:
                    continue  # LayerNorm: weight 1, bias 0 (PyTorch's init)
                else:
                    p.normal_(0.0, 0.02)  # wte, wpe, q/k/v, c_fc, lm_head
        n = sum(p.numel() for p in self.parameters())
        assert n == cfg.num_parameters(), f"CharGpt has {n} parameters, GptConfig::num_parameters says {cfg.num_parameters()}"
        mask = torch.full((cfg.block_size, cfg.block_size), float("-inf")).triu(1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, ids):
        s = ids.shape[1]
        x = self.wte(ids) + self.wpe[:s]
        mask = self.mask[:s, :s]
        for block in self.h:
            x = block(x, mask)
        return self.lm_head(self.ln_f(x))

    def loss(self, ids, targets):
        logits = self.forward(ids)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
