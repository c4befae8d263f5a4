"""zeroshard.hf.Trainer and wrap(): a Hugging Face Trainer (or any subclass of it: TRL's
SFTTrainer, DPOTrainer, a project's own) that trains through a zeroshard engine (docs/hf.md).

The Trainer keeps its loop, logging, evaluation, callbacks and checkpoint folders; the engine
takes the model, the optimizer step (Note [the Trainer's step through the engine], views.py), the
weights and optimizer state in checkpoints, and the saved model.
"""

import os
import warnings

import torch
from accelerate import Accelerator

import zeroshard
from zeroshard import meta as _meta
from zeroshard.hf import config as _config
from zeroshard.hf import pretrained as _pretrained
from zeroshard.hf.views import EngineModule, ScheduleView, ShardedAccelerator, StepView
from zeroshard.peft_adapter import is_peft_model

_SCHEDULER_NAME = "scheduler.pt"
_TRAINING_ARGS_NAME = "training_args.bin"


class ShardedRun:
    """The engine a Trainer trains through, and what its loop reads back of the last step."""

    def __init__(self):
        self.engine = None
        self.module = None         # the EngineModule the Trainer holds as model_wrapped
        self.last_step_lrs = None  # each group's lr in the last optimizer step
        self.last_step_skipped = False

    def backward_and_step(self, loss, boundary):
        engine = self.engine
        if engine is None:
            raise RuntimeError("zeroshard.hf: accelerator.backward() was called before the Trainer built its engine; "
                               "train through trainer.train()")
        engine.set_gradient_accumulation_boundary(bool(boundary))
        # The Trainer has scaled the loss for its accumulation window already (it knows a short
        # last window of an epoch), so the engine does not divide it again.
        engine.backward(loss, scale_wrt_gas=False)
        if boundary:
            self.last_step_lrs = [group["lr"] for group in engine.optimizer.param_groups]
        stepped = engine.step()
        if boundary:
            self.last_step_skipped = not stepped

    def last_grad_norm(self):
        if self.engine is None or self.engine.config.gradient_clipping <= 0:
            return None  # the engine computes the norm where it clips
        return self.engine.last_grad_norm


class ShardedTrainer:
    """Mixed in before a transformers.Trainer class by wrap(); see zeroshard.hf.Trainer."""

    def __init__(self, *args, zero_config=None, **kwargs):
        if zero_config is None:
            raise TypeError(f"zeroshard.hf: {type(self).__name__} needs zero_config=, the zeroshard / DeepSpeed-style "
                            "config (a path to a JSON file or a dict), e.g. zero_config={\"zero_optimization\": "
                            "{\"stage\": 3}}")
        optimizers = kwargs.get("optimizers") or (None, None)
        if any(o is not None for o in optimizers) or kwargs.get("optimizer_cls_and_kwargs") is not None:
            raise ValueError("zeroshard.hf: the Trainer's optimizers= / optimizer_cls_and_kwargs= cannot be used: the "
                             "engine runs AdamW on its own flat shards. Give its settings through TrainingArguments "
                             "(learning_rate, adam_beta1/2, adam_epsilon, weight_decay, lr_scheduler_type) or the "
                             "zero_config's \"optimizer\" and \"scheduler\" sections")
        if kwargs.get("model_init") is not None:
            raise ValueError("zeroshard.hf: model_init= (a new model for each train(), as hyperparameter_search "
                             "uses) is not supported: the engine shards the model it is given once; pass model=")
        self._zero_config = zero_config
        self._zeroshard = ShardedRun()
        self._zeroshard_steps = None        # train()'s optimizer steps
        self._zeroshard_built_steps = None  # those the engine's schedule was built for
        self._zeroshard_trained = False
        self._zeroshard_checkpointing = False  # inside _save_checkpoint
        super().__init__(*args, **kwargs)
        if self.args.save_only_model and self.args.load_best_model_at_end:
            raise ValueError("zeroshard.hf: TrainingArguments save_only_model=True with load_best_model_at_end=True "
                             "is not supported: the best model is reloaded from the sharded checkpoint, which "
                             "save_only_model leaves out (as under DeepSpeed and FSDP); drop one of the two")
        # Refused arguments and config values that disagree with the arguments fail here, before
        # any training (the schedule's step counts are checked at train(), where they are known).
        _config.trainer_config(zero_config, self.args, None)

    # -- the accelerator and the model's placement ------------------------------------------

    def _build_accelerator_args(self, **kwargs):
        args = super()._build_accelerator_args(**kwargs)
        # The engine does mixed precision itself (its bf16 / fp16 sections); accelerate's autocast
        # and GradScaler would act on gradients the engine holds in its own buffers.
        args["mixed_precision"] = "no"
        return args

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError(f"zeroshard.hf: the accelerate configuration turns on "
                             f"{'DeepSpeed' if self.is_deepspeed_enabled else 'FSDP'} (accelerate launch's config or "
                             "ACCELERATE_USE_* variables), but zeroshard does the sharding: launch with torchrun, or "
                             "with an accelerate config that uses neither")
        cls = type(self.accelerator)
        if not issubclass(cls, ShardedAccelerator):
            sharded = ShardedAccelerator if cls is Accelerator else type(f"Sharded{cls.__name__}",
                                                                        (ShardedAccelerator, cls), {})
            self.accelerator.__class__ = sharded  # Note [the Trainer's step through the engine]
        self.accelerator._zeroshard_run = self._zeroshard

    def _move_model_to_device(self, model, device):
        if _meta.on_meta(model):
            return  # zeroshard.hf.from_pretrained's model: the engine allocates this rank's share
        super()._move_model_to_device(model, device)

    # -- the engine --------------------------------------------------------------------------

    @property
    def engine(self):
        """The zeroshard.Engine this Trainer trains through (built at the first train, evaluate,
        predict or save)."""
        return self._zeroshard_engine()

    def _zeroshard_engine(self):
        run = self._zeroshard
        if run.engine is None:
            steps = self._zeroshard_steps if self._zeroshard_steps is not None else self._zeroshard_planned_steps()
            run.engine = self._zeroshard_build(steps)
            run.module = EngineModule(run.engine)
            self._zeroshard_built_steps = steps
        return run.engine

    def _zeroshard_planned_steps(self):
        # What train() will compute, for an engine built by an evaluate or save before it: the
        # Trainer's own rule, from its training dataloader.
        if self.train_dataset is None:
            return max(self.args.max_steps, 0)
        return self.set_initial_training_values(self.args, self.get_train_dataloader())[-1]

    def _zeroshard_build(self, max_steps):
        cfg = _config.trainer_config(self._zero_config, self.args, max_steps)
        groups = None
        if "optimizer" not in cfg:
            # As the plain Trainer: AdamW from the arguments, no weight decay on biases and norms.
            cfg["optimizer"] = {"type": "AdamW", "params": _config.adamw_from_args(self.args)}
            groups = self._zeroshard_param_groups()
        schedule = None
        if _config.uses_trainer_scheduler(cfg):
            def schedule(optimizer):
                return self._zeroshard_schedule(max_steps, optimizer)
        source = _pretrained.pending_load(self.model)
        engine = zeroshard.initialize(self.model, cfg, param_groups=groups, lr_scheduler=schedule,
                                      init_fn=source.init_fn if source is not None else None)
        if source is not None:
            source.load(engine)
        return engine

    def _zeroshard_param_groups(self):
        decay = set(self.get_decay_parameter_names(self.model))
        trained = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in trained if n in decay], "weight_decay": self.args.weight_decay},
                  {"params": [p for n, p in trained if n not in decay], "weight_decay": 0.0}]
        return [g for g in groups if g["params"]]

    def _zeroshard_schedule(self, max_steps, optimizer):
        # The Trainer's create_scheduler, built on the engine's optimizer; the engine steps it
        # after every optimizer step taken. self.lr_scheduler stays the view the loop reads.
        held, self.lr_scheduler = self.lr_scheduler, None
        try:
            return super().create_scheduler(max_steps, optimizer=optimizer)
        finally:
            self.lr_scheduler = held

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        # The engine's schedule is built once, for the steps of one train(): a second train() (or
        # one whose steps differ from those an earlier evaluate or save planned) would go on
        # with the first's schedule, which the plain Trainer rebuilds.
        if self._zeroshard_trained:
            raise RuntimeError("zeroshard.hf: train() was called a second time on this Trainer; its engine's "
                               "learning-rate schedule was built for the first run. Build a new Trainer (resume "
                               "with resume_from_checkpoint=) to train again")
        if self._zeroshard.engine is not None and self._zeroshard_built_steps != max_steps:
            raise RuntimeError(f"zeroshard.hf: the engine was built (by an evaluate, predict or save before train()) "
                               f"for {self._zeroshard_built_steps} optimizer steps, but train() runs {max_steps}: "
                               "the training data or arguments changed in between; build the Trainer again")
        self._zeroshard_trained = True
        self._zeroshard_steps = max_steps
        return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            self.optimizer = StepView(self._zeroshard_engine().optimizer)
        return self.optimizer

    def create_scheduler(self, num_training_steps, optimizer=None):
        if self.lr_scheduler is None:
            self._zeroshard_engine()
            self.lr_scheduler = ScheduleView(self._zeroshard)
            self._created_lr_scheduler = True
        return self.lr_scheduler

    def _wrap_model(self, model, training=True, dataloader=None):
        self._zeroshard_engine()
        return self._zeroshard.module

    # -- checkpoints ---------------------------------------------------------------------------

    def _save_optimizer_and_scheduler(self, output_dir):
        """checkpoint-N/: the engine's sharded checkpoint (weights, AdamW state, schedule; each rank
        writes its own shards) under global_step<N>/ with `latest`, as DeepSpeed's is, and the
        Trainer's scheduler.pt. A peft model's frozen base is left out (it is the pretrained
        model's), as the Trainer does under DeepSpeed."""
        self.engine.save_checkpoint(output_dir, tag=f"global_step{self.state.global_step}",
                                    exclude_frozen_parameters=is_peft_model(self.model))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER_NAME))

    def _save_checkpoint(self, model, trial):
        self._zeroshard_checkpointing = True
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._zeroshard_checkpointing = False

    def _save_scaler(self, output_dir):
        pass  # fp16's loss scale is in the engine's checkpoint

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        # train(resume_from_checkpoint=...) calls this before the engine exists, to read the
        # model's weights whole; the engine's checkpoint gives each rank its slices instead
        # (_load_optimizer_and_scheduler, once the engine is built).
        pass

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is None:
            return
        if not os.path.isfile(os.path.join(checkpoint, "latest")):
            raise FileNotFoundError(f"zeroshard.hf: {checkpoint} holds no zeroshard checkpoint (no 'latest' in it): "
                                    "resume from a checkpoint-N folder that zeroshard.hf's Trainer saved, or leave "
                                    "resume_from_checkpoint out")
        self.engine.load_checkpoint(checkpoint)
        self._zeroshard.last_step_lrs = None

    def _load_scaler(self, checkpoint):
        pass

    def _load_best_model(self):
        best = self.state.best_model_checkpoint
        if not os.path.isfile(os.path.join(best, "latest")):
            raise FileNotFoundError(f"zeroshard.hf: load_best_model_at_end: {best} holds no zeroshard checkpoint (no "
                                    "'latest' in it), so the best model cannot be reloaded")
        self.engine.load_checkpoint(best, load_optimizer_states=False, load_lr_scheduler_states=False)

    # -- the saved model ---------------------------------------------------------------------

    def save_model(self, output_dir=None, _internal_call=False):
        """A from_pretrained-ready folder: model.safetensors in the compute dtype (streamed by
        save_16bit_model: at stage 3 one unit is gathered at a time) and the model's config; for a
        peft model the adapter only (adapter_model.safetensors, adapter_config.json). At stage 3
        without zero_optimization.stage3_gather_16bit_weights_on_model_save, the sharded checkpoint
        instead, as the Trainer does under DeepSpeed. Every rank calls it (the Trainer does): a
        save_model() under `if trainer.is_world_process_zero():` waits for the other ranks."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        engine = self.engine
        if is_peft_model(self.model):
            saved = engine.save_16bit_model(output_dir, exclude_frozen_parameters=True)
        else:
            saved = engine.save_16bit_model(output_dir, "model.safetensors")
        # A checkpoint's own save writes the sharded checkpoint next anyway.
        if not saved and (not self._zeroshard_checkpointing or self.args.save_only_model):
            warnings.warn(f"zeroshard.hf: save_model wrote the sharded checkpoint to {output_dir} instead of the "
                          "model's weights (see the warning above)", stacklevel=2)
            engine.save_checkpoint(output_dir, exclude_frozen_parameters=is_peft_model(self.model))
        if self.args.should_save:
            self._zeroshard_save_beside(output_dir)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _zeroshard_save_beside(self, output_dir):
        # What save_pretrained writes beside the weights, and the Trainer's own files.
        model = self.accelerator.unwrap_model(self.model)
        if not is_peft_model(model):
            config = getattr(model, "config", None)
            if config is not None and hasattr(config, "save_pretrained"):
                config.save_pretrained(output_dir)
            generation = getattr(model, "generation_config", None)
            can_generate = getattr(model, "can_generate", None)
            if generation is not None and callable(can_generate) and can_generate():
                generation.save_pretrained(output_dir)
        tokenizer = self.processing_class
        if tokenizer is None:  # as the Trainer: the collator's tokenizer when no processing_class is given
            tokenizer = getattr(self.data_collator, "tokenizer", None)
        if tokenizer is not None:
            tokenizer.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, _TRAINING_ARGS_NAME))


def wrap(trainer_class):
    """The class `trainer_class` (transformers.Trainer or a subclass: TRL's SFTTrainer, DPOTrainer,
    a project's own) training through zeroshard: it takes zero_config= besides its own arguments.
    Every rank builds it, as with the plain Trainer under torchrun."""
    from transformers import Trainer as HfTrainer

    if not isinstance(trainer_class, type) or not issubclass(trainer_class, HfTrainer):
        raise TypeError(f"zeroshard.hf.wrap: {trainer_class!r} is not a transformers.Trainer class")
    if issubclass(trainer_class, ShardedTrainer):
        return trainer_class
    return type(f"Zeroshard{trainer_class.__name__}", (ShardedTrainer, trainer_class),
                {"__module__": ShardedTrainer.__module__, "__doc__": trainer_class.__doc__})
