"""A user's model for the tests that signal or kill a search mid-trial: the tiny study's MLP, whose forward
sleeps ``SLOWMLP_DELAY`` seconds (read from the environment when the factory is called; 0 by default), and, where
``SLOWMLP_WHILE`` names a file, only while that file exists, looked at on every forward (a test creates it just
before the trial its signal is for, and removes it once the signal has landed: the trials before and after run
fast).

The tests need trials that last seconds in wall time so that a signal lands inside one; with the delay they do
without spending the CPU that thousands of real steps would, and the same study without it runs the same
arithmetic fast (an uninterrupted reference search, or the resumed one)."""

import os
import time

import torch
from torch import nn


class SlowMLP(nn.Module):
    def __init__(self, hidden: int, delay: float, while_file: str = ""):
        super().__init__()
        self.fc1, self.fc2, self.delay, self.while_file = nn.Linear(28 * 28, hidden), nn.Linear(hidden, 10), delay, while_file

    def forward(self, x):
        if self.delay and (not self.while_file or os.path.exists(self.while_file)):
            time.sleep(self.delay)
        return self.fc2(torch.relu(self.fc1(x.flatten(1))))


def make(hidden: int = 16) -> nn.Module:
    return SlowMLP(hidden, float(os.environ.get("SLOWMLP_DELAY", "0")), os.environ.get("SLOWMLP_WHILE", ""))
