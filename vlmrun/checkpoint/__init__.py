"""Checkpoints: everything a run needs to continue bit for bit, and the one owner of their layout.

    parts.py     the parts of a checkpoint and the file each goes to; the policy's storage kinds
    manifest.py  the typed manifest (format, step, every file's digest, the run that wrote it)
    files.py     files hashed as they are written; the seal that makes them durable
    write.py     the writers' side: a pending checkpoint and the policy's (possibly background) write
    read.py      verify a folder against its manifest; read its parts back
    legacy.py    the layouts of older formats (1-3), read through the same calls
    store.py     one run's checkpoints in one folder: begin, finish, latest, retention, damage
    owner.py     which run a checkpoint folder belongs to
    copies.py    a copied run directory: a fork with checkpoints of its own, or refused
    lease.py     readers hold a checkpoint so that the run's retention cannot delete it under them
    saving.py    the step loop's checkpoint in flight: writes waited for, the seal behind the next steps

The package sits below everything that trains, launches or exports (the layers in pyproject.toml) and
imports only `run`, `config` and `errors` of vlmrun. Importing it loads no torch.
"""
