"""The noise and sampler keys of a trainer run: secret by default, and never reused for different releases.

Whoever knows the noise key and the released weights can recompute the noise and subtract it, and whoever knows the
sampler key knows which records were in each batch, which removes the amplification the accountant counts on. So:

* by default both keys come from a fresh 128-bit root drawn from the operating system's entropy, independent of
  ``args.seed`` (which keeps driving data order, initialization and dropout);
* ``privacy_noise_seed`` derives them from an integer instead, so that runs replay; the trainer then warns that the
  noise is known to whoever knows the seed;
* the keys live in the trainer and in the private checkpoint state (``dp_state.json``) only, so that a resume
  continues the same streams bit-exactly; they are never logged, never in ``accountant.json``, a model card or an
  upload, and their ``repr`` shows a fingerprint, not the key;
* a new segment (a second ``train()`` call, or a resume whose configuration or training data changed) gets new keys
  (:func:`next_keys`), so noise already used for one trajectory is never added to another.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from opake_core import random
from opake_core.errors import CheckpointError, OpakeError

__all__ = ["NOISE_STREAM", "SAMPLER_STREAM", "RunKeys", "first_keys", "next_keys"]

NOISE_STREAM = "opake.trainer.noise"
SAMPLER_STREAM = "opake.trainer.sampler"
SEGMENT_STREAM = "opake.trainer.segment"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunKeys:
    """The noise key and the sampler key of one segment of a run (secrets)."""

    noise: random.Key
    sampler: random.Key

    def to_json(self) -> dict[str, Any]:
        return {"noise_key": random.key_to_json(self.noise), "sampler_key": random.key_to_json(self.sampler)}

    @staticmethod
    def from_json(manifest: dict[str, Any], where: str) -> RunKeys:
        try:
            return RunKeys(random.key_from_json(manifest["noise_key"]), random.key_from_json(manifest["sampler_key"]))
        except (OpakeError, KeyError) as exc:
            raise CheckpointError(f"{where}: the saved keys are unreadable ({exc}).") from exc


def _from_root(root: random.Key) -> RunKeys:
    return RunKeys(random.fold_in(root, NOISE_STREAM), random.fold_in(root, SAMPLER_STREAM))


def _root(args: Any) -> random.Key:
    if args.privacy_noise_seed is None:
        return random.random_key(impl=args.privacy_noise_generator)
    return random.key(args.privacy_noise_seed, impl=args.privacy_noise_generator)


def _shared(keys: RunKeys, share: Callable[[random.Key], random.Key]) -> RunKeys:
    """Rank 0's keys on every rank (each rank drew its own secret root); ``share`` broadcasts one key."""
    return RunKeys(share(keys.noise), share(keys.sampler))


def first_keys(args: Any, *, share: Callable[[random.Key], random.Key]) -> RunKeys:
    """The keys of a new run: from the operating system, or from ``privacy_noise_seed`` with a warning. ``share``
    makes a key the same on every rank (the identity in one process)."""
    if args.privacy_noise_seed is not None:
        logger.warning(
            "privacy_noise_seed is set: the noise and the batches of this run can be recomputed by anyone who knows "
            "the seed, who can then remove the noise from the released weights. Use it for tests and debugging, "
            "never for a model you release; leave it unset for secret keys."
        )
    return _shared(_from_root(_root(args)), share)


def next_keys(args: Any, *, released: int, share: Callable[[random.Key], random.Key]) -> RunKeys:
    """The keys of a new segment that starts after ``released`` releases: fresh secret ones, or (with
    ``privacy_noise_seed``) derived from the seed and ``released``, so that a seeded experiment replays."""
    if args.privacy_noise_seed is None:
        return _shared(_from_root(random.random_key(impl=args.privacy_noise_generator)), share)
    return _from_root(random.fold_in(_root(args), SEGMENT_STREAM, released))
