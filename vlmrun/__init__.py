"""vlmrun: train vision-language models on SLURM with SFT and GRPO.

Heavy libraries (torch, ray, energon, transformers) are imported inside the modules that need them,
so importing this package and running `vlmrun --help` stay fast on a login node.
"""

__version__ = "0.1.0"

from vlmrun.startup import pause_in_ray_workers as _pause_in_ray_workers

_pause_in_ray_workers()  # the collector is off while a Ray worker of ours imports and sets up (startup.py)
