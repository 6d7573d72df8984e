"""Data-parallel DP-SGD over torch.distributed: ``torchrun --nproc_per_node N -m dptrain train --config ...``.

How a step is shared (and why the privacy argument is the one-process argument):

- Every rank holds the same model and the same secret streams: rank 0 draws the run's entropy (or takes the seed)
  and broadcasts it once, so every rank draws the same Poisson batch of indices.
- The batch is cut into physical chunks exactly as one process cuts it; rank r computes the per-example gradients
  and the clipped sums of chunks r, r + N, r + 2N, ... Each chunk's clipped sum is a function of its own examples
  only (the clipping stage of one process, unchanged).
- One all-gather brings every chunk's clipped sum (and its clip statistics) to every rank, and each rank adds them
  up in chunk order: the same additions, in the same order, as one process makes, so the sum is bit for bit the
  one-process sum (an all-reduce would add in another order and round differently).
- Every rank then adds the same Gaussian noise, drawn from its copy of the same secret noise stream: the released
  noisy gradient is ONE value, identical on every rank, noised once; it is what one process would release. The
  optimizer step, identical everywhere, keeps the replicas equal.
- The chunk sums exchanged by the all-gather are clipped but not yet noised: they stay inside the job's processes
  (the trust boundary of one process's memory; with several machines, the network between them must be as trusted
  as that memory) and are never written.
- Every rank must hold the same run: before the first step of a start or a resume, the ranks compare SHA-256 hashes of
  their frozen config, their data's fingerprint and their whole trainer state (model, optimizer, secret streams,
  ledger, labels) and refuse, on every rank, a run whose ranks differ (:func:`agree`, :func:`agree_on`): a rank launched with another config or
  data file, or reading a file changed between the ranks' reads, would add to the release what the ledger does not
  describe.
- Rank 0 alone writes the run directory (ledger, metrics, checkpoints, summary); the other ranks read the
  checkpoint to resume. A rank that dies stops the job; ``--resume`` continues from the last checkpoint, and with
  ``seed`` set the run ends with the ledger and weights of the one-process run. A surviving rank stops in one of two
  ways, whichever comes first: its all-gather fails on the closed connection (:class:`dptrain.errors.RankLost`, exit
  2), or torchrun's agent, which polls its workers every 0.1 s, sends it SIGTERM (the run checkpoints its last
  complete step and says "interrupted", exit 143; a step that SIGTERM reached midway is rolled back first). Either
  leaves the same checkpoint; tests/test_distributed.py forces each order.

gloo on CPU, nccl on GPU (``training.device``).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
from dataclasses import dataclass

import numpy as np
import torch

from dptrain.errors import ConfigError, RankLost

_CURRENT: Group | None = None


def one_process(what: str) -> None:
    """Refuse ``what`` (a command, a search) launched by torchrun (WORLD_SIZE > 1): only training runs data parallel,
    its ranks agreeing on everything they release; anything else would run once per rank, each with its own secret
    draws (a search's number of trials, an audit's canaries) and its own outputs."""
    world = os.environ.get("WORLD_SIZE", "1").strip() or "1"
    if world != "1":
        raise ConfigError(
            f"{what} runs in one process (WORLD_SIZE is {world}: launched by torchrun); only dptrain train runs data "
            "parallel: run it without torchrun"
        )


def current() -> Group | None:
    """The group this process joined with :func:`from_environment` (None: a one-process run)."""
    return _CURRENT


@dataclass(frozen=True)
class Group:
    """This process's place in a data-parallel run."""

    rank: int
    world: int

    @property
    def main(self) -> bool:
        return self.rank == 0


def from_environment(device: str = "auto") -> Group | None:
    """The group of a ``torchrun`` launch (WORLD_SIZE > 1 in the environment), joined once; None otherwise."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world <= 1:
        return None
    import torch.distributed as dist

    if not dist.is_initialized():
        gpu = device != "cpu" and torch.cuda.is_available()
        dist.init_process_group(backend="nccl" if gpu else "gloo")
    if dist.get_world_size() != world:
        raise ConfigError(f"WORLD_SIZE is {world} but the process group has {dist.get_world_size()} ranks")
    global _CURRENT
    _CURRENT = Group(dist.get_rank(), world)
    return _CURRENT


def shared_entropy(group: Group | None, seed: int | None) -> int | None:
    """The run's entropy, the same on every rank: the seed (None is returned), or 128 secret bits drawn by rank 0 and
    broadcast (they never leave the job's processes). Broadcast whatever the seed: a rank launched with a seed and one
    without would otherwise wait in different collectives, for ever, before :func:`agree` could refuse them."""
    if group is None:
        return None
    import torch.distributed as dist

    box = [secrets.randbits(128) if group.main else None]
    dist.broadcast_object_list(box, src=0)
    return None if seed is not None else int(box[0])


def gather(group: Group, local: list) -> list:
    """Every rank's ``local`` items, concatenated in rank order (one all-gather)."""
    import torch.distributed as dist

    parts: list = [None] * group.world
    try:
        dist.all_gather_object(parts, local)
    except (RuntimeError, ConnectionError) as e:
        raise RankLost(
            f"another rank of this data-parallel run stopped during a step ({' '.join(str(e).split())[:120]}); "
            "nothing of the step was released: continue with torchrun ... dptrain train --resume DIR"
        ) from None
    return [item for part in parts for item in part]


def state_hash(value) -> str:
    """SHA-256 of a nested value (tensors, arrays, dicts, lists, tuples, numbers, strings, None): equal values, equal
    hashes, whatever the process that computed them."""
    h = hashlib.sha256()
    _feed(h, value)
    return h.hexdigest()


def _feed(h, value) -> None:
    if torch.is_tensor(value):
        value = value.detach().cpu().contiguous()
        h.update(f"t{value.dtype}{tuple(value.shape)}".encode())
        h.update(value.reshape(-1).view(torch.uint8).numpy().data)
    elif isinstance(value, np.ndarray):
        _feed(h, torch.from_numpy(np.ascontiguousarray(value)))
    elif isinstance(value, dict):
        h.update(f"d{len(value)}".encode())
        for key in sorted(value, key=repr):
            _feed(h, key)
            _feed(h, value[key])
    elif isinstance(value, list | tuple):
        h.update(f"l{len(value)}".encode())
        for item in value:
            _feed(h, item)
    else:
        h.update(f"{type(value).__name__}:{value!r};".encode())


def agree(group: Group | None, parts: dict[str, object]) -> None:
    """Refuse, on every rank, a data-parallel run whose ranks hold different ``parts`` (the frozen config, the data's
    fingerprint, the model, the optimizer, the secret streams, the ledger...). The privacy argument (module docstring)
    needs every rank to clip the same examples of the same data at the same clip norm, with the same model, and to
    draw the same noise: a rank launched with another config, another data file (or the file changed between the
    ranks' reads) or another checkpoint would add to the release what the ledger does not describe. One all-gather of
    hashes (they stay inside the job's processes)."""
    if group is None:
        return
    mine = {name: state_hash(value) for name, value in parts.items()}
    everyone = gather(group, [mine])
    differ = [name for name in parts if len({d[name] for d in everyone}) > 1]
    if differ:
        ranks = sorted({r for r, d in enumerate(everyone) for name in differ if d[name] != everyone[0][name]})
        raise ConfigError(
            f"the ranks of this data-parallel run disagree on: {', '.join(differ)} (rank "
            f"{', '.join(map(str, ranks))} against rank 0): every rank must run the same config on the same data from "
            "the same checkpoint; nothing was trained or released"
        )


def agree_on(trainer) -> None:
    """Before a trainer's first step in this process, and its first after loading a checkpoint, the ranks of its
    data-parallel run compare what the step's arithmetic reads (:func:`agree`), on every path (``dptrain train``,
    ``make_private`` under torchrun): the whole state but torch's global generators (model, optimizer and its
    hyperparameters, secret streams, ledger, labels), the release it records (noise multiplier, sampling rate, data
    set size, clip norm), how a batch is cut into chunks and their per-example gradients computed, and the training
    examples themselves where they are tensors in memory."""
    if trainer.group is None or trainer.agreed:
        return
    state = trainer.state_dict()
    state.pop("torch_rng"), state.pop("cuda_rng", None)
    data = trainer.data
    examples = (data.inputs, data.labels) if hasattr(data, "inputs") else len(data)
    agree(trainer.group, {
        **state, "release": trainer.release_event(), "chunks": trainer.max_physical_batch_size,
        "per-example gradients": trainer.grad_sampler.name, "training examples": examples,
    })
    trainer.agreed = True


def barrier(group: Group | None) -> None:
    if group is not None:
        import torch.distributed as dist

        dist.barrier()


class FollowerDirectory:
    """The run directory as a rank other than 0 sees it: it reads (the checkpoint, the config), never writes, and
    takes no lock (rank 0 holds it)."""

    def __init__(self, directory):
        self._directory = directory

    def __truediv__(self, name: str):
        return self._directory / name

    def __getattr__(self, name):
        if name in ("write_text", "write_json", "save_model", "save_checkpoint", "append_metrics", "truncate_metrics"):
            return lambda *args, **kwargs: None
        if name in ("refuse_if_holding", "check_ledger_copy", "check_metrics_copy"):
            return lambda *args, **kwargs: None
        return getattr(self._directory, name)

    @contextlib.contextmanager
    def locked(self, create: bool = False):
        yield self


__all__ = [
    "FollowerDirectory", "Group", "agree", "agree_on", "barrier", "current", "from_environment", "gather", "shared_entropy",
    "state_hash",
]
