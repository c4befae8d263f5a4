"""zeroshard for the Hugging Face Trainer and TRL: change one line of a Trainer script.

    from zeroshard.hf import Trainer                # for transformers.Trainer
    SFTTrainer = zeroshard.hf.wrap(trl.SFTTrainer)  # for any Trainer subclass
    trainer = Trainer(model=model, args=args, ..., zero_config="ds_config.json")

zero_config is a zeroshard / DeepSpeed-style config (a path or a dict) whose "auto" values the
TrainingArguments fill in; TrainingArguments(deepspeed=...) stays unset. docs/hf.md.
"""

from zeroshard.hf.pretrained import from_pretrained
from zeroshard.hf.trainer import ShardedTrainer, wrap


def __getattr__(name):
    # transformers is imported when the Trainer is first asked for, not with zeroshard.hf.
    if name == "Trainer":
        import transformers

        trainer = wrap(transformers.Trainer)
        globals()["Trainer"] = trainer
        return trainer
    raise AttributeError(f"module 'zeroshard.hf' has no attribute {name!r}")


__all__ = ["ShardedTrainer", "Trainer", "from_pretrained", "wrap"]
