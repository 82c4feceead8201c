"""Decisions every data-parallel rank must take together, and the per-rank memory budget.

With FSDP every forward and backward runs collectives (all-gather, reduce-scatter), so ranks
must run the same steps in the same order: the same trial batch sizes while probing, the same
number of micro-batches in a step, the same batch after growth. :class:`RankGroup` gives the few
agreements the recipes need: a maximum, sums, an "any rank", a broadcast from rank 0, a gather. Outside
``torch.distributed`` (one process) every agreement is the value itself, so the single-device
recipes run the same code.

:mod:`adaptive_batch.probe.lockstep` builds the probe's agreement on these.
"""

import os
from typing import Any, Callable, List, Mapping, Optional, Tuple, Type

import torch
import torch.distributed as dist

from adaptive_batch.errors import ConfigError
from adaptive_batch.memory.device import parse_memory

MAX_MEMORY_ENV = "ADAPTIVE_BATCH_MAX_MEMORY"

def rank_max_memory(
    config_value: Any, *, capacity_bytes: Optional[int] = None, env: Optional[Mapping[str, str]] = None
) -> Any:
    """This process's ``max_memory``: the config's, unless ``ADAPTIVE_BATCH_MAX_MEMORY`` is set.

    The variable holds one value for every rank of the node (``"20GiB"``), or a comma-separated
    list indexed by ``LOCAL_RANK`` (``"70GiB,40GiB"``) for cards of different sizes in one node.

    Args:
        config_value: the config's ``max_memory``.
        capacity_bytes: this rank's device capacity, to check the value against.
        env: the environment (``os.environ`` when ``None``).

    Raises:
        ValueError: for a list whose length is not the node's rank count, or a bad value.
    """
    env = os.environ if env is None else env
    raw = env.get(MAX_MEMORY_ENV)
    if raw is None or raw.strip() == "":
        return config_value
    values = [v.strip() for v in raw.split(",")]
    if len(values) > 1:
        local_rank = int(env.get("LOCAL_RANK", "0"))
        local_world = int(env.get("LOCAL_WORLD_SIZE", str(len(values))))
        if len(values) != local_world:
            raise ValueError(
                f"{MAX_MEMORY_ENV}={raw!r} lists {len(values)} values for {local_world} ranks on this "
                "node: give one value, or one per local rank."
            )
        value = values[local_rank]
    else:
        value = values[0]
    parse_memory(value, capacity_bytes=capacity_bytes, key=f"{MAX_MEMORY_ENV} (this rank's value of {raw!r})")
    return value


def check_same_world_size(written_by: int, world_size: int, what: str) -> None:
    """Refuses to resume ``what`` (a checkpoint's path or name) written by another number of
    ranks: the data shards and random generators are per rank.

    Raises:
        ConfigError: naming both counts and the launch that resumes it.
    """
    if written_by != world_size:
        raise ConfigError(
            f"resume_from_checkpoint=True: {what} was written by {written_by} ranks and this run has {world_size}; "
            f"resume with --nproc_per_node {written_by}, or start a new output_dir."
        )


class RankGroup:
    """The data-parallel ranks of a run (the default process group), or this process alone.

    Args:
        device: where collective tensors live (the CUDA device for NCCL, the CPU for gloo).
    """

    def __init__(self, device: torch.device) -> None:
        self.distributed = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size() if self.distributed else 1
        self.rank = dist.get_rank() if self.distributed else 0
        self.device = device if self.distributed and dist.get_backend() == "nccl" else torch.device("cpu")

    @classmethod
    def alone(cls) -> "RankGroup":
        """This process by itself, even inside a process group: for a probe each rank runs on
        its own (``find_max_batch_size``), whose answers the caller agrees on if it wants."""
        group = cls.__new__(cls)
        group.distributed, group.world_size, group.rank, group.device = False, 1, 0, torch.device("cpu")
        return group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def max(self, value: int) -> int:
        """The largest ``value`` over ranks."""
        if not self.distributed:
            return int(value)
        t = torch.tensor([int(value)], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def max_each(self, values: List[int]) -> List[int]:
        """Each of ``values`` maximised over ranks, in one all-reduce."""
        if not self.distributed:
            return [int(v) for v in values]
        t = torch.tensor([int(v) for v in values], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return [int(v) for v in t.tolist()]

    def sums(self, *values: Any) -> List[float]:
        """Each of ``values`` (numbers or one-element tensors) summed over ranks, in one
        all-reduce (as float64)."""
        if not self.distributed:
            return [float(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank."""
        return self.max(int(bool(flag))) == 1

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (picklable objects)."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj: Any) -> List[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if not self.distributed:
            return [obj]
        out: List[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def decide_on_main(self, decide: Callable[[], Any], errors: Tuple[Type[BaseException], ...] = ()) -> Any:
        """Runs ``decide`` on rank 0 alone and hands its result to every rank.

        Raises:
            BaseException: an error of one of ``errors`` that ``decide`` raised on rank 0 is
                raised on every rank, so all of them stop together with the same message.
        """
        result, error = None, None
        if self.is_main:
            try:
                result = decide()
            except errors as e:
                error = e
        if self.distributed:
            result, error = self.broadcast((result, error))
        if error is not None:
            raise error
        return result

    def smallest(self, answer: Callable[[], int]) -> int:
        """Runs ``answer`` (this rank's own probe) on every rank and returns the smallest result,
        which data-parallel ranks all train. A rank whose ``answer`` raised still joins the
        agreement, so no rank is left waiting in it for one that has gone.

        Raises:
            Exception: ``answer``'s error, on the rank it happened on (an interrupt, at once).
            ConfigError: on every other rank, naming the rank that failed.
        """
        try:
            mine, error = int(answer()), None
        except Exception as e:  # re-raised below, once every rank knows (a Ctrl-C ends this rank at once)
            mine, error = 0, e
        failed, negated = self.max_each([self.rank + 1 if error is not None else 0, -mine])
        if error is not None:
            raise error
        if failed:
            raise ConfigError(f"rank {failed - 1}'s probe failed (its log says why): every rank stops with it.")
        return -negated

    def check_together(self, check: Callable[[], Any]) -> Any:
        """Runs ``check`` on every rank; when it fails on any rank, every rank stops together.

        Returns:
            What ``check`` returned on this rank.

        Raises:
            ConfigError: on every rank, with the message of the first rank whose ``check``
                raised ``ValueError`` (a ``ConfigError`` included), so no rank is left waiting
                in a collective for one that has gone.
        """
        result, error = None, None
        try:
            result = check()
        except ValueError as e:
            error = str(e)
        for rank, message in enumerate(self.gather(error)):
            if message is not None:
                raise ConfigError(f"rank {rank}: {message}" if self.distributed else message)
        return result


def exit_past_teardown(code: Any) -> None:
    """Ends a distributed process with ``code`` (what ``sys.exit`` takes) without the
    interpreter's teardown.

    A rank of a finished run once died at exit with SIGABRT ("terminate called without an
    active exception") after every rank had saved and destroyed the process group: gloo's
    threads destructed during the interpreter's finalization. Nothing of the run is left to
    write by then, so the run's outcome is its exit code, not torch's teardown: the message is
    printed, the streams and the logs are flushed, and the process ends here.
    """
    import logging
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    if code is not None and not isinstance(code, int):
        # one write(2) for a line under PIPE_BUF bytes: ranks sharing a pipe cannot interleave within it
        line = f"{code}\n".encode()
        while line:
            line = line[os.write(2, line):]
        code = 1
    os._exit(code or 0)
