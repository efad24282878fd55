"""Helpers shared by the tests of rlcore.algos: a garbage pad value, a float64 comparison, a
plain-Python whitening reference."""

import statistics

import torch

PAD = 1e6  # garbage at masked positions: any leak shows up at once


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=torch.float64),
                               torch.as_tensor(expected, dtype=torch.float64), atol=atol, rtol=1e-5)


def whiten_ref(values):
    """Reference whitening of a flat list: (x - mean) / unbiased std."""
    mean, std = statistics.mean(values), statistics.stdev(values)
    return [(v - mean) / std for v in values]
