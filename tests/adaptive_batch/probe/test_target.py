import pytest
import torch

from adaptive_batch import ConfigError, find_max_batch_size
from adaptive_batch.probe.target import check_make_batch, step_device


def test_the_device_is_the_models_or_a_clear_line():
    model = torch.nn.Linear(4, 2)
    assert step_device(model, None) == torch.device("cpu") and step_device(model, "cpu") == torch.device("cpu")
    with pytest.raises(ConfigError, match=r"model=ReLU has no parameters.* pass the model train_step trains"):
        step_device(torch.nn.ReLU(), None)
    with pytest.raises(ConfigError, match=r"device='gpu' is not a device"):
        step_device(model, "gpu")
    if torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"this machine has \d+ CUDA device"):
            step_device(model, f"cuda:{torch.cuda.device_count()}")
    else:
        with pytest.raises(ConfigError, match=r"device='cuda': this torch \(.*\) sees no CUDA device; use device='cpu'"):
            step_device(model, "cuda")


def test_a_model_on_the_meta_device_is_told_to_materialize_whatever_device_is_asked():
    """It once met a recipe's key (device='meta' has no memory backend ... use_maximum_batch_size),
    or, with device='cpu', torch's own error inside the first trial."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    for device in (None, "cpu"):
        with pytest.raises(ConfigError, match=r"model=Sequential's parameter '0.weight' is on the meta device.*"
                                              r"materialize the model first"):
            step_device(model, device)


def test_a_batch_maker_must_build_the_size_it_is_asked_for():
    check_make_batch(lambda n: {"x": torch.zeros(n, 3), "scale": torch.ones(1)})
    check_make_batch(lambda n: torch.zeros(7, n))  # the batch along another dimension
    with pytest.raises(ConfigError, match=r"make_batch\(1\) and make_batch\(2\) built tensors of the same shapes \(\[\(5, 3\)\]\)"):
        check_make_batch(lambda n: torch.zeros(5, 3))


def test_find_max_batch_size_refuses_them_before_any_step():
    ran = []

    def step(batch):
        ran.append(batch.shape[0])

    model = torch.nn.Linear(3, 1)
    for kwargs, message in [
        (dict(model=torch.nn.ReLU(), make_batch=lambda n: torch.zeros(n, 3)), "model=ReLU has no parameters"),
        (dict(model=model, make_batch=lambda n: torch.zeros(4, 3)), "make_batch"),
        (dict(model=model, make_batch=lambda n: torch.zeros(n, 3), device="cuda:99"), "device='cuda:99'"),
    ]:
        with pytest.raises(ConfigError, match=message):
            find_max_batch_size(step, max_memory="64MiB", **kwargs)
    assert ran == []


@pytest.mark.parametrize("argument, value, message", [
    ("train_step", None, r"train_step=None is not a function: pass one"),
    ("make_batch", 5, r"make_batch=5 is not a function: pass one, e.g. make_batch=lambda n: torch.randn"),
    ("model", None, r"model=None is not a torch.nn.Module"),
    ("optimizer", "adam", r"optimizer='adam' is not a torch.optim.Optimizer"),
])
def test_arguments_of_the_wrong_kind_are_one_line_naming_them(argument, value, message):
    """They were torch's or Python's own errors from inside the probe (AttributeError: 'NoneType'
    object has no attribute 'named_parameters'), naming none of them."""
    model = torch.nn.Linear(4, 1)
    arguments = dict(train_step=lambda batch: model(batch).sum().backward(), make_batch=lambda n: torch.randn(n, 4),
                     model=model, optimizer=None)
    arguments[argument] = value
    step = arguments.pop("train_step")
    with pytest.raises(ConfigError, match=message):
        find_max_batch_size(step, **arguments, max_memory="16MiB")
