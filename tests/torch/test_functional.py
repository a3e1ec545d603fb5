"""``functional_model``'s ``apply`` against ``torch.func.functional_call``, which it replaces on the eager path.

``apply`` swaps the given tensors into the module's parameter and buffer slots itself (one walk of the modules a
call); these tests hold it to what ``functional_call(module, tensors, tie_weights=True, strict=False)`` does: the
same outputs and gradients, tied places swapped together, the module's own tensors back afterwards (also after an
error), and ``functional_call``'s own behaviour for names that are not the module's.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call

from opake_torch.functional import functional_model


class _TiedLM(nn.Module):
    """An embedding whose weight the head reuses, a norm with a buffer, and one submodule used at two places."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.shared = nn.Linear(6, 6)
        self.norm = nn.BatchNorm1d(6)
        self.blocks = nn.ModuleList([self.shared, nn.Tanh(), self.shared])
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def _fresh(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    _, params, frozen = functional_model(model)
    new = {name: torch.randn_like(p, dtype=torch.float64).requires_grad_() for name, p in params.items()}
    return new, {name: t.double() for name, t in frozen.items()}


def test_apply_equals_functional_call_with_tied_and_shared_places() -> None:
    torch.manual_seed(0)
    model = _TiedLM().double().eval()
    apply, params, _ = functional_model(model)
    assert "head.weight" not in params and "blocks.0.weight" not in params  # tied and shared: listed once
    new, frozen = _fresh(model)
    ids = torch.randint(0, 11, (5,))
    got = apply(new, frozen, ids)
    want = functional_call(model, {**frozen, **new}, (ids,), tie_weights=True, strict=False)
    assert torch.equal(got, want)
    grads = torch.autograd.grad(got.square().sum(), list(new.values()))
    wanted = torch.autograd.grad(want.square().sum(), list(new.values()))
    for name, g, w in zip(new, grads, wanted, strict=True):
        assert g.abs().sum() > 0, name  # the embedding's gradient includes the head's use
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_apply_puts_the_modules_own_tensors_back_also_after_an_error() -> None:
    model = _TiedLM().double().eval()
    apply, _, _ = functional_model(model)
    own = {name: t for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]}
    new, frozen = _fresh(model)
    apply(new, frozen, torch.arange(4))
    with pytest.raises(IndexError):
        apply(new, frozen, torch.tensor([99]))  # out of the embedding's range, inside the swapped call
    after = {name: t for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers()]}
    assert after.keys() == own.keys() and all(after[name] is own[name] for name in own)
    assert model.head.weight is model.embed.weight


def test_a_name_that_is_not_the_modules_behaves_as_in_functional_call() -> None:
    model = _TiedLM().double().eval()
    apply, _, _ = functional_model(model)
    new, frozen = _fresh(model)
    tied = {"head.weight": torch.randn_like(new["embed.weight"])}
    with pytest.raises(ValueError, match="tied"):  # two values for one tied tensor: functional_call refuses them
        apply({**new, **tied}, frozen, torch.arange(3))
    extra = {"embed.scale": torch.ones(())}  # not a parameter or buffer: functional_call sets it for the call
    torch.testing.assert_close(apply({**new, **extra}, frozen, torch.arange(3)), apply(new, frozen, torch.arange(3)))
    assert not hasattr(model.embed, "scale")


def test_a_submodule_replaced_after_functional_model_is_the_one_apply_runs() -> None:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    apply, params, frozen = functional_model(model)
    model[2] = nn.Linear(4, 2).double()  # same names, new tensors: the walk is made at each call
    new = {name: torch.randn_like(p) for name, p in params.items()}
    x = torch.randn(5, 3, dtype=torch.float64)
    want = torch.tanh(x @ new["0.weight"].T + new["0.bias"]) @ new["2.weight"].T + new["2.bias"]
    torch.testing.assert_close(apply(new, frozen, x), want, rtol=0, atol=1e-15)
