"""Small models and the data the engine tests train them on."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        h = self.down(F.gelu(self.up(self.norm(x))))
        # Mixing along the sequence keeps the model transformer-like without attention.
        return x + h + h.cumsum(dim=1) / torch.arange(1, x.shape[1] + 1, device=x.device).view(1, -1, 1)


class TinyTransformer(nn.Module):
    """Embedding, blocks of LayerNorm + Linear, a head; odd sizes on purpose: a 53-element
    parameter (partly unused, so part of it never gets a gradient) and a 1-element bias."""

    def __init__(self, vocab=37, dim=24, hidden=40, layers=2):
        super().__init__()
        self.vocab = vocab
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.gate = nn.Linear(dim, 1)
        self.odd = nn.Parameter(torch.randn(53) * 0.1)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        return self.head(x) + self.gate(x) * self.odd[: self.vocab]

    def loss(self, tokens):
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, self.vocab), tokens[:, 1:].reshape(-1))


class CheckpointedTransformer(TinyTransformer):
    """TinyTransformer whose blocks run under activation checkpointing (not reentrant): each
    block's forward runs again inside the backward. The same values as TinyTransformer."""

    def forward(self, tokens):
        from torch.utils.checkpoint import checkpoint

        x = self.embed(tokens)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        x = self.norm(x)
        return self.head(x) + self.gate(x) * self.odd[: self.vocab]


def make_model(seed=0, **kwargs):
    torch.manual_seed(seed)
    return TinyTransformer(**kwargs)


def global_batch(step, batch, seq=9, vocab=37):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (batch, seq), generator=g)


class StatefulTransformer(TinyTransformer):
    """TinyTransformer with everything a checkpoint must carry besides independent trained
    weights: a head tied to the embedding, a frozen parameter, and a buffer that the training
    loop changes (call advance() after each step)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.head.weight = self.embed.weight
        self.frozen = nn.Parameter(torch.randn(self.vocab) * 0.1, requires_grad=False)
        self.register_buffer("temperature", torch.ones(()))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))  # a non-float buffer

    def forward(self, tokens):
        return super().forward(tokens) / self.temperature + self.frozen

    @torch.no_grad()
    def advance(self):
        self.temperature.add_(0.01)
        self.steps.add_(1)


def make_stateful_model(seed=0):
    torch.manual_seed(seed)
    return StatefulTransformer()


class LoraLinear(nn.Module):
    """A frozen Linear with trained low-rank adapters, as peft's LoRA builds it:
    base(x) + lora_B(lora_A(x)) * scale, lora_B starting at zero."""

    def __init__(self, base, rank=4, scale=2.0):
        super().__init__()
        self.base = base
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)
        nn.init.normal_(self.lora_B.weight, std=0.05)  # non-zero, so the adapters matter from step 0
        self.scale = scale

    def forward(self, x):
        out = self.base(x)
        a = self.lora_B(self.lora_A(x.to(self.lora_A.weight.dtype)))
        return (out + a * self.scale).to(out.dtype)


class LoraTransformer(TinyTransformer):
    """TinyTransformer as a LoRA fine-tune sees it: every weight of the base frozen (in
    `base_dtype`), adapters on each block's up and down projections trained in fp32. The
    output is fp32 whatever the base's dtype."""

    def __init__(self, base_dtype=torch.float32, rank=4, **kwargs):
        super().__init__(**kwargs)
        for block in self.blocks:
            block.up = LoraLinear(block.up, rank)
            block.down = LoraLinear(block.down, rank)
        for name, p in self.named_parameters():
            if "lora_" not in name:
                p.requires_grad_(False)
                p.data = p.data.to(base_dtype)
        self.base_dtype = base_dtype

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        return (self.head(x) + self.gate(x) * self.odd[: self.vocab].to(x.dtype)).float()


def make_lora_model(seed=0, base_dtype=torch.float32, **kwargs):
    torch.manual_seed(seed)
    return LoraTransformer(base_dtype=base_dtype, **kwargs)


class CheckpointedLoraTransformer(LoraTransformer):
    """LoraTransformer whose blocks run under activation checkpointing (`reentrant` or not), as
    a LoRA fine-tune of a large model does: the same values."""

    def __init__(self, reentrant=False, **kwargs):
        super().__init__(**kwargs)
        self.reentrant = reentrant

    def forward(self, tokens):
        from torch.utils.checkpoint import checkpoint

        x = self.embed(tokens)
        if self.reentrant:
            # Reentrant checkpointing needs an input that requires grad, which peft's
            # enable_input_require_grads() gives the embedding's output the same way.
            x.requires_grad_(True)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=self.reentrant)
        x = self.norm(x)
        return (self.head(x) + self.gate(x) * self.odd[: self.vocab].to(x.dtype)).float()
