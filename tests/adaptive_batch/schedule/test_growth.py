import textwrap

from omegaconf import OmegaConf
import pytest
from torchtune import config

from adaptive_batch import (
    BatchIncreaseFunctionError,
    ConfigError,
    double_every_epoch,
    linear_ramp,
    multiply_every,
    step_increments,
)
from adaptive_batch.schedule.growth import (
    GrowthOptions,
    call_batch_increase_function,
    grow_batch_size,
    resolve_batch_increase_function,
)


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module of the user's, outside the repository, on sys.path."""
    (tmp_path / "my_schedules.py").write_text(
        textwrap.dedent(
            """
            LIMIT = 64

            def grow(epoch, current_batch_size):
                return 2 if epoch >= 1 else 0

            def one_arg(epoch):
                return 1

            def with_default(epoch, current_batch_size, step=3):
                return step

            def returns_float(epoch, current_batch_size):
                return 1.5

            def returns_bool(epoch, current_batch_size):
                return True

            def returns_negative(epoch, current_batch_size):
                return -1

            def returns_none(epoch, current_batch_size):
                pass

            def raises(epoch, current_batch_size):
                raise KeyError("no table entry")

            def interrupts(epoch, current_batch_size):
                raise KeyboardInterrupt

            class Schedules:
                @staticmethod
                def nested(epoch, current_batch_size):
                    return 1
            """
        )
    )
    (tmp_path / "broken_schedules.py").write_text("1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_schedules"


def test_resolves_a_user_function_by_dotted_path(user_module):
    fn = resolve_batch_increase_function("my_schedules.grow")
    assert fn(0, 4) == 0 and fn(1, 4) == 2
    assert resolve_batch_increase_function("my_schedules.Schedules.nested")(0, 1) == 1
    assert resolve_batch_increase_function("my_schedules.with_default")(0, 1) == 3
    assert resolve_batch_increase_function("adaptive_batch.double_every_epoch") is double_every_epoch


@pytest.mark.parametrize(
    "path,message",
    [
        ("grow", "is not a dotted path"),
        ("no_such_module.grow", "no module 'no_such_module' can be imported"),
        ("my_schedules.grw", "module 'my_schedules' has no attribute 'grw'"),
        ("my_schedules.LIMIT", "is an int, not a function"),
        ("my_schedules.one_arg", "cannot be called as f(epoch, current_batch_size)"),
        ("broken_schedules.grow", "importing 'broken_schedules' failed: ZeroDivisionError"),
    ],
)
def test_bad_paths_name_the_path_and_the_fix(user_module, path, message):
    with pytest.raises(ConfigError) as info:
        resolve_batch_increase_function(path)
    assert message in str(info.value) and f"batch_increase_function={path!r}" in str(info.value)


@pytest.mark.parametrize(
    "name,message",
    [
        ("returns_float", "returned 1.5 (float)"),
        ("returns_bool", "returned True (bool)"),
        ("returns_none", "returned None (NoneType)"),
        ("returns_negative", "returned -1; the batch only grows"),
        ("raises", "raised KeyError: 'no table entry'; fix the function"),
        # was a traceback: KeyboardInterrupt is no Exception (a real Ctrl-C is a signal the recipe notes)
        ("interrupts", "raised KeyboardInterrupt: ; fix the function"),
    ],
)
def test_bad_returns_name_epoch_and_batch(user_module, name, message):
    fn = resolve_batch_increase_function(f"my_schedules.{name}")
    with pytest.raises(BatchIncreaseFunctionError) as info:
        call_batch_increase_function(fn, 3, 16)
    assert message in str(info.value)
    assert "epoch=3, current_batch_size=16" in str(info.value)
    assert f"my_schedules.{name}" in str(info.value)


def test_growth_is_clamped_to_the_bound_and_never_shrinks():
    add4 = linear_ramp(4)
    d = grow_batch_size(add4, epoch=1, current_batch_size=8, bound=10)
    assert (d.requested, d.batch_size, d.clamped) == (12, 10, True)
    d = grow_batch_size(add4, epoch=1, current_batch_size=4, bound=10)
    assert (d.batch_size, d.clamped) == (8, False)
    # a bound already below the batch (lowered after an out-of-memory) stops growth
    d = grow_batch_size(add4, epoch=1, current_batch_size=12, bound=10)
    assert d.batch_size == 12
    assert grow_batch_size(add4, epoch=1, current_batch_size=8, bound=None).batch_size == 12


def test_built_ins():
    steps = step_increments(epochs=[1, 3], increments=[4, 8])
    assert [steps(e, 2) for e in range(5)] == [0, 4, 0, 8, 0]
    ramp = linear_ramp(increment=3, every_n_epochs=2)
    assert [ramp(e, 2) for e in range(5)] == [0, 0, 3, 0, 3]
    double = multiply_every(factor=2)
    assert [double(e, 5) for e in range(3)] == [0, 5, 5]
    assert multiply_every(1.5, every_n_epochs=1)(1, 5) == 3  # round(7.5) - 5 (banker's: 8 - 5)
    assert [double_every_epoch(e, 6) for e in range(2)] == [0, 6]


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: step_increments([1, 2], [4]), "2 epochs but 1 increments"),
        (lambda: step_increments([1, 1], [4, 4]), "must be distinct non-negative ints"),
        (lambda: step_increments([1], [-4]), "must be non-negative ints"),
        (lambda: linear_ramp(-1), "the increment must be an int >= 0"),
        (lambda: linear_ramp(2, every_n_epochs=0), "the interval an int >= 1"),
        (lambda: multiply_every(0.5), "the factor must be a finite number >= 1"),
        (lambda: multiply_every(float("nan")), r"multiply_every\(factor=nan"),
        (lambda: multiply_every(float("inf")), r"multiply_every\(factor=inf"),
    ],
)
def test_built_in_factories_reject_bad_parameters(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_component_node_builds_a_parameterised_built_in():
    node = OmegaConf.create({"_component_": "adaptive_batch.multiply_every", "factor": 2, "every_n_epochs": 2})
    fn = resolve_batch_increase_function(config.instantiate(node))
    assert [fn(e, 4) for e in range(5)] == [0, 0, 4, 0, 4]
    node = OmegaConf.create({"_component_": "adaptive_batch.step_increments", "epochs": [2], "increments": [6]})
    assert config.instantiate(node)(2, 4) == 6


def test_growth_options():
    opts = GrowthOptions(batch_increase_function="adaptive_batch.double_every_epoch", grow_with_accumulation=True)
    assert opts.batch_increase_function is double_every_epoch and opts.grow_with_accumulation
    # left unset, retrying follows the config: torchtune's optimizer_in_bwd configs were refused
    assert opts.retry_on_oom is None and opts.retries_oom(optimizer_in_bwd=False)
    assert not opts.retries_oom(optimizer_in_bwd=True)
    assert not GrowthOptions(retry_on_oom=False).retries_oom(False) and GrowthOptions(retry_on_oom=True).retries_oom(True)
    off = GrowthOptions(retry_on_oom=False)
    assert off.batch_increase_function is None and not off.retry_on_oom and not off.grow_with_accumulation


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(grow_with_accumulation="yes"), "grow_with_accumulation='yes' must be true or false"),
        (dict(retry_on_oom=1), "retry_on_oom=1 must be true or false"),
        (dict(batch_increase_function="nosuch_module.grow"), "no module 'nosuch_module' can be imported"),
        (dict(batch_increase_function=5), "is an int, not a function"),
    ],
)
def test_bad_growth_options(changes, message):
    with pytest.raises(ConfigError) as info:
        GrowthOptions(**changes)
    assert message in str(info.value)


def test_linear_rampup_follows_the_boundary_index_and_holds_at_the_end():
    from adaptive_batch import linear_rampup

    ramp = linear_rampup(start_batch_size=4, final_batch_size=16, ramp_intervals=4)
    sizes, current = [], 2  # configured under the start: boundary 0 lifts it to the start
    for k in range(7):
        current += ramp(k, current)
        sizes.append(current)
    assert sizes == [4, 7, 10, 13, 16, 16, 16]
    # a clamped batch is lifted back to the ramp's target, and a resumed run rejoins it
    assert ramp(2, 8) == 2 and ramp(3, 20) == 0


def test_seesaw_doubles_where_the_cosine_lr_halves():
    import math

    from adaptive_batch import seesaw

    total, warmup = 100, 10
    grow = seesaw(total_intervals=total, warmup_intervals=warmup)
    doublings, current = [], 8
    for k in range(total):
        increment = grow(k, current)
        if increment:
            times = (current + increment) // current  # 2**n: n halvings since the last boundary
            assert times & (times - 1) == 0 and (current + increment) % current == 0
            doublings += [k] * (times.bit_length() - 1)
            current += increment
    cosine = lambda k: 0.5 * (1 + math.cos(math.pi * (k - warmup) / (total - warmup)))
    # each doubling is the first boundary where the schedule has fallen by another half
    assert doublings == [55, 70, 80, 86, 90, 93, 95, 97, 98, 99, 99]
    for j, k in enumerate(doublings[:-1], start=1):
        assert cosine(k) <= 2.0**-j * (1 + 1e-9) < cosine(k - 1)
    assert cosine(99) <= 2.0**-11  # the last boundary crosses two halvings: x4 at once


@pytest.mark.parametrize("make,message", [
    (lambda: __import__("adaptive_batch").linear_rampup(8, 4, 2), "final_batch_size=4 is under start_batch_size=8"),
    (lambda: __import__("adaptive_batch").linear_rampup(0, 4, 2), "all three must be ints >= 1"),
    (lambda: __import__("adaptive_batch").seesaw(10, 10), "0 <= warmup_intervals < total_intervals"),
    (lambda: __import__("adaptive_batch").seesaw(10, factor=1), "the factor must be an int >= 2"),
])
def test_bad_built_in_arguments(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_statistics_reach_only_the_functions_that_take_them():
    from adaptive_batch import GrowthStatistics
    from adaptive_batch.schedule.growth import accepts_statistics, call_batch_increase_function

    stats = GrowthStatistics(global_step=3, samples_seen=24, tokens_seen=240, gradient_noise_scale=12.5,
                             max_batch_size=32)
    seen = []

    def plain(epoch, current_batch_size):
        return 1

    def keyword(epoch, current_batch_size, *, stats=None):
        seen.append(stats)
        return int(stats.gradient_noise_scale) - current_batch_size

    def catch_all(epoch, current_batch_size, **kwargs):
        seen.append(kwargs["stats"])
        return 0

    assert [accepts_statistics(f) for f in (plain, keyword, catch_all, len)] == [False, True, True, False]
    assert call_batch_increase_function(plain, 1, 4, stats=stats) == 1
    assert call_batch_increase_function(keyword, 1, 4, stats=stats) == 8
    assert call_batch_increase_function(catch_all, 1, 4, stats=stats) == 0
    assert seen == [stats, stats]


def test_a_partial_or_a_callable_object_is_named_without_a_memory_address():
    """Checkpoints compare the name across processes: a repr with an address refused every resume."""
    import functools

    from adaptive_batch.schedule.growth import function_name

    class Grow:
        def __call__(self, epoch, current_batch_size):
            return 0

    partial = functools.partial(multiply_every, factor=2)
    assert function_name(partial) == "adaptive_batch.schedule.growth.multiply_every(factor=2)"
    assert function_name(Grow()).endswith("<locals>.Grow") and " at 0x" not in function_name(Grow())



def test_a_functions_identity_says_which_factory_call_or_lambda_it_is_and_not_what_it_holds():
    """A checkpoint compared growth functions by name: linear_ramp(8) resumed as linear_ramp(56),
    and one lambda as another, trained another schedule without a word. What a closure of your
    own holds is not compared: it may be state it moves on, or differ in every process."""
    import functools
    import time

    from adaptive_batch.schedule.growth import (
        KEY,
        function_identity,
        function_name,
        linear_ramp,
        same_setting_recorded,
        seesaw,
        step_increments,
    )

    assert function_identity(linear_ramp(8)) != function_identity(linear_ramp(56))
    assert function_identity(linear_ramp(8)) == function_identity(linear_ramp(increment=8))  # the same in every process
    assert function_identity(linear_ramp(8)).endswith("[linear_ramp(increment=8, every_n_epochs=1)]")
    assert function_identity(step_increments([1], [8])) != function_identity(step_increments([1], [56]))
    assert function_identity(seesaw(4)) != function_identity(seesaw(4, factor=4))
    assert function_identity(lambda e, b: 1) != function_identity(lambda e, b: 2)
    assert " at 0x" not in function_identity(lambda e, b: 1)

    def my_growth(epoch, current_batch_size, step=4):
        return step

    started, counted = time.time(), 0

    def holds(epoch, current_batch_size):  # a start time and a counter: not compared
        nonlocal counted
        counted += 1
        return int(started > 0)

    before = function_identity(holds)
    holds(0, 4)
    assert function_identity(holds) == before == function_name(holds)
    partial = functools.partial(my_growth, step=8)
    assert function_identity(partial) == function_name(partial)  # as recorded before identities
    assert function_identity(double_every_epoch) == "adaptive_batch.schedule.growth.double_every_epoch"
    # a record written before identities said more is the bare name
    assert same_setting_recorded(KEY, function_name(linear_ramp(8)), function_identity(linear_ramp(8)))
    assert not same_setting_recorded(KEY, function_identity(linear_ramp(8)), function_identity(linear_ramp(56)))
    assert not same_setting_recorded("lr_scaling", "linear", "linear [x]")  # the growth function's rule alone


def test_an_integer_of_another_type_is_an_int():
    """numpy's integers (a schedule read from an array) are ints: 4 was refused as not one."""
    import numpy as np

    increment = call_batch_increase_function(lambda epoch, current_batch_size: np.int64(4), 1, 8)
    assert increment == 4 and type(increment) is int


@pytest.mark.parametrize("spec", ["adaptive_batch.linear_ramp", "adaptive_batch.schedule.growth.seesaw", linear_ramp])
def test_a_factory_given_for_the_function_is_refused_when_the_options_are_built(spec):
    """A factory passed uncalled used to be called as f(0, batch) at the first boundary, mid-run."""
    with pytest.raises(ConfigError, match=r"builds the growth function .* call it with its arguments"):
        GrowthOptions(batch_increase_function=spec)
    assert GrowthOptions(batch_increase_function=linear_ramp(4)).batch_increase_function(1, 8) == 4


def test_a_user_factory_that_says_it_returns_a_function_is_refused_and_a_plain_function_is_not():
    from typing import Callable

    def ramp(step: int) -> Callable[[int, int], int]:
        return lambda k, b: step

    def grow(k, b: int) -> int:
        return 1

    with pytest.raises(ConfigError, match="builds the growth function"):
        GrowthOptions(batch_increase_function=ramp)
    assert GrowthOptions(batch_increase_function=grow).batch_increase_function is grow
