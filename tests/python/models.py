"""Small models and data shared by the engine tests and benchmarks."""

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


def make_model(seed=0, **kwargs):
    torch.manual_seed(seed)
    return TinyTransformer(**kwargs)


def global_batch(step, batch, seq=9, vocab=37):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (batch, seq), generator=g)


def train_global_batches(model, engine, rank, world_size, steps, micro, after_step=None):
    """Runs one engine step per entry of `steps` on global_batch(step, micro x world_size x
    gradient_accumulation_steps): rank r takes micro-batch m x world_size + r at micro-step m,
    and engine.step() must report a step at the accumulation boundary only. Returns each step's
    loss averaged over the global batch (every rank and micro-batch)."""
    import torch.distributed as dist

    gas = engine.gradient_accumulation_steps
    losses = []
    for step in steps:
        tokens = global_batch(step, micro * world_size * gas)
        total = torch.zeros(())
        for m in range(gas):
            start = (m * world_size + rank) * micro
            loss = model.loss(tokens[start:start + micro])
            engine.backward(loss)
            assert engine.step() == (m == gas - 1)
            total += loss.detach().float()
        if after_step is not None:
            after_step()
        dist.all_reduce(total)
        losses.append(total.item() / (world_size * gas))
    return losses


def no_decay_groups(model):
    """The usual split: no weight decay for biases and norm weights."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim < 2 else decay).append(p)
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0, "lr": 2e-3}]


def adamw_reference(steps, batch, lr, weight_decay=0.05, clip=0.0, two_groups=False, device="cpu"):
    """Single-process torch.optim.AdamW on the whole global batch of every step: what every
    engine configuration is held to. Returns the losses and the final state dict."""
    model = make_model().to(device)
    groups = no_decay_groups(model) if two_groups else model.parameters()
    opt = torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay)
    losses = []
    for step in range(steps):
        loss = model.loss(global_batch(step, batch).to(device))
        opt.zero_grad()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


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
