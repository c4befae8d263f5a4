"""The training dataloader deepspeed.initialize(training_data=...) returns, as DeepSpeed builds it
(deepspeed/runtime/dataloader.py): micro batches of train_micro_batch_size_per_gpu, this rank's
part of the data through a DistributedSampler (shuffled, seed 0, and as in DeepSpeed
set_epoch is left to the script: every pass has the same order unless it calls
`loader.data_sampler.set_epoch(epoch)`) and drop_last from the config's dataloader_drop_last.

Unlike DeepSpeed's (two worker processes), it loads in the training process unless given
num_local_io_workers: workers cannot start from a daemonic process (a launcher's, a test
harness's), and the order of the batches does not depend on them."""

import math

import torch
from torch.utils.data import DataLoader, DistributedSampler


class DeepSpeedDataLoader:
    def __init__(self, dataset, batch_size, rank, world_size, drop_last=False, collate_fn=None,
                 num_local_io_workers=None, data_sampler=None):
        if not ((hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__"))
                or isinstance(dataset, torch.utils.data.IterableDataset)):
            raise ValueError("zeroshard.deepspeed: training_data must be a torch Dataset, "
                             f"not {type(dataset).__name__}")
        self.dataset = dataset
        self.batch_size = batch_size
        self.collate_fn = collate_fn
        self.dataloader_drop_last = drop_last
        self.num_local_io_workers = num_local_io_workers or 0
        self.data_sampler = data_sampler or DistributedSampler(dataset, num_replicas=world_size, rank=rank)
        # Pinned host memory speeds copies to a GPU and means nothing without one.
        self.pin_memory = torch.cuda.is_available()
        samples = len(self.data_sampler)
        self.len = samples // batch_size if drop_last else math.ceil(samples / batch_size)
        self.data = None

    def __len__(self):
        return self.len

    def __iter__(self):
        self.dataloader = DataLoader(self.dataset, batch_size=self.batch_size, sampler=self.data_sampler,
                                     collate_fn=self.collate_fn, num_workers=self.num_local_io_workers,
                                     pin_memory=self.pin_memory, drop_last=self.dataloader_drop_last)
        self.data = iter(self.dataloader)
        return self

    def __next__(self):
        return next(self.data)


class RepeatingLoader:
    """Iterates a loader forever, starting it again when it ends (deepspeed.utils.RepeatingLoader)."""

    def __init__(self, loader):
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)
