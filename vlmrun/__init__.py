"""vlmrun: train vision-language models on SLURM with SFT and GRPO.

Importing the package does nothing but define it: heavy libraries (torch, ray, energon, transformers)
are imported inside the modules that need them, so `vlmrun --help` stays fast on a login node, and no
module changes the interpreter (its garbage collector included) when imported. The processes that want
a collector policy ask for it (vlmrun/startup.py).
"""

__version__ = "0.1.0"
