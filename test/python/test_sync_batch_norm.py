"""hvd.SyncBatchNorm on CPU ranks (Gloo), with uneven batches per rank, against
torch.nn.BatchNorm2d over the whole batch in one process (sync_bn_check.py)."""

import pytest
import torch

import horovod_zero.torch as hvd
import sync_bn_check


def test_sync_batch_norm_matches_batch_norm_over_the_whole_batch(ranks):
    for errs, eval_err, tracked in ranks.run(sync_bn_check.run, "cpu"):
        for dx, dw, stats, y in errs:
            assert max(dx, dw, stats, y) < 1e-10, errs
        assert eval_err < 1e-12 and tracked == 2


def test_sync_batch_norm_refuses_a_1d_input():
    with pytest.raises(ValueError, match=r"\(N, C, \.\.\.\)"):
        hvd.SyncBatchNorm(3)(torch.zeros(3))
