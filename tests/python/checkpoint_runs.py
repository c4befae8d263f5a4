"""What the checkpoint tests share: the config they train with, a training loop over the
global batches, and ways to damage a file."""

from training import engine_config, train_global_batches

GLOBAL = 8  # sequences per optimizer step, at every world size


def config(world_size, stage, precision="fp32", gas=1, **extras):
    # Small buckets and threshold 0: several flat buffers, every parameter sharded.
    config = engine_config(stage, micro=GLOBAL // (world_size * gas), gas=gas, precision=precision,
                           loss_scaling={"initial_scale_power": 10, "loss_scale_window": 2}
                           if precision == "fp16" else None,
                           zero={"reduce_bucket_size": 500, "stage3_param_persistence_threshold": 0},
                           zeroshard=extras)
    config["train_batch_size"] = GLOBAL
    return config


def train(model, engine, rank, world_size, steps):
    """Trains on the global batches of `steps` (in gradient_accumulation_steps micro-batches);
    returns the mean loss over ranks and micro-batches per step."""
    micro = GLOBAL // (world_size * engine.gradient_accumulation_steps)
    return train_global_batches(model, engine, rank, world_size, steps, micro, after_step=model.advance)


def damage(path, how):
    data = bytearray(path.read_bytes())
    if how == "flip":
        data[len(data) * 3 // 4] ^= 0x10
        path.write_bytes(bytes(data))
    elif how == "truncate":
        path.write_bytes(bytes(data[:len(data) - 100]))
    elif how == "remove":
        path.unlink()
