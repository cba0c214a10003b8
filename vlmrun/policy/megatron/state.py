"""The megatron backend's checkpoint state, its export, and its moves to host memory.

1. A checkpoint holds pieces of HF tensors (`Storage.PIECES`, checkpoint/parts.py): the first replica's
   ranks write (data-parallel replicas hold the same state), writer `tp_rank + tp * pp_rank`, each its
   pieces of the model and of AdamW's moments by HF name (mapping.py), a replicated tensor by tensor-
   parallel rank 0 alone, the tied head's copy never; the optimizer part also holds AdamW's step, its
   hyper-parameters and the LR schedule. Views of the live tensors: nothing is copied until written.
2. A load takes, for every parameter, the pieces its map names from whichever writers hold them: each
   HF tensor whole from the writers' pieces (in their tensor-parallel order), then this rank's piece
   (`mapping.piece`) in this layout. At the layout that wrote it, every value comes back bit for bit;
   any other tp x pp reads it as well (`vlmrun resume --restart-data-order --set parallel.tp=...`).
3. The export is the same read in one process: every HF tensor whole, into the HF model built from
   the run's model directory, saved as a transformers model directory.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from vlmrun.checkpoint.parts import MODEL_PART, OPTIMIZER_PART, POLICY_PARTS, PieceFiles, PolicyState, Storage
from vlmrun.models.spec import ModelSpec
from vlmrun.policy.megatron.mapping import ParamMap, piece, whole

MOMENTS = ("exp_avg", "exp_avg_sq")


def _own_pieces(policy, tensor_of: Callable[[torch.nn.Parameter], torch.Tensor | None]) -> dict:
    """{HF name: this rank's piece} of `tensor_of(parameter)` over the stage's maps (a replicated tensor on tp rank 0
    only, the tied copy never)."""
    params = policy.built.params_by_name()
    out: dict[str, torch.Tensor] = {}
    for m in policy.built.maps:
        if m.copy or (m.split is None and policy.coords.tp != 0):
            continue
        t = tensor_of(params[m.mcore])
        if t is not None:
            out |= {n: v.detach() for n, v in m.to_hf(t).items()}
    return out


def checkpoint_state(policy) -> PolicyState:
    """This rank's pieces of the model and of AdamW's state, its writer index on the first replica."""
    from vlmrun.policy.optimizer import allocate_state

    allocate_state(policy.optimizer)
    c, r = policy.coords, policy.ranks
    splits = {n: m.split for m in policy.built.maps for n in m.hf}
    head = {"tp": r.tp, "tp_rank": c.tp, "splits": splits}
    state = policy.optimizer.state
    moments = {k: _own_pieces(policy, lambda p, k=k: state[p][k] if p in state else None) for k in MOMENTS}
    # every parameter has a gradient at every step (grads.py gives zeros), so one step count serves all
    step = state[policy.params[0]]["step"] if policy.params else torch.zeros(())
    groups = [{k: v for k, v in g.items() if k != "params"} for g in policy.optimizer.state_dict()["param_groups"]]
    return PolicyState(
        Storage.PIECES,
        {
            MODEL_PART: {**head, "pieces": _own_pieces(policy, lambda p: p)},
            OPTIMIZER_PART: {
                **head,
                "moments": moments,
                "step": step.detach(),
                "param_groups": groups,
                "scheduler": policy.scheduler.state_dict(),
            },
        },
        writer=c.tp + r.tp * c.pp if c.dp == 0 else None,
    )


class WholeTensors:
    """Every HF tensor of one part, whole, from the writers' pieces, in tensor-parallel order; `key` picks the
    pieces' dict in each writer's state (e.g. ("pieces",) or ("moments", "exp_avg"))."""

    def __init__(self, files: PieceFiles, key: tuple[str, ...]):
        self.where: dict[str, list[tuple[int, torch.Tensor]]] = {}
        self.splits: dict[str, int | None] = {}
        self.first: dict | None = None
        for i in range(len(files)):
            state = files.load(i)
            self.first = self.first or state
            self.splits |= state["splits"]
            pieces = state
            for k in key:
                pieces = pieces[k]
            for name, t in pieces.items():
                self.where.setdefault(name, []).append((state["tp_rank"], t))

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self.where:
            raise KeyError(f"the checkpoint holds no piece of {name}")
        pieces = [t for _, t in sorted(self.where[name], key=lambda item: item[0])]
        return whole(pieces, self.splits[name])


def load_checkpoint_state(policy, state: PolicyState) -> None:
    """Each parameter (and AdamW's moments) from the HF tensors its map names, cut for this layout."""
    if state.storage is not Storage.PIECES:
        raise ValueError(f"the megatron backend reads its own checkpoints (pieces), not {state.storage.value} ones")
    params = policy.built.params_by_name()
    tp, tp_rank = policy.ranks.tp, policy.coords.tp
    model = state.parts.get(MODEL_PART)
    if model is not None:
        read = WholeTensors(model, ("pieces",))
        with torch.no_grad():
            for m in policy.built.maps:
                params[m.mcore].copy_(_local(m, read, tp_rank, tp))
    optimizer = state.parts.get(OPTIMIZER_PART)
    if optimizer is not None:
        _load_optimizer(policy, optimizer, params)


def _local(m: ParamMap, read: Callable[[str], torch.Tensor], tp_rank: int, tp: int) -> torch.Tensor:
    return m.from_hf({n: piece(read(n), m.split, tp_rank, tp) for n in m.hf})


def _load_optimizer(policy, files: PieceFiles, params: dict) -> None:
    tp, tp_rank = policy.ranks.tp, policy.coords.tp
    reads = {k: WholeTensors(files, ("moments", k)) for k in MOMENTS}
    first = reads[MOMENTS[0]].first
    index = {id(p): i for i, p in enumerate(policy.params)}
    loaded = {}
    for m in policy.built.maps:
        entry = {k: _local(m, reads[k], tp_rank, tp) for k in MOMENTS}
        entry["step"] = first["step"].clone()
        loaded[index[id(params[m.mcore])]] = entry
    groups = [dict(g, params=[i for i in range(len(policy.params))]) for g in first["param_groups"]]
    policy.optimizer.load_state_dict({"state": loaded, "param_groups": groups})
    policy.scheduler.load_state_dict(first["scheduler"])


def offload(policy, parts: tuple[str, ...]) -> int:
    """The parts' tensors to host memory (policy/host_offload.py): the model part is the stage's
    parameters and buffers and the reference stage's; the optimizer part AdamW's state."""
    from vlmrun.policy.host_offload import HostCopies

    unknown = set(parts) - set(POLICY_PARTS)
    if unknown:
        raise ValueError(f"parts {sorted(unknown)} are not policy parts ({', '.join(POLICY_PARTS)})")
    if getattr(policy, "_host", None) is None:
        policy._host = HostCopies()
    tensors: list[torch.Tensor] = []
    if MODEL_PART in parts:
        for stage in (policy.stage, getattr(policy, "_reference", None)):
            if stage is not None:
                tensors += [*stage.parameters(), *stage.buffers()]
    if OPTIMIZER_PART in parts:
        tensors += [t for s in policy.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    return policy._host.move(tensors, policy.device)


def export(spec: ModelSpec, read: Callable[[PolicyState], PolicyState], out: Path) -> None:
    """A transformers model directory (config, generation config, safetensors in the
    spec's dtype) with the processor, tokenizer and chat template of the spec's directory."""
    from vlmrun.models.build import build_model, quiet_transformers, save_model_directory

    with quiet_transformers():
        model = build_model(spec)
        files = read(PolicyState(Storage.PIECES, {MODEL_PART: None})).parts[MODEL_PART]
        tensors = WholeTensors(files, ("pieces",))
        state = model.state_dict()
        tied = {n for n in state if n not in tensors.where}
        with torch.no_grad():
            for name, target in state.items():
                if name in tensors.where:
                    target.copy_(tensors(name))
        model.tie_weights()
        if tied - {"lm_head.weight"}:
            raise KeyError(f"the checkpoint holds no piece of {sorted(tied)[:3]}")
        save_model_directory(model, spec, out)
