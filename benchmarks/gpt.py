"""A small GPT (causal self-attention + MLP blocks) and the synthetic token data the
benchmarks train it on.

Defaults give about 5M parameters (20 MB in fp32): big enough that a step on one CPU core
takes a good fraction of a second, small enough that a benchmark run stays in minutes.
"""

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).split(dim, dim=2)
        q, k, v = (t.view(batch, seq, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, dim))


class Block(nn.Module):
    def __init__(self, dim, heads, hidden):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(nn.Module):
    """Token + learned position embeddings, pre-norm blocks, an untied head (tied weights
    would be one parameter under two names, which not every engine accepts)."""

    def __init__(self, vocab=512, dim=256, heads=4, hidden=1024, layers=6, max_seq=128):
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def next_token_loss(logits, tokens):
    """Cross-entropy of logits computed on tokens[:, :-1] against tokens[:, 1:]."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def make_model(seed, **sizes):
    torch.manual_seed(seed)
    return GPT(**sizes)


def token_batch(seed, step, rank, batch, seq, vocab):
    """Rows of an arithmetic progression mod vocab (random start, stride 1..7), seq + 1 tokens
    long: learnable (the stride shows after two tokens), so the loss visibly falls, and a
    function of (seed, step, rank) only, so every config sees the same data on each rank."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 101 + rank)
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    stride = torch.randint(1, 8, (batch, 1), generator=g)
    return (start + stride * torch.arange(seq + 1)) % vocab
