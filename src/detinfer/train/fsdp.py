"""Data-parallel training of a `TrainableModel` with PyTorch's FSDP2 (`torch.distributed.fsdp.fully_shard`).

    dist.init_process_group("gloo" or "nccl", ...)       # one process per device
    model, _ = load_model(path, torch.float32, device, "deterministic")
    sharded = FSDPTrainer(TrainableModel(model))          # default group: torch.distributed's WORLD
    opt = adamw(sharded.parameters(), lr=1e-5, fused=False, foreach=False)   # each rank steps its fp32 shards
    ids, cu = pack(local_sequences(global_batch, sharded.group))   # each rank scores its own sequences
    (-(sharded.score(ids, cu) * adv).sum()).backward()   # this rank's share of the global loss sum
    opt.step()

What is sharded and how the bits stay those of one process:
  * Parameters: `fully_shard` on every decoder layer and on the trainer's `ScoringModule` (the root:
    embedding, final norm, output layer). Each rank keeps a dim-0 shard of every fp32 tensor (the master
    weights: the optimizer steps the shards), and FSDP all-gathers a layer's full tensors just before its
    forward (and again before its backward). An all-gather is a data move, so the forward computes with
    exactly the single-process weights: logprobs are bit for bit one process's (and the sampler's).
  * Gradients: FSDP reduce-scatters each layer's gradients after its backward. Its default collective
    (the library's reduce-scatter) adds the ranks' contributions in an order the library picks (ring or
    tree, by message size, on NCCL). `FixedOrderReduceScatter` replaces it: an all-to-all (a data move: rank
    r receives every rank's gradient of its shard) followed by a sum in rank order, g_0 + g_1 + ... +
    g_{P-1}, on every rank, for every message size. That is the order in which one process accumulates
    the same micro-batches' gradients (`.grad +=` per backward, micro-batch r = rank r's), so the reduced
    gradient equals one-process gradient accumulation bit for bit, at any world size. (At P = 2 any
    reduce-scatter gives these bits: one IEEE addition of two values is commutative. Beyond 2 ranks the
    order matters, hence the fixed order: measured, gloo's reduce-scatter is repeatable but at 3 and 4
    ranks a quarter to a half of the elements differ from the rank-order sum; docs/training.md.)
    FSDP's averaging is switched off (divide factor 1, SUM only):
    the loss each rank backpropagates is its share of the global sum, and dividing by P would be one more
    rounding for non-power-of-two P.
  * Optimizer: single-tensor AdamW (`optim.adamw(..., fused=False, foreach=False)`, the CPU default)
    updates each element with elementwise ops, so stepping shards equals stepping full tensors. (Fused
    AdamW on DTensor shards did not reproduce fused AdamW on full tensors, measured on CPU.)
  * The deterministic linear's memo of rounded weights is dropped at every scoring forward (see
    `FSDPTrainer.__init__`: FSDP rewrites gathered weights behind the memo's back).

`FixedOrderReduceScatter` implements FSDP's `ReduceScatter` comm interface, which torch 2.13 defines in
`torch.distributed.fsdp._fully_shard._fsdp_api` and accepts through the public
`FSDPModule.set_custom_reduce_scatter`; the class is not re-exported publicly, hence the private import.

Not bit-identical: the gradient of one packed global batch in a single backward. Its weight gradient
reduces all tokens in one accumulator (blocks of 64 tokens in order), while data parallelism sums per-rank
partial gradients; the two differ by float rounding (tests/train/test_fsdp.py bounds it).

16-bit models (a trainer with fp32 master weights, the default for them): the masters replace the 16-bit
weights in the module and are what FSDP shards (a fresh trainer has not made them yet: FSDPTrainer makes each
unit's just before sharding it, so the whole model's fp32 copy never exists on one device); FSDP's mixed
precision rounds each shard to the compute dtype before the all-gather (round to nearest even, elementwise:
exactly the weights `push_weights` gives a one-process engine), and the gathered 16-bit parameters get fp32
gradients (`grad_dtype`, as the one-process trainer's 16-bit weights do), reduced in fp32. So the bits are
those of the one-process trainer with master weights and `push_weights()` after every step.

Limits: no tensor parallelism (MoE layers shard their stacked experts like any parameter); a 16-bit model trained
without masters (master_weights=False) is refused;
`fully_shard` replaces the model's parameters with shards, so an engine on the same model cannot sample
until the full weights are copied back (`full_state_dict`); `TrainableModel.distributions` is not
available on the sharded trainer.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.tensor import DTensor

from detinfer.kernels.chunked_linear import forget_rounded_weights
from detinfer.train.model import TrainableModel

__all__ = ["FSDPTrainer", "FixedOrderReduceScatter", "local_sequences"]


class FixedOrderReduceScatter(ReduceScatter):
    """FSDP's reduce-scatter as an all-to-all plus a sum in rank order (see the module doc). The input is
    FSDP's flat [P * shard] buffer whose r-th block is destined for rank r."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False):
        if op != dist.ReduceOp.SUM:
            raise ValueError(f"FixedOrderReduceScatter sums only (FSDP's averaging must be off), got {op}")
        received = torch.empty_like(input_tensor)
        dist.all_to_all_single(received, input_tensor, group=group)  # block r: rank r's gradient of my shard
        parts = received.view(group.size(), -1)
        output_tensor.copy_(parts[0])
        for r in range(1, group.size()):
            output_tensor.add_(parts[r])  # rank order: the order of one-process gradient accumulation
        return None


def _check_group(group, device: torch.device) -> dist.ProcessGroup:
    if not dist.is_initialized():
        raise RuntimeError("FSDPTrainer needs torch.distributed initialized (dist.init_process_group with "
                           "'gloo' for CPU models or 'nccl' for CUDA models) in every rank's process")
    group = dist.group.WORLD if group is None else group
    if group is dist.GroupMember.NON_GROUP_MEMBER or (isinstance(group, dist.ProcessGroup)
                                                      and dist.get_rank(group) < 0):
        raise ValueError("this process is not a member of the given process group; pass a group that "
                         "contains every data-parallel rank, this one included")
    backend = dist.get_backend(group)
    wanted = "nccl" if device.type == "cuda" else "gloo"
    if backend != wanted:
        raise ValueError(f"the model is on {device.type}, which takes a {wanted!r} process group; the group's "
                         f"backend is {backend!r}")
    return group


def _check_trainer(trainer) -> None:
    if not isinstance(trainer, TrainableModel):
        raise TypeError(f"FSDPTrainer wraps a detinfer.train.TrainableModel, got {type(trainer).__name__}")
    params = list(trainer.model.parameters())
    if any(isinstance(p, DTensor) for p in params):
        raise ValueError("this model's parameters are already sharded (DTensors): wrap each model once")
    if not trainer.master_weights and any(p.dtype != torch.float32 for p in params):
        raise ValueError("FSDPTrainer shards fp32 master weights: a 16-bit model needs the trainer's fp32 "
                         "masters (TrainableModel(..., master_weights=True), the default for 16-bit models), "
                         f"got {sorted({str(p.dtype) for p in params if p.dtype != torch.float32})} parameters "
                         "trained directly")


def _made_masters_into_module(trainer: TrainableModel) -> torch.dtype | None:
    """A trainer whose fp32 masters of 16-bit weights already exist (it was used before being wrapped): put
    the masters into the module in place of the 16-bit tensors (they become the sharded parameters; the
    16-bit weights leave the module) and stop the trainer's gradient routing. -> the 16-bit compute dtype,
    or None when there are no masters."""
    if not trainer._pairs:
        return None
    compute = trainer._pairs[0][0].dtype
    trainer.close()
    by_id = {id(p): name for name, p in trainer.model.named_parameters()}
    for p, master in trainer._pairs:
        _replace_parameter(trainer.model, by_id[id(p)], master)
    trainer._pairs, trainer.master_weights = [], False  # the module's own parameters are the masters now
    return compute


def _replace_parameter(root: torch.nn.Module, name: str, new: torch.nn.Parameter) -> None:
    *path, leaf = name.split(".")
    owner = root
    for part in path:
        owner = getattr(owner, part)
    setattr(owner, leaf, new)


def _unit_masters_into_module(unit: torch.nn.Module, pending: dict[int, torch.nn.Parameter]) -> None:
    """Replace this unit's 16-bit parameters still in `pending` by fp32 copies (the masters, about to be
    sharded with the unit): one unit's full fp32 copy exists at a time, and each 16-bit tensor leaves the
    module (and memory) as its master takes its place."""
    for name, p in list(unit.named_parameters()):
        if pending.pop(id(p), None) is not None:
            _replace_parameter(unit, name, torch.nn.Parameter(p.detach().to(torch.float32).clone()))


def _fp32_grads_of_gathered(module: torch.nn.Module, _args) -> None:
    """Runs after FSDP's pre-forward gather: the gathered 16-bit parameters receive fp32 gradients (as the
    one-process trainer's 16-bit weights do), so no gradient is rounded to 16 bits before the fp32 sum."""
    for p in module.parameters():
        if not isinstance(p, DTensor) and p.dtype != torch.float32:
            p.grad_dtype = torch.float32


def local_sequences(sequences: Sequence, group: dist.ProcessGroup | None = None) -> list:
    """This rank's micro-batch of a global batch: the contiguous block `rank * n/P .. (rank + 1) * n/P`,
    so rank order is sequence order (the order of the fixed gradient sum). n must divide by P."""
    group = dist.group.WORLD if group is None else group
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    sequences = list(sequences)
    if len(sequences) % size:
        raise ValueError(f"a global batch of {len(sequences)} sequences does not split over {size} data-parallel "
                         f"ranks: give a multiple of {size} sequences (every rank scores the same number)")
    per = len(sequences) // size
    return sequences[rank * per:(rank + 1) * per]


class FSDPTrainer:
    """A `TrainableModel` whose parameters are FSDP2 shards over `group` (see the module doc).
    `reshard_after_forward`: free each layer's gathered weights after its forward and gather again for the
    backward (less memory, one more all-gather per layer; the bits do not depend on it)."""

    def __init__(self, trainer: TrainableModel, group: dist.ProcessGroup | None = None, *,
                 reshard_after_forward: bool = True):
        _check_trainer(trainer)
        device = trainer.model.embed_tokens.device
        self.group = _check_group(group, device)
        self.trainer = trainer
        self.compute_dtype = _made_masters_into_module(trainer)
        pending = {id(p): p for p in trainer.take_pending_masters()}  # masters not made yet: made per unit
        if pending:
            self.compute_dtype = next(iter(pending.values())).dtype
            trainer.close()
            trainer.master_weights = False  # the module's own parameters will be the masters
        mesh = DeviceMesh.from_group(self.group, device.type)
        comm = FixedOrderReduceScatter()
        # 16-bit compute: FSDP rounds each fp32 shard to the compute dtype before the all-gather (round to
        # nearest even, elementwise: the bits `push_weights` gives the engine), and the gradients stay fp32
        policy = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32,
                                      cast_forward_inputs=False)
        units = [*trainer.model.layers, trainer.scorer]  # the root (embedding, norm, output layer) last
        for unit in units:
            _unit_masters_into_module(unit, pending)
            fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        assert not pending, "every 16-bit parameter belongs to a decoder layer or the root unit"
        for unit in units:
            unit.set_gradient_divide_factor(1.0)
            unit.set_force_sum_reduction_for_comms(True)
            unit.set_custom_reduce_scatter(comm)
            if self.compute_dtype is not None:
                unit.register_forward_pre_hook(_fp32_grads_of_gathered)
        # The deterministic CPU linear memoizes each weight's rounded form, keyed by the tensor, its address
        # and its version counter. FSDP gathers each step's new weights into the same unsharded tensors, at
        # the same address, with the version counter preserved: the memo would serve last step's weights
        # (found as logprobs that differed after an optimizer step, at random: it needs the allocator to
        # give the same address). Forget it at the start of every scoring forward; within one forward and
        # its backward the gathered weights do not change.
        trainer.scorer.register_forward_pre_hook(lambda _module, _args: forget_rounded_weights())

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.group)

    def score(self, *args, **kwargs) -> torch.Tensor:
        """`TrainableModel.score` on this rank's tokens, with the full weights gathered for the forward."""
        return self.trainer.score(*args, **kwargs)

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """The fp32 DTensor shards (what the optimizer steps)."""
        return self.trainer.model.parameters()

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return self.trainer.model.named_parameters()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.trainer.zero_grad(set_to_none)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """{name: the full tensor}, gathered on every rank (a collective: every rank must call it), e.g. to
        copy into a sampler's engine or to compare with a one-process run."""
        return {n: p.detach().full_tensor() for n, p in self.named_parameters()}

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        """{name: the full reduced gradient} (a collective), None where a parameter got no gradient."""
        return {n: (None if p.grad is None else p.grad.full_tensor()) for n, p in self.named_parameters()}
