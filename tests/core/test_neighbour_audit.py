"""Neighbour-invariance audit of the library (the Re:cord-play idea, Cebere et al., arXiv 2602.17454).

Every mechanism x sampler pair the trainer accepts runs through a composed step with fixed randomness (same keys,
same states) on a dataset D and on a neighbour D' (example ``j`` removed, or replaced by an extreme example). The
sampler's draws are coupled: D' uses D's indices without (or with the replaced) ``j``. At every step the release
``params_t - params_{t+1}`` of an SGD step with learning rate 1 (noise on, float64) is computed at the same
``params_t`` for both batches; the difference must stay within the clipped sum's declared sensitivity (twice it for
replace-one), and when ``j`` is not in the batch it must be exactly zero. Zero violations are allowed.

The traps peers fell into each get their own test below. The DP-FTRL pairs use a step composed from the primitives
(``clipped_grad -> mf_gaussian_noise -> sgd``); ``opake_core.step.dp_ftrl`` is audited by listing it
in ``FTRL_STEP_BUILDERS`` (it is listed there).
"""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from opake_core import mf, optim, random, sampling
from opake_core import testing as t
from opake_core.clipping import clipped_grad
from opake_core.noise import add_gaussian_noise, mf_gaussian_noise, noise_std_for
from opake_core.optim import apply_updates
from opake_core.step import dp_sgd
from opake_core.tree import Clipped, per_group

N, STEPS, C, Z = 24, 4, 1.0, 1.1
KEY = random.key(11)


def _params(dtype=torch.float64):
    gen = torch.Generator().manual_seed(0)
    return {
        "w1": torch.randn(5, 7, generator=gen, dtype=torch.float64).to(dtype),
        "b1": torch.zeros(7, dtype=dtype),
        "w2": torch.randn(7, 3, generator=gen, dtype=torch.float64).to(dtype),
    }


def _loss(p, x, y):
    logits = torch.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]
    return F.cross_entropy(logits[None], y[None])


def _data():
    gen = torch.Generator().manual_seed(1)
    return torch.randn(N, 5, generator=gen, dtype=torch.float64), torch.randint(0, 3, (N,), generator=gen)


# -- samplers and mechanisms the trainer accepts (opake_torch.transformers.privacy_settings.SAMPLERS) ---------------


def _sampler(name):
    expected = 6
    if name == "poisson":
        return sampling.poisson(dataset_size=N, sample_rate=expected / N)
    if name == "poisson_truncated":
        return sampling.poisson(dataset_size=N, sample_rate=expected / N, truncated_batch_size=7)
    if name == "k_out_of_t_block":
        return sampling.k_out_of_t(dataset_size=N, k=2, t=STEPS, allocation="block")
    if name == "k_out_of_t_total":
        return sampling.k_out_of_t(dataset_size=N, k=2, t=STEPS, allocation="total")
    if name == "fixed_size":
        return sampling.fixed_size(dataset_size=N, batch_size=expected)
    if name == "sequential":
        return sampling.sequential(dataset_size=N, batch_size=expected)
    if name == "cyclic_poisson":
        return sampling.cyclic_poisson(dataset_size=N, sample_rate=expected / N, bands=2)
    if name == "b_min_sep":
        return sampling.b_min_sep(dataset_size=N, sample_rate=expected / N, min_sep=2)
    if name == "balls_in_bins":
        return sampling.balls_in_bins(dataset_size=N, num_bins=4)
    raise ValueError(name)


STRATEGIES = {
    "mf_identity": lambda: mf.identity(),
    "mf_band": lambda: mf.band_mf(bands=2),
    "mf_blt": lambda: mf.blt(max_buffers=2),
    "mf_bisr": lambda: mf.bisr(bandwidth=2),
    "mf_bsr": lambda: mf.bsr(bandwidth=2),
    "mf_lambda_cgd": lambda: mf.lambda_cgd(0.5),
}

# mechanism -> sampler names; "poisson" also covers its truncated variant, "k_out_of_t" both allocations.
PAIRS = {
    "gaussian": ("poisson", "poisson_truncated", "k_out_of_t_block", "k_out_of_t_total", "fixed_size", "sequential"),
    "mf_identity": ("poisson", "balls_in_bins"),
    "mf_band": ("cyclic_poisson", "b_min_sep"),
    "mf_blt": ("balls_in_bins",),
    "mf_bisr": ("balls_in_bins",),
    "mf_bsr": ("balls_in_bins",),
    "mf_lambda_cgd": ("balls_in_bins",),
}
CASES = [(mech, s) for mech, names in PAIRS.items() for s in names]


def _sgd_step(expected_batch_size):
    opt = optim.sgd(1.0)
    step_fn, dp_state = dp_sgd(
        _loss,
        optimizer=opt,
        clipping_norm=C,
        noise_multiplier=Z,
        expected_batch_size=expected_batch_size,
        compute_dtype=torch.float64,
        key=KEY,
    )

    def release(params, dp_state, batch):
        new, _, new_state, _ = step_fn(params, opt.init(params), dp_state, batch)
        return {k: params[k] - new[k] for k in params}, new_state

    return release, dp_state


def _ftrl_step(strategy, expected_batch_size):
    """DP-FTRL composed from the primitives: clip, correlated noise, SGD."""
    grad_fn, clip_state = clipped_grad(_loss, clipping_norm=C, normalize_by=expected_batch_size, batch_argnums=(1, 2))
    noise_fn, noise_state = mf_gaussian_noise(
        _params(), strategy, n_steps=STEPS, noise_multiplier=Z, key=KEY, compute_dtype=torch.float64
    )
    opt = optim.sgd(1.0)

    def release(params, state, batch):
        clipped, _ = grad_fn(params, *batch, state=clip_state)
        noised, new_state = noise_fn(clipped, state)
        updates, _ = opt.update(noised, opt.init(params), params=params)
        new = apply_updates(params, updates)
        return {k: params[k] - new[k] for k in params}, new_state

    return release, noise_state


def _ftrl_options(strategy, expected_batch_size):
    """The arguments of every ``dp_ftrl`` step audited here, but the loss and the optimizer."""
    return {
        "params": _params(),
        "strategy": strategy,
        "n_steps": STEPS,
        "clipping_norm": C,
        "noise_multiplier": Z,
        "expected_batch_size": expected_batch_size,
        "compute_dtype": torch.float64,
        "key": KEY,
    }


def _library_ftrl_step(strategy, expected_batch_size):
    """The library's composed ``opake_core.step.dp_ftrl``."""
    from opake_core.step import dp_ftrl

    opt = optim.sgd(1.0)
    step_fn, dp_state = dp_ftrl(_loss, optimizer=opt, **_ftrl_options(strategy, expected_batch_size))

    def release(params, state, batch):
        new, _, new_state, _ = step_fn(params, opt.init(params), state, batch)
        return {k: params[k] - new[k] for k in params}, new_state

    return release, dp_state


FTRL_STEP_BUILDERS = {"composed": _ftrl_step, "dp_ftrl": _library_ftrl_step}


def _distance(a, b):
    return float(sum(((a[k] - b[k]) ** 2).sum() for k in a).sqrt())


def _expected_batch_size(sampler):
    return getattr(sampler, "expected_batch_size", None) or sampler.batch_size  # Sequential: the fixed batch


def _target(sampler):
    """The differing example: the one that takes part most often, so that the audit exercises it."""
    draws, sampler_state = [], sampler.init()
    for _ in range(STEPS):
        idx, sampler_state = sampler.sample(KEY, sampler_state)
        draws.append(torch.as_tensor(np.asarray(idx), dtype=torch.long))
    return int(torch.cat(draws).mode().values) if sum(len(d) for d in draws) else 0


def _neighbours(release, params, state, sampler, data, extreme, move):
    """Every step's release of the sampled batch of ``data`` (per-example tensors), of that batch without the target,
    and of it with the target replaced by ``extreme(target)`` (one entry per tensor, None: kept), and whether the
    target took part; then the parameters move by ``move(release)`` and the state advances."""
    target = _target(sampler)
    replacement = extreme(target)
    sampler_state = sampler.init()
    for step in range(STEPS):
        idx, sampler_state = sampler.sample(KEY, sampler_state)
        idx = torch.as_tensor(np.asarray(idx), dtype=torch.long)
        hit = idx == target
        out, next_state = release(params, state, tuple(d[idx] for d in data))
        removed, _ = release(params, state, tuple(d[idx[~hit]] for d in data))
        replaced_batch = tuple(
            d[idx] if e is None else torch.where(hit.view(-1, *[1] * (d.dim() - 1)), e, d[idx])
            for d, e in zip(data, replacement, strict=True)
        )
        replaced, _ = release(params, state, replaced_batch)
        yield step, out, removed, replaced, bool(hit.any())
        params = {k: params[k] - move(out)[k] for k in params}
        state = next_state


def _extreme_input(x, y):
    """The target's input scaled by 1e6 (a saturating gradient), its label kept."""
    return lambda target: (t.extreme_examples((x[target], y[target]))[0][0], None)


def _audit(release, state, sampler):
    x, y = _data()
    bound = C / _expected_batch_size(sampler)
    violations, participated = [], 0
    steps = _neighbours(release, _params(), state, sampler, (x, y), _extreme_input(x, y), move=lambda out: out)
    for step, out, removed, replaced, took_part in steps:
        d_remove, d_replace = _distance(out, removed), _distance(out, replaced)
        if took_part:
            participated += 1
            if d_remove > bound * (1 + 1e-6) or d_replace > 2 * bound * (1 + 1e-6):
                violations.append((step, d_remove / bound, d_replace / bound))
        elif d_remove != 0 or d_replace != 0:
            violations.append((step, "changed without participating", d_remove, d_replace))
    return violations, participated


def _two_stream_violations(step, took_part, moves, declared, sigma, joint):
    """A release of two streams: ``moves`` is ``[(kind, factor, [d_1, d_2])]`` (removal: factor 1, replacement: 2);
    each stream may move by ``factor`` times its declared sensitivity, the pair whitened by ``sigma`` by ``factor *
    joint``, and nothing may move when the target did not take part."""
    found = []
    for kind, factor, moved in moves:
        if not took_part:
            if moved != [0.0, 0.0]:
                found.append((step, kind, "changed without participating", moved))
            continue
        if any(d > factor * b * (1 + 1e-6) for d, b in zip(moved, declared, strict=True)):
            found.append((step, kind, "stream", moved, declared))
        whitened = math.sqrt(sum((d / sd) ** 2 for d, sd in zip(moved, sigma, strict=True)))
        if whitened > factor * joint * (1 + 1e-6):
            found.append((step, kind, "joint", whitened / joint))
    return found


@pytest.mark.parametrize(("mechanism", "sampler_name"), CASES, ids=[f"{m}-{s}" for m, s in CASES])
def test_neighbour_invariance(mechanism, sampler_name):
    sampler = _sampler(sampler_name)
    if mechanism == "gaussian":
        builders = {"dp_sgd": lambda: _sgd_step(_expected_batch_size(sampler))}
    else:
        strategy = STRATEGIES[mechanism]()
        builders = {
            name: (lambda b=b: b(strategy, _expected_batch_size(sampler))) for name, b in FTRL_STEP_BUILDERS.items()
        }
    for name, build in builders.items():
        release, state = build()
        violations, participated = _audit(release, state, sampler)
        assert violations == [], f"{name} with {sampler_name}: {violations}"
        assert participated >= 1


def test_pairs_cover_everything_the_trainer_accepts():
    parsing = importlib.import_module("opake_torch.transformers.privacy_settings")
    audited = {(m, s.split("_truncated")[0].replace("_block", "").replace("_total", "")) for m, s in CASES}
    accepted = {(m, s) for m, names in parsing.SAMPLERS.items() for s in names}
    assert accepted <= audited, f"pairs the trainer accepts but the audit misses: {sorted(accepted - audited)}"


# -- the traps ----------------------------------------------------------------------------------------------------

VOCAB, DIM = 11, 4


def _tokens(lengths, pad_to, seed=2):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), pad_to, dtype=torch.long)
    mask = torch.zeros(len(lengths), pad_to, dtype=torch.float64)
    for i, n in enumerate(lengths):
        ids[i, :n] = torch.randint(1, VOCAB, (n,), generator=gen)
        mask[i, :n] = 1
    return ids, mask


def _token_params():
    gen = torch.Generator().manual_seed(3)
    return {
        "emb": torch.randn(VOCAB, DIM, generator=gen, dtype=torch.float64),
        "w": torch.eye(DIM, dtype=torch.float64),
    }


def _token_losses(p, ids, mask):
    """Per-token next-token losses of one sequence, with the embedding tied to the output layer."""
    h = torch.tanh(p["emb"][ids] @ p["w"])
    logits = h @ p["emb"].T  # tied weights: the embedding is used twice
    return F.cross_entropy(logits[:-1], ids[1:], reduction="none") * mask[1:]


def _per_example_mean(p, ids, mask):
    return _token_losses(p, ids, mask).sum() / mask[1:].sum().clamp(min=1)


def _repad(batch, length):
    ids, mask = batch
    extra = length - ids.shape[1]
    return F.pad(ids, (0, extra)), F.pad(mask, (0, extra))


def test_trap_batch_level_token_normalization_is_flagged_and_ours_passes():
    """HF's ``num_items_in_batch``: dividing by the batch's token count couples examples (P7)."""
    params, batch = _token_params(), _tokens([3, 7, 5, 9, 4], 12)
    ours, state = clipped_grad(_per_example_mean, clipping_norm=C, normalize_by=5.0, batch_argnums=(1, 2))
    t.assert_sensitivity(lambda b: ours(params, *b, state=state)[0], batch, key=KEY, kinds=("add", "remove"))

    def batch_normalized(b):
        ids, mask = b
        total = mask[:, 1:].sum().clamp(min=1)
        fn, s = clipped_grad(
            lambda p, i, m: _token_losses(p, i, m).sum() / total * ids.shape[0],
            clipping_norm=C,
            normalize_by=5.0,
            batch_argnums=(1, 2),
        )
        return fn(params, ids, mask, state=s)[0]

    # a short sequence next to long ones: the others' gradients are rescaled by its presence
    report = t.check_sensitivity(batch_normalized, _tokens([9, 9, 9, 9, 2], 12), key=KEY, kinds=("remove",))
    assert not report.passed, report


def test_trap_padding_inside_the_per_example_mean():
    """Adding a longer example re-pads the batch; nobody else's contribution may change (P7, Opacus #792)."""
    params, batch = _token_params(), _tokens([3, 5, 4], 6)
    fn, state = clipped_grad(_per_example_mean, clipping_norm=C, normalize_by=4.0, batch_argnums=(1, 2))
    release = lambda b: fn(params, *b, state=state)[0]  # noqa: E731
    short, long = release(batch).value, release(_repad(batch, 14)).value
    assert all(torch.allclose(short[k], long[k], rtol=0, atol=1e-15) for k in short)
    longer = _tokens([3, 5, 4, 14], 14)
    extra = [longer, _repad(batch, 14)]
    t.assert_sensitivity(release, _repad(batch, 14), key=KEY, extra=extra, kinds=("add", "remove"))


def test_trap_tied_weights():
    """Tied embedding and output weights: one per-example gradient, clipped once (P11)."""
    params, batch = _token_params(), _tokens([4, 6, 5, 3], 6)
    fn, state = clipped_grad(_per_example_mean, clipping_norm=0.5, normalize_by=4.0, batch_argnums=(1, 2))
    t.assert_sensitivity(lambda b: fn(params, *b, state=state)[0], batch, key=KEY, kinds=("add", "remove"))


def test_trap_empty_batch():
    """An empty batch is a step (pure noise), and adding one example to it moves the release within the bound."""
    x, y = _data()
    release, state = _sgd_step(6.0)
    empty = (x[:0], y[:0])
    out, _ = release(_params(), state, empty)
    noise_only = add_gaussian_noise(
        Clipped({k: torch.zeros_like(v) for k, v in _params().items()}, C / 6.0),
        noise_multiplier=Z,
        key=KEY,
        step=0,
        compute_dtype=torch.float64,
    ).value
    assert all(torch.allclose(out[k], noise_only[k], rtol=1e-12, atol=1e-15) for k in out)
    one, _ = release(_params(), state, (x[:1], y[:1]))
    assert _distance(out, one) <= C / 6.0 * (1 + 1e-9)


def test_trap_microbatch_boundaries():
    """Removing an example shifts every chunk boundary; the release must not depend on where they fall."""
    x, y = _data()
    batch, params = (x[:7], y[:7]), _params()
    whole, s = clipped_grad(_loss, clipping_norm=C, normalize_by=7.0, batch_argnums=(1, 2))
    chunked, s3 = clipped_grad(_loss, clipping_norm=C, normalize_by=7.0, batch_argnums=(1, 2), microbatch_size=3)
    a, b = whole(params, *batch, state=s)[0].value, chunked(params, *batch, state=s3)[0].value
    assert all(torch.allclose(a[k], b[k], rtol=1e-12, atol=1e-15) for k in a)
    t.assert_sensitivity(lambda bb: chunked(params, *bb, state=s3)[0], batch, key=KEY)


def test_trap_per_group_clipping():
    """Per-group bounds: every group moves by at most its own sensitivity, and jointly by their L2 combination."""
    x, y = _data()
    params = _params()
    bound = per_group(params, {r"^w1$": 0.3, r"^w2$": 0.8}, fallback=0.5)
    fn, s = clipped_grad(_loss, clipping_norm=bound, normalize_by=6.0, batch_argnums=(1, 2))
    report = t.assert_sensitivity(lambda b: fn(params, *b, state=s)[0], (x[:6], y[:6]), key=KEY)
    assert report.sensitivity == pytest.approx(bound.effective / 6.0)


def test_trap_bf16_parameters():
    """bf16 parameters: the clipped sum is stored in float32 and must satisfy the bound in float32."""
    x, y = _data()
    params = _params(torch.bfloat16)
    fn, s = clipped_grad(
        lambda p, xx, yy: _loss(p, xx.to(torch.bfloat16), yy), clipping_norm=C, normalize_by=6.0, batch_argnums=(1, 2)
    )
    out = fn(params, x[:6], y[:6], state=s)[0]
    assert all(v.dtype == torch.float32 for v in out.value.values())
    t.assert_sensitivity(lambda b: fn(params, *b, state=s)[0], (x[:6], y[:6]), key=KEY)


def test_trap_ddp_sum_of_two_shards():
    """DDP: the clipped sums of the ranks' shards are summed, then noised once.

    The library has no DDP code yet (no ``torch.distributed`` in opake_torch), so the cross-rank ``all_reduce(SUM)``
    of two Gloo ranks is simulated here by adding the two shards' clipped sums, each normalized by the *global*
    expected batch. Removing an example from either shard must move the sum by at most C / n, and the noise std of
    the summed release is that of one Gaussian on the global sum (not per rank).
    """
    x, y = _data()
    params, n_global = _params(), 8.0
    fn, s = clipped_grad(_loss, clipping_norm=C, normalize_by=n_global, batch_argnums=(1, 2))

    def all_reduced(batch):
        xs, ys = batch
        half = xs.shape[0] // 2
        shards = [fn(params, xs[:half], ys[:half], state=s)[0], fn(params, xs[half:], ys[half:], state=s)[0]]
        return Clipped({k: shards[0].value[k] + shards[1].value[k] for k in params}, shards[0].sensitivity)

    report = t.assert_sensitivity(all_reduced, (x[:8], y[:8]), key=KEY, kinds=("remove", "replace"))
    assert report.sensitivity == C / n_global
    assert noise_std_for(all_reduced((x[:8], y[:8])).sensitivity, Z) == pytest.approx(Z * C / n_global)


# -- private second moments and projected JME ----------------------------------------------------------------------
# The release of these mechanisms is a pair of noised streams (NoisedMoments). A step with a recording optimizer
# applies the first stream with learning rate 1 and keeps the pair; each stream must move by at most its own declared
# sensitivity (twice it for replace-one) and, whitened by the noise actually drawn, the pair by at most 1 / (z s)
# (s: the strategy's sensitivity, 1 for DP-SGD and JME): one Gaussian release with multiplier z.


class _Recorder:
    """Takes the noised pair, returns the first stream as the update (SGD with learning rate 1), keeps the pair."""

    takes_moments = True
    noise_aware = False

    def __init__(self):
        self.seen = []

    def init(self, params):
        return ()

    def update(self, noised, state, *, params=None):
        self.seen.append(noised)
        return {k: -v for k, v in noised.first.value.items()}, state


def _moments_release(build):
    recorder = _Recorder()
    step_fn, dp_state = build(recorder)

    def release(params, state, batch):
        _, _, new_state, _ = step_fn(params, (), state, batch)
        return recorder.seen[-1], new_state

    return release, dp_state


def _paired_sgd(expected_batch_size):
    return _moments_release(
        lambda opt: dp_sgd(
            _loss,
            optimizer=opt,
            clipping_norm=C,
            noise_multiplier=Z,
            expected_batch_size=expected_batch_size,
            compute_dtype=torch.float64,
            key=KEY,
            second_moment=True,
        )
    )


def _paired_ftrl(strategy, expected_batch_size):
    from opake_core.step import dp_ftrl

    return _moments_release(
        lambda opt: dp_ftrl(
            _loss,
            optimizer=opt,
            second_moment=True,
            second_moment_strategy=strategy,
            **_ftrl_options(strategy, expected_batch_size),
        )
    )


def _jme(expected_batch_size):
    from opake_core.jme import jme_noise
    from opake_core.step import dp_step

    noise = jme_noise(noise_multiplier=Z, key=KEY, aggregate_norm=0.05, compute_dtype=torch.float64)
    return _moments_release(
        lambda opt: dp_step(_loss, clipping=C, noise=noise, optimizer=opt, expected_batch_size=expected_batch_size)
    )


def _audit_moments(release, state, sampler, *, strategy_sensitivity=1.0, row_norms=None):
    x, y = _data()
    violations, participated = [], 0
    steps = _neighbours(release, _params(), state, sampler, (x, y), _extreme_input(x, y), lambda out: out.first.value)
    for step, out, removed, replaced, took_part in steps:
        row = 1.0 if row_norms is None else float(row_norms[step])
        moves = [
            (kind, factor, [_distance(out.first.value, o.first.value), _distance(out.second.value, o.second.value)])
            for kind, factor, o in (("remove", 1.0, removed), ("replace", 2.0, replaced))
        ]
        declared = [out.first.sensitivity, out.second.sensitivity]
        sigma = [out.first.noise_std / row, out.second.noise_std / row]
        violations += _two_stream_violations(step, took_part, moves, declared, sigma, 1 / (Z * strategy_sensitivity))
        participated += took_part
    return violations, participated


MOMENT_CASES = [("paired_gaussian", s) for s in PAIRS["gaussian"]] + [("jme", "poisson")]
MOMENT_CASES += [(f"paired_{m}", s) for m, names in PAIRS.items() if m != "gaussian" for s in names]


@pytest.mark.parametrize(("mechanism", "sampler_name"), MOMENT_CASES, ids=[f"{m}-{s}" for m, s in MOMENT_CASES])
def test_neighbour_invariance_of_the_moment_releases(mechanism, sampler_name):
    sampler = _sampler(sampler_name)
    n = _expected_batch_size(sampler)
    options = {}
    if mechanism == "paired_gaussian":
        release, state = _paired_sgd(n)
    elif mechanism == "jme":
        release, state = _jme(n)
    else:
        strategy = STRATEGIES[mechanism.removeprefix("paired_")]()
        release, state = _paired_ftrl(strategy, n)
        concrete = mf.optimize(strategy, STEPS)
        inverse = mf.inverse_coefficients(concrete, STEPS)
        options = {
            "strategy_sensitivity": mf.sensitivity(concrete, STEPS),
            "row_norms": np.sqrt(np.cumsum(inverse**2)),
        }
    violations, participated = _audit_moments(release, state, sampler, **options)
    assert violations == [], f"{mechanism} with {sampler_name}: {violations}"
    assert participated >= 1


def test_neighbour_invariance_of_clipped_outputs():
    """``clipped_fun`` released through the Gaussian mechanism; an empty draw (which ``clipped_fun`` refuses) noises
    a zero tree of the known output shape, the documented pattern."""
    from opake_core.clipping import clipped_fun
    from opake_core.noise import gaussian_noise

    sampler = _sampler("poisson")
    n = _expected_batch_size(sampler)

    w1 = _params()["w1"]

    def stats(x, y):  # a per-example tree shaped like the parameters (a gradient formed by hand)
        h = torch.tanh(x @ w1)
        return {"w1": torch.outer(x, h), "b1": h, "w2": torch.outer(h, F.one_hot(y, 3).to(h.dtype))}

    fn, clip_state = clipped_fun(stats, clipping_norm=C, normalize_by=n, batch_argnums=(0, 1))
    noise_fn, noise_state = gaussian_noise(noise_multiplier=Z, key=KEY, compute_dtype=torch.float64)
    zeros = {k: torch.zeros_like(v) for k, v in _params().items()}

    def release(params, state, batch):
        clipped = Clipped(zeros, C / n) if batch[0].shape[0] == 0 else fn(*batch, state=clip_state)[0]
        noised, new_state = noise_fn(clipped, state)
        return noised.value, new_state

    violations, participated = _audit(release, noise_state, sampler)
    assert violations == [] and participated >= 1


# -- the MoE router release (opake_core.router_release) next to the gradient -------------------------------------------


def _router_data():
    """``N`` token sequences ``[T=5, D=4]`` with 2 to 5 real tokens; routers of 2 layers over 4 experts, top-2."""
    gen = torch.Generator().manual_seed(4)
    tokens = torch.randn(N, 5, 4, generator=gen, dtype=torch.float64)
    lengths = torch.randint(2, 6, (N,), generator=gen)
    mask = (torch.arange(5)[None] < lengths[:, None]).to(torch.float64)
    return tokens, mask


def _router_logits(p, tokens):
    first = tokens @ p["r1"]
    return torch.stack([first, torch.tanh(first) @ p["r2"]])  # [L=2, T, E=4]


@pytest.mark.parametrize("sampler_name", PAIRS["gaussian"])
def test_neighbour_invariance_of_the_router_release(sampler_name):
    """The gradient (with the surrogate) and the router statistic of the same batch, both noised with fixed keys:
    removing (replacing) the target moves each stream by at most its declared sensitivity (twice it), and the pair,
    whitened by its noise, by at most ``1 / z_eff`` (``2 / z_eff``), ``z_eff = z / sqrt(1 + rho)``: one Gaussian
    release, as ``accounting.moe_aux`` accounts it. A step without the target changes nothing."""
    from opake_core.router_release import RouterGeometry, load_statistic, router_release, sum_statistics, surrogate_loss

    rho = 0.3
    sampler = _sampler(sampler_name)
    n = _expected_batch_size(sampler)
    geometry = RouterGeometry(top_k=2, num_experts=4, num_layers=2, max_tokens=4, mean_tokens=3.0)
    gen = torch.Generator().manual_seed(5)
    params = {k: torch.randn(4, 4, generator=gen, dtype=torch.float64) for k in ("r1", "r2", "w")}

    def loss(p, tokens, mask, load):
        logits = _router_logits(p, tokens)
        task = ((torch.tanh(tokens @ p["w"]) ** 2).sum(-1) * mask).sum() / mask.sum().clamp(min=1)
        return task + 0.5 * surrogate_loss(geometry, logits, load, mask), load_statistic(geometry, logits, mask)

    opt = optim.sgd(1.0)
    step_fn, dp_state = dp_sgd(
        loss,
        clipping_norm=C,
        noise_multiplier=Z,
        key=KEY,
        optimizer=opt,
        expected_batch_size=n,
        compute_dtype=torch.float64,
        has_aux=True,
    )
    release_fn, router_state = router_release(
        geometry, noise_multiplier=Z, ratio=rho, expected_batch_size=n, key=random.fold_in(KEY, "router")
    )

    def release(p, states, batch):
        dp, router = states
        tokens, mask = batch
        load = router.load.expand(tokens.shape[0], -1)
        new, _, dp_next, metrics = step_fn(p, opt.init(p), dp, (tokens, mask, load))
        stats = metrics.aux if metrics.aux is not None else torch.zeros(0, 2, 4, dtype=torch.float64)
        released, router_next = release_fn(sum_statistics(geometry, stats, expected_batch_size=n), router)
        return ({k: p[k] - new[k] for k in p}, released), (dp_next, router_next)

    tokens, mask = _router_data()
    # the extreme replacement: every token real, large, and routed to the same two experts in both layers
    extreme = (torch.full((5, 4), 1e3, dtype=torch.float64), torch.ones(5, dtype=torch.float64))
    z_eff = Z / math.sqrt(1 + rho)
    violations, participated = [], 0
    steps = _neighbours(release, params, (dp_state, router_state), sampler, (tokens, mask), lambda _: extreme,
                        move=lambda out: out[0])  # fmt: skip
    for step, (grad, stat), removed, replaced, took_part in steps:
        moves = [
            (kind, factor, [_distance(grad, g), float((stat.value - s.value).norm())])
            for kind, factor, (g, s) in (("remove", 1.0, removed), ("replace", 2.0, replaced))
        ]
        sigma = [Z * C / n, stat.noise_std]
        violations += _two_stream_violations(step, took_part, moves, [C / n, stat.sensitivity], sigma, 1 / z_eff)
        participated += took_part
    assert violations == [], f"router release with {sampler_name}: {violations}"
    assert participated >= 1
