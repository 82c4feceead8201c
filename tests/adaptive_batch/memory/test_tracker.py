import gc

import pytest
import torch

from adaptive_batch.memory.tracker import LiveTensorCounter, live_tensor_bytes, measure_peak_bytes


def test_counts_the_peak_of_live_tensors_not_the_sum():
    def step():
        a = torch.ones(1024, 1024)  # 4 MiB
        b = torch.ones(1024, 1024)  # 4 MiB more: peak 8 MiB
        del a, b
        c = torch.ones(512, 1024)  # 2 MiB after both are gone
        del c

    peak = measure_peak_bytes(step, torch.device("cpu"))
    assert peak == 8 * 1024**2


def test_baseline_tensors_count_once_and_views_share_storage():
    w = torch.zeros(1024, 256)  # 1 MiB
    view = w[:10]
    assert live_tensor_bytes([w, view, w.t()]) == 1024**2
    peak = measure_peak_bytes(lambda: torch.ones(256, 1024) + 0, torch.device("cpu"), [w, view])
    # w (1 MiB) + ones (1 MiB) + the sum (1 MiB)
    assert peak == 3 * 1024**2


def test_freed_storages_are_uncounted():
    counter = LiveTensorCounter()
    with counter:
        x = torch.ones(1024, 1024)
        assert counter.live_bytes == 4 * 1024**2
        del x
        gc.collect()
    assert counter.live_bytes == 0
    assert counter.peak_bytes == 4 * 1024**2


def test_backward_and_optimizer_state_are_counted():
    model = torch.nn.Linear(256, 256)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(64, 256)
    params = live_tensor_bytes(model.parameters())

    def step():
        model(x).pow(2).sum().backward()
        opt.step()

    peak = measure_peak_bytes(step, torch.device("cpu"), list(model.parameters()) + [x])
    # parameters + gradients + two Adam moments at least
    assert peak >= 4 * params


def test_a_failed_step_leaves_nothing_alive(limited_address_space):
    def failing_step():
        activations = torch.ones(1024, 1024)  # noqa: F841  (alive when the next line fails)
        torch.empty(1024**3, dtype=torch.uint8)

    counter = LiveTensorCounter()
    with limited_address_space(100 * 1024**2):
        try:
            with counter:
                failing_step()
        except RuntimeError:
            pass
    gc.collect()
    assert counter.peak_bytes == 4 * 1024**2
    assert counter.live_bytes == 0


@pytest.mark.parametrize(
    "vocab_size,tie",
    [(259, False), (151_936, True)],  # the tiny config's byte vocabulary; Qwen2.5's, tied
    ids=["vocab259", "vocab152k"],
)
def test_operator_lines_from_batch_2_and_3_predict_the_peak_at_8(vocab_size, tie):
    from adaptive_batch.memory.estimator import OperatorMemoryEstimate
    from tests.adaptive_batch.conftest import one_layer_qwen, real_step_memory

    measure = real_step_memory(*one_layer_qwen(vocab_size, tie), vocab_size)
    measure(1)  # the optimizer state exists from here on
    two, three, eight = measure(2), measure(3), measure(8)
    assert set(eight.phase_peak_bytes) == {"forward", "backward", "optimizer"}
    assert eight.peak_bytes == max(eight.phase_peak_bytes.values()) and max(eight.timeline) <= eight.peak_bytes
    lines = OperatorMemoryEstimate.fit((2, two.timeline), (3, three.timeline), (two.operators, three.operators))
    assert abs(lines.peak_bytes(8) - eight.peak_bytes) / eight.peak_bytes < 0.01


def test_a_dtensor_counts_its_local_shard_not_its_global_size():
    # Under FSDP2 every parameter and optimizer state is a DTensor; counted at its global size,
    # a rank's peak came out larger than what it held, and the distributed probe found less.
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import torch, torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Shard
        from adaptive_batch.memory.tracker import LiveTensorCounter, live_tensor_bytes
        dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
        mesh = init_device_mesh("cpu", (4,))
        shard = DTensor.from_local(torch.zeros(250, 10), mesh, [Shard(0)])
        assert shard.shape == (1000, 10)
        assert live_tensor_bytes([shard]) == 10_000, live_tensor_bytes([shard])
        with LiveTensorCounter(device_type="cpu") as counter:
            doubled = shard * 2
        assert counter.peak_bytes == 10_000, counter.peak_bytes
        print("ok")
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-2000:]


def test_a_storage_resized_in_place_counts_at_its_new_size():
    # ``UntypedStorage.resize_`` is no operator: no dispatch mode sees it.
    original = torch.UntypedStorage.resize_
    counter = LiveTensorCounter()
    with counter:
        held = torch.ones(1024, 1024)  # 4 MiB
        held.untyped_storage().resize_(0)  # freed, as FSDP2 frees an unsharded parameter
        assert counter.live_bytes == 0
        other = torch.ones(1024, 1024)
        held.untyped_storage().resize_(other.untyped_storage().nbytes())  # allocated again
        assert counter.live_bytes == 8 * 1024**2
        del other
        gc.collect()
    assert counter.peak_bytes == 8 * 1024**2 and counter.live_bytes == 4 * 1024**2
    assert torch.UntypedStorage.resize_ is original


def test_resizes_reach_the_counters_of_their_own_thread_and_the_method_comes_back():
    import threading

    original = torch.UntypedStorage.resize_
    outer, inner = LiveTensorCounter(), LiveTensorCounter()
    with pytest.raises(RuntimeError, match="a step that failed"):
        with outer, inner:  # nested, and left by an exception
            torch.ones(256).untyped_storage().resize_(4096)
            raise RuntimeError("a step that failed")
    assert outer.peak_bytes == inner.peak_bytes == 4096 and torch.UntypedStorage.resize_ is original

    # a counter on another thread, entered first and left last, sees none of this thread's resizes
    entered, leave = threading.Event(), threading.Event()
    elsewhere = LiveTensorCounter()

    def other_thread():
        with elsewhere:
            entered.set()
            leave.wait(30)

    thread = threading.Thread(target=other_thread)
    thread.start()
    entered.wait(30)
    with LiveTensorCounter() as here:
        torch.ones(256).untyped_storage().resize_(8192)
    leave.set()
    thread.join(30)
    assert here.peak_bytes == 8192 and elsewhere.peak_bytes == 0
    assert torch.UntypedStorage.resize_ is original


class _EveryStorageReRead(LiveTensorCounter):
    """The truth by brute force: after every operator, the current size of every storage seen."""

    exact_peak_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        live = (ref() for ref in list(self._refs.values()))
        self.exact_peak_bytes = max(self.exact_peak_bytes, sum(s.nbytes() for s in live if s is not None))
        return out


def test_under_fsdp2_the_peak_holds_only_the_layers_unsharded_at_the_time():
    """FSDP2 frees each layer's unsharded parameters by resizing their storage to 0: counted at
    their first size, a rank's peak held every layer unsharded (9.4 MB over a 4-layer Llama's
    true peak on 2 ranks), and the distributed probe answered below what fits."""
    from torch.distributed.fsdp import fully_shard

    from adaptive_batch.probe.fake_step import fake_process_group

    torch.manual_seed(0)
    with fake_process_group(2) as mesh:  # real tensors; the collectives send nothing
        model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(6)))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters())

        def step():
            model(torch.randn(8, 256)).sum().backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        step()
        state = [v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)]
        counter = _EveryStorageReRead(baseline=[*model.parameters(), *state])
        with counter:
            step()
    assert counter.exact_peak_bytes > 0 and counter.peak_bytes == counter.exact_peak_bytes
