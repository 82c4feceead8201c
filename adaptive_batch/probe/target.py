"""What a probe is handed, checked before any step runs: one :class:`ProbeTarget` (the step, the
batch maker, the training state it changes, the device), on a device this torch has, with a batch
maker that builds the size it is asked for. A bad one is one line naming the argument."""

from contextlib import contextmanager
from dataclasses import dataclass, replace
import io
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from adaptive_batch.batch_tensors import tensors_of
from adaptive_batch.errors import ConfigError
from adaptive_batch.memory.budget import state_tensors
from adaptive_batch.probe.snapshot import TrainingStateSnapshot
from adaptive_batch.rng import rng_state, set_rng_state
from adaptive_batch.validation import check_callable

MAKE_BATCH_EXAMPLE = "lambda n: torch.randn(n, 3, 224, 224)"


@dataclass
class ProbeTarget:
    """What a probe trains: every trial, check and timing takes this one record.

    Attributes:
        train_step: one full training step on a batch (forward, loss, backward, optimizer step).
        make_batch: the worst-case batch of a given size.
        model: the model ``train_step`` trains.
        optimizer: its optimizer, if the step keeps state.
        device: where the step runs; the model's when ``None`` (:meth:`on_its_device`).
        lr_scheduler: put back with the model and optimizer after the probe, when given.
        held: tensors the run keeps beside the model and optimizer through every step (a noise
            scale's copy of the gradients), counted with them.
    """

    train_step: Callable[[Any], None]
    make_batch: Callable[[int], Any]
    model: nn.Module
    optimizer: Optional[torch.optim.Optimizer] = None
    device: Optional[torch.device] = None
    lr_scheduler: Optional[Any] = None
    held: Tuple[torch.Tensor, ...] = ()

    def state_tensors(self) -> List[torch.Tensor]:
        """The tensors the run keeps between steps: the model's, its gradients, the optimizer's
        state and :attr:`held` (a soft budget once missed a noise scale's copy of the gradients,
        and training at the answer passed ``max_memory`` by it)."""
        return state_tensors(self.model, self.optimizer) + list(self.held)

    def on_its_device(self) -> "ProbeTarget":
        """This target, checked, with its device resolved (:func:`step_device`).

        Raises:
            ConfigError: for a ``train_step`` or ``make_batch`` that cannot be called, a ``model``
                that is no ``nn.Module``, an ``optimizer`` that is no torch optimizer; see
                :func:`step_device`.
        """
        check_callable("train_step", self.train_step, "lambda batch: ... (forward, backward, optimizer step)")
        check_callable("make_batch", self.make_batch, MAKE_BATCH_EXAMPLE)
        check_model_and_optimizer(self.model, self.optimizer, trained_by="train_step")
        if self.lr_scheduler is not None and not all(
                callable(getattr(self.lr_scheduler, name, None)) for name in ("state_dict", "load_state_dict")):
            raise ConfigError(f"lr_scheduler={self.lr_scheduler!r} has no state_dict() and load_state_dict() to put it "
                              "back with: pass the torch LR scheduler the step advances, or None.")
        device = step_device(self.model, self.device)
        if device.type not in ("cpu", "cuda"):
            raise ConfigError(f"device={str(device)!r}: the probe measures memory on 'cpu' and 'cuda' devices only; "
                              "probe on one of those.")
        return replace(self, device=device)

    def snapshot(self, directory: Optional[str] = None) -> TrainingStateSnapshot:
        """A context that saves the model, optimizer, scheduler and RNG and puts them back."""
        return TrainingStateSnapshot(self.model, self.optimizer, self.lr_scheduler, directory=directory)


def check_model_and_optimizer(model: Any, optimizer: Any, *, trained_by: str, optimizer_required: bool = False) -> None:
    """Raises:
    ConfigError: for a model that is no ``nn.Module``, or an optimizer that is no torch optimizer
        (or none, where one is required)."""
    if not isinstance(model, nn.Module):
        raise ConfigError(f"model={model!r} is not a torch.nn.Module: pass the module {trained_by} trains.")
    if (optimizer is not None or optimizer_required) and not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"optimizer={optimizer!r} is not a torch.optim.Optimizer: pass the optimizer over the "
                          f"parameters {trained_by} trains (its state is put back after a probe)"
                          + ("." if optimizer_required else ", or None."))


@contextmanager
def other_optimizers_put_back(target: ProbeTarget) -> Iterator[None]:
    """Inside the block, an optimizer ``train_step`` steps over parameters that are not
    ``target.model``'s is refused before it steps: the probe puts back only the model, so the
    trials would leave those parameters changed (a GAN's discriminator came out 10 steps on).
    Any other optimizer over the model's own parameters (a second one over some of them, as a
    GAN's discriminator in one ``nn.ModuleDict`` with its generator; a Lookahead's inner one; one
    per parameter stepped in backward) steps, and its state is put back when the block ends: a
    discriminator's Adam came out 8 steps on.

    Raises:
        ConfigError: from that optimizer's step, naming it and the fix.
    """
    own = {id(p) for p in target.model.parameters()}
    saved: Dict[int, Tuple[torch.optim.Optimizer, bytes]] = {}

    def refuse_or_keep(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if optimizer is target.optimizer or id(optimizer) in saved or _fake(optimizer):
            return
        outside = sum(id(p) not in own for group in optimizer.param_groups for p in group["params"])
        if outside:
            raise ConfigError(
                f"train_step steps {type(optimizer).__name__} over {outside} parameters that are not "
                f"model={type(target.model).__name__}'s: the probe puts back only the model and its optimizers, so "
                "the trials would leave them changed; pass a model holding every module train_step trains (an "
                "nn.ModuleDict of them), or probe each part apart."
            )
        # Serialized bytes, not tensors: a copy would count in the trial it is taken in.
        state = io.BytesIO()
        torch.save(optimizer.state_dict(), state)
        saved[id(optimizer)] = (optimizer, state.getvalue())

    handle = register_optimizer_step_pre_hook(refuse_or_keep)
    try:
        yield
    finally:
        handle.remove()
        for optimizer, state in saved.values():
            # This process's own bytes: any state an optimizer holds (an LR as a numpy float) loads.
            optimizer.load_state_dict(torch.load(io.BytesIO(state), weights_only=False))


def _fake(optimizer: torch.optim.Optimizer) -> bool:
    """An optimizer of the planner's fake steps (fake or meta parameters), which hold nothing."""
    first = next((p for group in optimizer.param_groups for p in group["params"]), None)
    return first is not None and (first.is_meta or isinstance(first, FakeTensor))


def step_device(model: nn.Module, device: Optional[Union[str, torch.device]]) -> torch.device:
    """Where the step runs: ``device``, or the model's when ``None``.

    Raises:
        ConfigError: for a model without parameters and no ``device``, a model with parameters
            on the meta device, or a device this torch does not have (CUDA on a CPU-only build,
            an index past the last card).
    """
    meta = next((name for name, p in model.named_parameters() if p.is_meta), None)
    if meta is not None:
        raise ConfigError(
            f"model={type(model).__name__}'s parameter {meta!r} is on the meta device, which holds no memory to "
            "measure and no values to train: materialize the model first (load its weights, or "
            "model.to_empty(device=...) and initialize them), then probe."
        )
    if device is None:
        first = next(model.parameters(), None)
        if first is None:
            raise ConfigError(
                f"model={type(model).__name__} has no parameters, so nothing says where its step runs and there is "
                "nothing to train: pass the model train_step trains, or device=torch.device(...)."
            )
        device = first.device
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device={device!r} is not a device ({e}); use e.g. 'cpu' or 'cuda:0'.") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ConfigError(
                f"device={str(device)!r}: this torch ({torch.__version__}) sees no CUDA device; use device='cpu', "
                "or run where a card and a CUDA build of torch are."
            )
        if device.index is not None and device.index >= count:
            raise ConfigError(f"device={str(device)!r}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}.")
    return device


def _shapes(batch: Any) -> List[Tuple[int, ...]]:
    return [tuple(leaf.shape) for leaf in tensors_of(batch)]


class BatchesOfTheirSize:
    """``make_batch``, refusing a batch of the same shapes as one it built at another size: one
    that ignores its size had every trial measure the same batch and "find" the cap, and one that
    stops growing (``data[:b]`` past the data's end) a "largest fit" of 2**60, after 64 trials.

    Raises:
        ConfigError: (from a call) naming both sizes.
    """

    def __init__(self, make_batch: Callable[[int], Any]) -> None:
        self.make_batch = make_batch
        self._sizes: Dict[Tuple[Tuple[int, ...], ...], int] = {}

    def __call__(self, batch_size: int) -> Any:
        batch = self.make_batch(batch_size)
        shapes = tuple(_shapes(batch))
        other = self._sizes.setdefault(shapes, batch_size) if shapes else batch_size
        if other != batch_size:
            smaller, larger = sorted((other, batch_size))
            raise ConfigError(
                f"make_batch: make_batch({smaller}) and make_batch({larger}) built tensors of the same shapes "
                f"({list(shapes[:3])}): it must build a batch of the size it is given (a slice past the data's end "
                f"stops growing), e.g. make_batch={MAKE_BATCH_EXAMPLE}."
            )
        return batch


def check_make_batch(make_batch: Callable[[int], Any]) -> BatchesOfTheirSize:
    """Refuses a batch maker whose batches of 1 and 2 samples are the same shape, before any step.

    Returns:
        The maker, refusing the same at any later size (:class:`BatchesOfTheirSize`).

    Raises:
        ConfigError: when they are.
    """
    sized = BatchesOfTheirSize(make_batch)
    rng = rng_state()  # a batch maker may draw random numbers; the run's draws stay its own
    try:
        sized(1)
        sized(2)
    finally:
        set_rng_state(rng)
    return sized
