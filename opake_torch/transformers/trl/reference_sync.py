"""TR-DPO: the reference model synced with the policy during training (Gorbatovski et al. 2024, "Learn Your
Reference Model for Real Good Alignment", arXiv 2404.09656; TRL's ``sync_ref_model``).

At the end of steps ``tau, 2 tau, ...`` (``tau = ref_model_sync_steps``), every parameter of the reference becomes

    ``ref <- alpha * policy + (1 - alpha) * ref``        (``alpha = ref_model_mixup_alpha``; 1: the hard update)

computed as TRL's ``SyncRefModelCallback`` computes it (``ref.mul_(1 - alpha).add_(policy, alpha=alpha)``, in the
reference's dtype, parameters only: buffers stay the reference's). ``policy`` is the weights the next step starts
from: the released weights after the step's optimizer update.

Privacy: the synced reference costs no budget. It is a function of the initial reference, fixed before training and
independent of the private data, and of the policy's weights after the sync steps, which are the mechanism's
released outputs (noised updates applied to public initial weights); so it is post-processing of what was already
released. A later step reads it as it reads the current policy weights: a public input of that step's loss, chosen
from earlier releases, which the per-step accounting of DP-SGD (adaptive composition) already allows. A reference
trained or tuned on the private data in any other way would void this argument.

The synced reference is training state: a resumable checkpoint holds its parameters in :data:`FILE`, covered by the
checkpoint's seal like every other file, and a resume loads them back, so that a resumed run continues the
uninterrupted one bit for bit.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from opake_core.errors import CheckpointError, ConfigurationError

__all__ = ["FILE", "check_pair", "mix_into", "restore", "saved_state"]

FILE = "ref_model.safetensors"


def check_pair(reference: nn.Module, policy: dict[str, torch.Tensor]) -> None:
    """ConfigurationError unless every parameter of ``reference`` has a policy tensor of its name and shape
    (``policy``: the policy's parameters by name, trainable and frozen), which the sync mixes into it."""
    own = dict(reference.named_parameters())
    missing = sorted(set(own) - set(policy))
    shapes = sorted(n for n in set(own) & set(policy) if own[n].shape != policy[n].shape)
    if missing or shapes:
        raise ConfigurationError(
            "sync_ref_model=True mixes each policy parameter into the reference parameter of the same name, but "
            f"ref_model has parameters the policy lacks {missing[:5]} or of other shapes {shapes[:5]}. Pass a "
            "ref_model of the policy's architecture (or ref_model=None: a copy of the initial policy), or set "
            "sync_ref_model=False."
        )


@torch.no_grad()
def mix_into(reference: nn.Module, policy: dict[str, torch.Tensor], alpha: float) -> None:
    """``ref <- alpha * policy + (1 - alpha) * ref`` for every parameter of ``reference``, in place (so that the
    tensors a functional call reads, which share its storage, see the new values)."""
    for name, target in reference.named_parameters():
        target.mul_(1.0 - alpha).add_(policy[name], alpha=alpha)


def saved_state(reference: nn.Module) -> dict[str, torch.Tensor]:
    """The reference's parameters ``{name: tensor}`` as :data:`FILE` holds them (tied ones once)."""
    return {name: p.detach().contiguous() for name, p in reference.named_parameters()}


@torch.no_grad()
def restore(reference: nn.Module, folder: Path) -> bool:
    """Load :data:`FILE` of the checkpoint ``folder`` into ``reference``; False when the checkpoint has none (it was
    written without ``sync_ref_model``, so its reference was the fixed one). CheckpointError when the file is
    unreadable or holds other parameters, shapes or dtypes than ``reference``."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(folder) / FILE
    if not path.is_file():
        return False
    own = dict(reference.named_parameters())
    try:
        state = load_file(str(path), device=str(next(iter(own.values())).device))
    except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
        raise CheckpointError(f"{path} is not a readable safetensors file: {exc}") from exc
    kind = lambda tensor: (tensor.shape, tensor.dtype)  # noqa: E731
    differ = sorted(set(own) ^ set(state)) + sorted(n for n in set(own) & set(state) if kind(own[n]) != kind(state[n]))
    if differ:
        raise CheckpointError(
            f"{path} holds another reference than this trainer's ref_model (names, shapes or dtypes differ: "
            f"{differ[:5]}). Resume with the ref_model (or the policy, for ref_model=None) the run was started with."
        )
    for name, target in own.items():
        target.copy_(state[name])
    return True
