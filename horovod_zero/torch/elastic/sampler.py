"""ElasticSampler: a DistributedSampler whose partition follows the job's size, and that
remembers how far the epoch went, so that after a reset the samples not yet processed
are split among the ranks of the new job."""

import math
import random

import torch

from horovod_zero.torch.basics import rank, size


class ElasticSampler(torch.utils.data.Sampler):
    """Put it in the TorchState, call record_batch(batch_idx, batch_size) after each
    batch and set_epoch(epoch) at the end of each epoch (not at its start: a partly
    processed epoch would then start over). shuffle=True orders the indices by
    `seed + epoch`, the same on every rank."""

    def __init__(self, dataset, shuffle=True, seed=0):
        self.dataset = dataset
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.processed_num = 0  # samples of this epoch processed by the whole job
        self.reset()

    def set_epoch(self, epoch):
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx, batch_size):
        """One batch of batch_size samples per rank is done."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self):
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict):
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def reset(self):
        """Splits what is left of the epoch among hvd.size() ranks."""
        self.num_replicas, self.rank = size(), rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = order[self.processed_num:]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self):
        # Padded by repeating the indices from the start, so that every rank takes as many.
        left = self.remaining_indices
        padded = (left * math.ceil(self.total_size / len(left)))[:self.total_size] if left else []
        return iter(padded[self.rank:self.total_size:self.num_replicas])

    def __len__(self):
        return self.num_samples
