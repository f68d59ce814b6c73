"""train.optimizer_in_backward, in one process: the step taken parameter by parameter in backward equals the
ordinary step after backward (also across accumulated micro-batches), what it cannot work with is refused by
name, and the memory prediction drops the gradients it frees."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from raydl.config import TrainSection
from raydl.errors import ConfigError
from raydl.overrides import load_config
from raydl.parallel import recovery
from raydl.parallel.memory import Setting, predict
from raydl.parallel.wrapper_policy import choose_dp_wrapper
from raydl.train.optim import StepInBackward, build_optimizer, clip_grad_norm, states_one_by_one
from tests.unit.test_memory_prediction import MIB, MODEL

MICRO_BATCHES = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _train(in_backward: bool, steps: int = 4, units=None, model=None) -> tuple[nn.Module, list[float], int]:
    model = model or _model()
    optimizer = build_optimizer(model.parameters(), TrainSection(lr=0.05, weight_decay=0.1))
    calls = []
    optimizer.register_step_pre_hook(lambda *_: calls.append(1))
    stepper = StepInBackward(optimizer, torch.device("cpu"), units=units(model) if units else ()) if in_backward else None
    g, norms = torch.Generator().manual_seed(1), []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = 0.05 / (step + 1)   # the loop sets each step's lr before its backward
        for i in range(MICRO_BATCHES):
            if stepper:
                stepper.armed = i == MICRO_BATCHES - 1
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)
            (nn.functional.mse_loss(model(x), y) / MICRO_BATCHES).backward()
        norms.append(float(stepper.grad_norm() if stepper else clip_grad_norm(model.parameters(), 0)))
        if not stepper:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model, norms, len(calls) // steps


def _layers(model: nn.Module) -> list[list[nn.Parameter]]:
    return [list(model[0].parameters()), list(model[2].parameters())]


@pytest.mark.parametrize("units,calls_per_step", [(None, 4), (_layers, 2)])
def test_parameters_stepped_in_backward_equal_the_step_after_backward(units, calls_per_step):
    """Each parameter alone, or each unit (a layer's weight and bias) in one optimizer call."""
    reference, reference_norms, _ = _train(in_backward=False)
    model, norms, calls = _train(in_backward=True, units=units)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7, msg=lambda m: f"{name}: {m}")
        assert p.grad is None, "a gradient outlived its step"
    assert norms == pytest.approx(reference_norms, rel=1e-6)
    assert calls == calls_per_step
    assert not torch.equal(next(model.parameters()), next(_model().parameters())), "nothing was trained"


def test_a_unit_with_a_parameter_that_got_no_gradient_is_stepped_after_backward():
    """A unit never completes when one of its parameters is unused: what it has is stepped by grad_norm."""
    def with_unused(model: nn.Module) -> list[list[nn.Parameter]]:
        return [[*model[0].parameters(), model.unused], list(model[2].parameters())]

    def model_with_unused() -> nn.Module:
        model = _model()
        model.unused = nn.Parameter(torch.ones(3))   # never in the forward
        return model

    reference, reference_norms, _ = _train(in_backward=False, model=model_with_unused())
    model, norms, _ = _train(in_backward=True, units=with_unused, model=model_with_unused())
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-7)
        assert p.grad is None
    assert norms == pytest.approx(reference_norms, rel=1e-6)


@pytest.mark.parametrize("override,field", [
    ("train.grad_clip=1.0", "train.grad_clip"), ("train.precision=fp16", "train.precision"),
    ("parallel.pp_degree=2", "parallel.pp_degree"), ("parallel.dp_wrapper=ddp", "parallel.dp_wrapper")])
def test_what_it_cannot_work_with_is_refused_by_name(override, field):
    sets = ["train.optimizer_in_backward=true", "train.grad_clip=0", override]
    with pytest.raises(ConfigError) as refused:
        load_config(None, sets)
    assert refused.value.path == field and "optimizer_in_backward=false" in str(refused.value)
    assert load_config(None, sets[:2]).train.optimizer_in_backward


def test_the_survivors_path_is_not_taken_and_refused_when_required():
    cfg = load_config(None, ["train.optimizer_in_backward=true", "train.grad_clip=0", "scaling.survivors=auto"])
    path = recovery.choose(cfg, torchft=True)
    assert not path.survivors and "optimizer_in_backward" in path.why
    cfg.scaling.survivors = "on"
    with pytest.raises(ConfigError, match="optimizer_in_backward"):
        recovery.choose(cfg, torchft=True)


def test_auto_wraps_with_fully_shard_which_reduces_before_the_hook():
    wrapper, why = choose_dp_wrapper("auto", dp=2, pp=1, param_bytes=1, memory_bytes=2**40, in_backward=True)
    assert wrapper == "fsdp" and "optimizer_in_backward" in why
    assert choose_dp_wrapper("auto", dp=1, pp=1, param_bytes=1, memory_bytes=2**40, in_backward=True)[0] == "none"


# In flight: one block's gradients (100 MiB), its shard under fully_shard (100 / 2 MiB): stepped together.
@pytest.mark.parametrize("dp,wrapper,in_flight", [(2, "fsdp", 50 * MIB), (1, "none", 100 * MIB)])
def test_the_prediction_keeps_only_the_gradients_in_flight(dp, wrapper, in_flight):
    setting = dict(optimizer="sgd", momentum=0.0)
    after = predict(MODEL, dp=dp, pp=1, micro_batch=1, wrapper=wrapper, setting=Setting(**setting))
    inside = predict(MODEL, dp=dp, pp=1, micro_batch=1, wrapper=wrapper,
                     setting=Setting(**setting, optimizer_in_backward=True))
    assert inside.parts["grads"] == 0 and after.parts["grads"] == 400 * MIB // dp
    assert inside.parts["activations"] == after.parts["activations"] + in_flight
    assert inside.peak_bytes == after.peak_bytes - 400 * MIB // dp + in_flight


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_states_for_a_checkpoint_are_made_without_a_gradient_for_every_parameter(optimizer, monkeypatch):
    """torch's get_state_dict gives every parameter a zero gradient at once (a copy of the model) to create a
    fresh optimizer's states; states_one_by_one makes them one parameter at a time, or lends one small gradient
    to a stateless SGD, and the state dict is torch's own."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    def deep() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(*(nn.Linear(16, 16) for _ in range(6)))

    def state_dict(one_by_one: bool) -> tuple[dict, int, nn.Module]:
        model = deep()
        opt = build_optimizer(model.parameters(), TrainSection(optimizer=optimizer, momentum=0.0, lr=0.1,
                                                               weight_decay=0.1))
        most, zeros_like = [0], torch.zeros_like

        def counted(t, *args, **kwargs):   # the gradient elements alive once this zero tensor exists
            alive = sum(p.grad.numel() for p in model.parameters() if p.grad is not None) + t.numel()
            most[0] = max(most[0], alive)
            return zeros_like(t, *args, **kwargs)
        monkeypatch.setattr(torch, "zeros_like", counted)
        with states_one_by_one(opt) if one_by_one else contextlib.nullcontext():
            _, osd = get_state_dict(model, opt)
        monkeypatch.setattr(torch, "zeros_like", zeros_like)
        return osd, most[0], model

    torch_way, torch_most, _ = state_dict(one_by_one=False)
    ours, our_most, model = state_dict(one_by_one=True)
    largest = max(p.numel() for p in model.parameters())
    assert torch_most >= sum(p.numel() for p in model.parameters())   # every zero gradient at once
    assert our_most <= 2 * largest < torch_most   # one at a time: a gradient and the state being made
    assert all(p.grad is None for p in model.parameters())
    assert torch.equal(model[0].weight, deep()[0].weight), "lr 0: no parameter moved"
    assert str(ours) == str(torch_way)
