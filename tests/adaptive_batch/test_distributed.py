import copy
import json
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from adaptive_batch import PeerOutOfMemoryError, RankGroup
from adaptive_batch.distributed import MAX_MEMORY_ENV, rank_max_memory
from adaptive_batch.probe.lockstep import LockstepTrial
from adaptive_batch.probe.search import search_max_batch_size
from adaptive_batch.run.step import accumulate_gradients

MiB = 2**20


def test_rank_max_memory_is_the_config_value_without_the_variable():
    assert rank_max_memory("1GiB", env={}) == "1GiB"
    assert rank_max_memory(None, env={MAX_MEMORY_ENV: " "}) is None


def test_rank_max_memory_takes_one_value_or_this_local_rank_s():
    assert rank_max_memory(None, env={MAX_MEMORY_ENV: "20GiB"}) == "20GiB"
    env = {MAX_MEMORY_ENV: "70GiB, 40GiB", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert rank_max_memory("1GiB", env=env) == "40GiB"
    assert rank_max_memory(None, capacity_bytes=1000, env={MAX_MEMORY_ENV: "0.5"}) == "0.5"


def test_rank_max_memory_rejects_a_wrong_count_or_a_bad_value():
    env = {MAX_MEMORY_ENV: "1GiB,2GiB,3GiB", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    with pytest.raises(ValueError, match="lists 3 values for 2 ranks on this node"):
        rank_max_memory(None, env=env)
    with pytest.raises(ValueError, match=f"{MAX_MEMORY_ENV}.*'lots'.*cannot be parsed"):
        rank_max_memory(None, env={MAX_MEMORY_ENV: "lots"})
    with pytest.raises(ValueError, match="larger than the device"):
        rank_max_memory(None, capacity_bytes=MiB, env={MAX_MEMORY_ENV: "2MiB"})


def test_one_process_agrees_with_itself():
    ranks = RankGroup(torch.device("cpu"))
    assert (ranks.distributed, ranks.world_size, ranks.rank, ranks.is_main) == (False, 1, 0, True)
    assert (ranks.max(3), ranks.any(False), ranks.any(True)) == (3, False, True)
    assert ranks.sums(2.5, torch.tensor(4), 1) == [2.5, 4.0, 1.0]
    assert ranks.broadcast({"a": 1}) == {"a": 1} and ranks.gather(7) == [7]


def test_a_lockstep_trial_of_one_process_is_the_trial():
    ranks = RankGroup(torch.device("cpu"))
    trial = LockstepTrial(ranks, lambda b: 100 + 10 * b, budget_bytes=150, common_budget_bytes=150)
    assert trial(2) == 120 and trial(6) == 160

    def out_of_memory(b):
        torch.empty(1 << 62, dtype=torch.uint8)  # a real allocator failure

    failing = LockstepTrial(ranks, out_of_memory, budget_bytes=150, common_budget_bytes=150)
    with pytest.raises(PeerOutOfMemoryError, match="batch_size=3 ran out of memory \\(this rank: .*DefaultCPUAllocator"):
        failing(3)
    assert trial.report()["trials"][1] == {"batch_size": 6, "peak_bytes": 160, "oom": False, "fits_here": False}
    assert failing.trials[0].oom and failing.trials[0].peak_bytes is None


BUDGETS = {0: 400 * MiB, 1: 200 * MiB}


def _peak(batch_size):
    return 50 * MiB + 20 * MiB * batch_size


def _lockstep_search(rank, out_dir):
    ranks = RankGroup(torch.device("cpu"))

    def run_trial(batch_size):
        if rank == 1 and batch_size >= 8:
            torch.empty(1 << 62, dtype=torch.uint8)
        return _peak(batch_size)

    common = min(ranks.gather(BUDGETS[rank]))
    trial = LockstepTrial(ranks, run_trial, budget_bytes=BUDGETS[rank], common_budget_bytes=common)
    result = search_max_batch_size(trial, budget_bytes=trial.common_budget_bytes, max_batch_size=64)
    return {"max": result.max_batch_size, "tried": [t.batch_size for t in result.trials], "mine": trial.report()}


class Linear:
    """A model whose forward-backward runs out of memory on rank 1 for micro-batches over 3."""

    def __init__(self, rank):
        torch.manual_seed(0)
        self.rank = rank
        self.model = torch.nn.Linear(4, 1)

    def forward_backward(self, batch):
        if self.rank == 1 and batch["tokens"].shape[0] > 3:
            torch.empty(1 << 62, dtype=torch.uint8)
        loss = self.model(batch["tokens"]).sum()
        loss.backward()
        return loss.detach(), torch.tensor(batch["tokens"].shape[0])


def _retry_together(rank, out_dir):
    ranks = RankGroup(torch.device("cpu"))
    setup = Linear(rank)
    batch = {"tokens": torch.arange(24, dtype=torch.float32).reshape(6, 4) + rank}
    step = accumulate_gradients(
        setup.forward_backward, batch, rows=6, micro_batch_limit=6, zero_grad=lambda: setup.model.zero_grad(set_to_none=True),
        agree_on_oom=ranks.any,
    )
    reference = torch.nn.Linear(4, 1)
    reference.load_state_dict(setup.model.state_dict())
    reference.zero_grad()
    reference(batch["tokens"]).sum().backward()
    return {
        "sizes": step.micro_batch_sizes,
        "retries": step.oom_retries,
        "messages": step.oom_messages,
        "grad_matches": torch.allclose(setup.model.weight.grad, reference.weight.grad),
    }


def _norm_layer_noise(rank, out_dir):
    """Each rank's per-example norm-layer gradients and its share of the reduced step gradient,
    against one process that runs both ranks' samples."""
    from torch import nn

    from adaptive_batch.schedule.norm_layer_gradients import NormLayerGradients

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 1))
    alone = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(2, 6, 3, 4, generator=g), torch.randn(2, 6, 3, generator=g)  # [rank, sample, token, ...]

    def estimate(net, batch, ranks, reduce):
        observer = NormLayerGradients(net, lambda piece: torch.full((piece["x"].shape[0],), 3))
        observer.attach()

        def forward_backward(piece):
            loss = (net(piece["x"]).squeeze(-1) - piece["y"]).pow(2).sum()
            loss.backward()
            return loss.detach(), torch.tensor(piece["y"].numel())

        rows = batch["x"].shape[0]
        accumulate_gradients(forward_backward, batch, rows=rows, micro_batch_limit=3,
                             zero_grad=lambda: net.zero_grad(set_to_none=True), observer=observer)
        if reduce:  # FSDP2's reduce-scatter: the ranks' mean, each rank holding its half
            for p in net.parameters():
                dist.all_reduce(p.grad)
                p.grad /= ranks.world_size
                half = p.grad.view(-1)[ranks.rank * p.numel() // 2 : (ranks.rank + 1) * p.numel() // 2].clone()
                p.grad.zero_().view(-1)[ranks.rank * p.numel() // 2 : (ranks.rank + 1) * p.numel() // 2] = half
        return observer.step_noise(ranks)

    mine = estimate(model, {"x": x[rank], "y": y[rank]}, RankGroup(torch.device("cpu")), reduce=True)
    both = estimate(alone, {"x": x.flatten(0, 1), "y": y.flatten(0, 1)}, RankGroup.alone(), reduce=False)
    return {"ranks": [mine.estimate.trace, mine.estimate.gradient_sq, mine.tokens],
            "alone": [both.estimate.trace, both.estimate.gradient_sq, both.tokens]}


def _smallest(rank, out_dir):
    """Each rank's own answer agreed on, then a probe that fails on rank 1 alone."""
    ranks = RankGroup(torch.device("cpu"))
    agreed = ranks.smallest(lambda: [12, 5][rank])

    def fails_on_rank_1():
        if rank == 1:
            raise MemoryError("batch 1 does not fit")
        return 9

    try:
        ranks.smallest(fails_on_rank_1)
        error = None
    except BaseException as e:  # what each rank raised, by type and message
        error = [type(e).__name__, str(e)]
    return {"agreed": agreed, "error": error}


SCENARIOS = {"lockstep_search": _lockstep_search, "retry_together": _retry_together, "norm_layer_noise": _norm_layer_noise,
             "smallest": _smallest}


def _worker(rank, world_size, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world_size)
    try:
        result = {name: scenario(rank, out_dir) for name, scenario in SCENARIOS.items()}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """Every scenario's results on each of two real ranks (gloo), from one launch."""
    out = tmp_path_factory.mktemp("two_ranks")
    mp.spawn(_worker, args=(2, str(out)), nprocs=2, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def run_two_ranks(scenario, results):
    return [rank[scenario] for rank in results]


def test_lockstep_search_ends_at_the_smallest_rank_s_largest_fit(two_ranks):
    rank0, rank1 = run_two_ranks("lockstep_search", two_ranks)
    # 50 MiB + 20 MiB x b within rank 1's 200 MiB: 7; rank 0 alone would fit 17.
    assert rank0["max"] == rank1["max"] == 7
    assert rank0["tried"] == rank1["tried"]
    assert any(t["fits_here"] and t["batch_size"] > 7 for t in rank0["mine"]["trials"])
    assert not any(t["oom"] for t in rank0["mine"]["trials"])
    assert [t["oom"] for t in rank1["mine"]["trials"]] == [t["batch_size"] >= 8 for t in rank1["mine"]["trials"]]
    assert any(t["oom"] for t in rank1["mine"]["trials"])


def test_ranks_take_the_smallest_answer_and_stop_together_when_one_rank_s_probe_fails(two_ranks):
    rank0, rank1 = run_two_ranks("smallest", two_ranks)
    assert rank0["agreed"] == rank1["agreed"] == 5
    # the failing rank raises its own error; the other one, not left waiting, says which rank failed
    assert rank1["error"] == ["MemoryError", "batch 1 does not fit"]
    assert rank0["error"][0] == "ConfigError" and "rank 1's probe failed" in rank0["error"][1]


def test_one_process_s_smallest_answer_is_its_own_and_its_error_is_raised():
    ranks = RankGroup(torch.device("cpu"))
    assert ranks.smallest(lambda: 7) == 7
    with pytest.raises(MemoryError, match="no room"):
        ranks.smallest(lambda: (_ for _ in ()).throw(MemoryError("no room")))


def test_an_out_of_memory_error_on_one_rank_splits_the_step_on_both(two_ranks):
    rank0, rank1 = run_two_ranks("retry_together", two_ranks)
    assert rank0["sizes"] == rank1["sizes"] == [3, 3]
    assert rank0["retries"] == rank1["retries"] == 1
    assert "another rank" in rank0["messages"][0] and "DefaultCPUAllocator" in rank1["messages"][0]
    assert rank0["grad_matches"] and rank1["grad_matches"]


def test_the_norm_layer_noise_scale_on_two_ranks_is_one_process_s_on_all_their_samples(two_ranks):
    rank0, rank1 = run_two_ranks("norm_layer_noise", two_ranks)
    assert rank0["ranks"] == pytest.approx(rank1["ranks"], rel=1e-9)  # every rank reads the same sums
    assert rank0["ranks"] == pytest.approx(rank0["alone"], rel=1e-4)
    assert rank0["ranks"][2] == 36  # 12 samples of 3 tokens



@pytest.mark.parametrize("code, rc, err", [(None, 0, ""), (3, 3, ""), ("error: batch_size=0 ...", 1, "error: batch_size=0 ...\n")])
def test_a_rank_exits_with_the_runs_code_its_lines_flushed_and_no_teardown(code, rc, err):
    import subprocess
    import sys

    script = (
        "import atexit, logging, sys\n"
        "from adaptive_batch.distributed import exit_past_teardown\n"
        "logging.basicConfig(stream=sys.stdout, format='%(message)s', level=logging.INFO)\n"
        "atexit.register(lambda: print('teardown ran'))\n"
        "logging.info('last line')\n"
        "print('buffered', end='')\n"
        f"exit_past_teardown({code!r})\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert (run.returncode, run.stdout, run.stderr) == (rc, "last line\nbuffered", err)


def test_a_ranks_error_line_is_one_write_so_ranks_on_one_pipe_cannot_interleave_it(monkeypatch):
    """Two ranks' error lines once came out as one line, "error: ...error: ...": print writes
    the text and its newline apart, and the other rank's line fell between them."""
    import adaptive_batch.distributed as distributed

    writes = []
    monkeypatch.setattr(distributed.os, "write", lambda fd, data: writes.append((fd, data)) or len(data))
    monkeypatch.setattr(distributed.os, "_exit", lambda code: writes.append(("exit", code)))
    monkeypatch.setattr("logging.shutdown", lambda: None)  # this worker's log handlers stay open
    distributed.exit_past_teardown("error: rank 1: batch size 1 does not fit")
    assert writes == [(2, b"error: rank 1: batch size 1 does not fit\n"), ("exit", 1)]
