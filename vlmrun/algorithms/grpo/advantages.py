"""Group-normalized advantages: each response's reward against the other responses to its prompt.

Rows are prompt-major (row i*G + g is response g to prompt i, as the generation backend returns
them). A = (r - mean of the group) / (std of the group + eps), the std over the G rewards (not the
unbiased estimate); without `normalize_std` only the mean is taken off. A group whose rewards are all
equal gets advantage 0 everywhere: it teaches nothing.
"""

from __future__ import annotations

import torch

EPS = 1e-6


def group_advantages(rewards: torch.Tensor, group_size: int, *, normalize_std: bool = True) -> torch.Tensor:
    """Advantages (float32, shape of `rewards`) of prompt-major `rewards` [N], N a multiple of `group_size`."""
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    groups = rewards.float().view(-1, group_size)
    centered = groups - groups.mean(dim=1, keepdim=True)
    if normalize_std:
        centered = centered / (groups.std(dim=1, keepdim=True, correction=0) + EPS)
    return centered.reshape(-1)
