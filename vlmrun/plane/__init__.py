"""The data plane: how bulk tensors move between the stages of a step.

interface.py is the seam algorithms talk to; fields.py names every field once; wire/ turns ragged
per-sample values into flat rows (one torch.nested jagged tensor per field in transit); rows.py is the
protocol over any store; local.py and transfer_queue/ are the adapters; adapters.open_plane picks one.
"""
