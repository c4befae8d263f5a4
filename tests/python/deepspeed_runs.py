"""What the drop-in tests run on their ranks (test_deepspeed_dropin.py), and the config they share."""

import os
import warnings

import torch
import torch.distributed as dist

import zeroshard.deepspeed as deepspeed
from ds_script import LanguageModel, TokenDataset
from training import engine_config

WORLD, MICRO, GAS, STEPS = 2, 2, 2, 6
LR, WD = 1e-2, 0.05
SCHEDULE = {"warmup_min_lr": 0.0, "warmup_max_lr": LR, "warmup_num_steps": 3, "total_num_steps": STEPS}


def ds_config(stage, gas=GAS, precision="fp32", scheduler=True, **extra):
    """A config as a DeepSpeed user writes it: the three batch sizes, AdamW through torch
    (DeepSpeed's "torch_adam", which zeroshard reads as a known, ignored key), WarmupDecayLR."""
    config = engine_config(stage, lr=LR, weight_decay=WD, micro=MICRO, gas=gas, precision=precision, timeout=None)
    config["train_batch_size"] = MICRO * gas * WORLD
    config["optimizer"]["params"]["torch_adam"] = True
    if scheduler:
        config["scheduler"] = {"type": "WarmupDecayLR", "params": dict(SCHEDULE)}
    config.update(extra)
    return config


def two_groups(model):
    decay = [p for p in model.parameters() if p.ndim >= 2]
    return [{"params": decay}, {"params": [p for p in model.parameters() if p.ndim < 2], "weight_decay": 0.0,
                                "lr": 2e-3}]


def client_adamw(model):
    return torch.optim.AdamW(two_groups(model), lr=LR, weight_decay=WD, betas=(0.8, 0.95), eps=1e-7)


def client_schedule(step):
    return 1.0 / (step + 1)


def run_micro_steps(engine, batches):
    """engine(tokens), backward, step on each micro-batch; each one's loss (mean over ranks) and
    the get_lr() it ran with."""
    losses, lrs = [], []
    for tokens in batches:
        lrs.append(engine.get_lr())
        loss = engine(tokens)
        engine.backward(loss)
        engine.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    return losses, lrs


def dataloader_and_checkpoints(rank, world, directory):
    out = {}
    # The dataloader: DeepSpeed's micro batch, DistributedSampler (shuffled, seed 0), drop_last.
    for drop_last in (False, True):
        torch.manual_seed(0)
        engine, _, loader, _ = deepspeed.initialize(model=LanguageModel(), training_data=TokenDataset(21),
                                                    config=ds_config(1, dataloader_drop_last=drop_last))
        sampler = loader.data_sampler
        out[f"loader drop_last={drop_last}"] = dict(
            sampler=type(sampler).__name__, shuffle=sampler.shuffle, seed=sampler.seed, replicas=sampler.num_replicas,
            rank=sampler.rank, batch=loader.batch_size, drop_last=loader.dataloader_drop_last, len=len(loader),
            batches=[b.clone() for b in loader], indices=list(sampler))

    # A client AdamW with two groups and a torch scheduler built on it, taken over; a config
    # with its own optimizer section (the client's wins, as in DeepSpeed).
    torch.manual_seed(0)
    model = LanguageModel()
    client = client_adamw(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(client, client_schedule)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine, optimizer, loader, returned = deepspeed.initialize(
            model=model, optimizer=client, lr_scheduler=scheduler, training_data=TokenDataset(STEPS * 8),
            config=ds_config(1, scheduler=False))
    out["warnings"] = [str(w.message) for w in caught]
    out["returned"] = dict(optimizer=optimizer is engine.optimizer, scheduler=returned is scheduler)
    out["groups"] = [(g["lr"], tuple(g["betas"]), g["eps"], g["weight_decay"]) for g in optimizer.param_groups]
    batches = list(loader)
    out["batches"] = [b.clone() for b in batches]
    first = run_micro_steps(engine, batches[:4])
    path = engine.save_checkpoint(directory, client_state={"epoch": 3, "note": "kept"})
    out["saved"] = dict(returned=path, at=engine.get_lr(), sched=scheduler.last_epoch)
    # save_latest=False: published, but `latest` keeps naming the one before.
    engine.save_checkpoint(directory, tag="aside", save_latest=False)
    with open(os.path.join(directory, "latest"), "rb") as f:
        out["latest"] = f.read()
    then = run_micro_steps(engine, batches[4:8])
    out["trained"] = (first[0] + then[0], first[1] + then[1])
    out["weights"] = {k: v.detach().clone() for k, v in engine._engine.full_state_dict().items()}

    # Resumed in a fresh engine (another init) from `latest`: counters, schedule and lr restored.
    torch.manual_seed(5)
    model = LanguageModel()
    client = client_adamw(model)
    scheduler = torch.optim.lr_scheduler.LambdaLR(client, client_schedule)
    engine, *_ = deepspeed.initialize(model=model, optimizer=client, lr_scheduler=scheduler,
                                      config=ds_config(1, scheduler=False))
    path, state = engine.load_checkpoint(directory)
    out["loaded"] = dict(path=path, state=state, global_steps=engine.global_steps,
                         global_samples=engine.global_samples, lr=engine.get_lr(), sched=scheduler.last_epoch)
    out["resumed"] = run_micro_steps(engine, batches[4:8])
    out["aside"] = engine.load_checkpoint(directory, tag="aside")[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["empty"] = engine.load_checkpoint(os.path.join(directory, "nothing here"))
    out["empty warnings"] = [str(w.message) for w in caught]
    out["config schedule"] = config_schedule_round_trip(os.path.join(directory, "schedule"))
    return out


def config_schedule_round_trip(directory):
    """The config's WarmupDecayLR through a checkpoint: saved after 2 steps, resumed in a fresh engine."""
    batches = [TokenDataset(4 * MICRO * GAS, seed=dist.get_rank())[i * MICRO:(i + 1) * MICRO] for i in range(4 * GAS)]
    torch.manual_seed(0)
    engine, _, _, scheduler = deepspeed.initialize(model=LanguageModel(), config=ds_config(2))
    out = {"before": engine.get_lr(), "scheduler": type(scheduler).__name__}
    run_micro_steps(engine, batches[:2 * GAS])
    engine.save_checkpoint(directory)
    out["at save"] = engine.get_lr()
    out["scheduler at save"] = (scheduler.get_lr(), scheduler.state_dict())
    out["trained"] = run_micro_steps(engine, batches[2 * GAS:])
    torch.manual_seed(1)
    engine, *_ = deepspeed.initialize(model=LanguageModel(), config=ds_config(2))
    engine.load_checkpoint(directory)
    out["at load"], out["global_steps"] = engine.get_lr(), engine.global_steps
    out["resumed"] = run_micro_steps(engine, batches[2 * GAS:])
    return out


def _masters(engine):
    return engine._engine.full_state_dict(dtype=torch.float32)


def gathered_parameters_and_16bit_model(rank, world, directory):
    out = {"dir": directory}
    for stage in (1, 3):
        torch.manual_seed(0)
        # Cast to bf16 first, as DeepSpeed scripts often do: the masters take these values.
        model = LanguageModel().to(torch.bfloat16)
        start = {k: v.float() for k, v in model.state_dict().items()}
        engine, *_ = deepspeed.initialize(model=model, config=ds_config(stage, gas=1, precision="bf16",
                                                                         scheduler=False))
        result = out[stage] = {"start": start, "initial masters": _masters(engine)}
        run_micro_steps(engine, [TokenDataset(4, seed=rank)[:2]])
        before = _masters(engine)
        with deepspeed.zero.GatheredParameters(model.parameters()):
            result["read"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        # Read only: a change is not kept (stage 3 releases the gathered copy).
        with deepspeed.zero.GatheredParameters(model.embed.weight):
            with torch.no_grad():
                model.embed.weight.fill_(7.0)
        if stage == 3:
            result["after read-only change"] = _masters(engine)["embed.weight"]
        # Modified on rank 0 (every parameter listed, one changed); rank 1's change is overwritten.
        with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
            with torch.no_grad():
                model.embed.weight.copy_(torch.full_like(model.embed.weight, 0.5 if rank == 0 else -1.0))
        result["before"], result["after"] = before, _masters(engine)
        with deepspeed.zero.GatheredParameters([model.embed.weight]):
            result["compute after"] = model.embed.weight.detach().clone()
        result["trained after"] = run_micro_steps(engine, [TokenDataset(4, seed=rank)[:2]])[0]
        result["weights after"] = {k: v.detach().clone() for k, v in engine._engine.full_state_dict().items()}
        # save_16bit_model: DeepSpeed's default name; at stage 3 only with the gather flag.
        target = os.path.join(directory, f"stage{stage}")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result["saved"] = engine.save_16bit_model(target)
        result["save warnings"] = [str(w.message) for w in caught]
        result["files"] = sorted(os.listdir(target)) if os.path.isdir(target) else []
        result["state_dict"] = {k: v.detach().clone() for k, v in engine._engine.full_state_dict().items()}
    torch.manual_seed(0)
    config = ds_config(3, gas=1, precision="bf16", scheduler=False,
                       zero_optimization={"stage": 3, "stage3_gather_16bit_weights_on_model_save": True})
    engine, *_ = deepspeed.initialize(model=LanguageModel(), config=config)
    target = os.path.join(directory, "gathered")
    out["gathered"] = dict(saved=engine.save_16bit_model(target), files=sorted(os.listdir(target)))
    return out
