"""bertjax's optimizers against the PyTorch references, update for update in fp32.

adamw against ``torch.optim.AdamW`` (and optimi's ``AdamW`` with ``decouple_lr``), stableadamw
against optimi's ``StableAdamW`` (the optimizer ModernBERT trains with), lamb against a NumPy
transcription of Algorithm 2 of the LAMB paper. Each run is 20 steps of the configs' schedules on
small tensors shaped like a model's (kernel, bias, LayerNorm scale, embedding), biases starting at
zero as in the models, the decay mask of bertjax.optim, and gradient spikes that push the per-tensor
RMS ratio of StableAdamW above 1. Parameters must agree to 1e-6 of each tensor's largest value.
"""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from bertjax import optim
from configs import base

optimi = pytest.importorskip("optimi")
torch = pytest.importorskip("torch")

STEPS = 20
RTOL = 1e-6
SHAPES = {
    "dense": {"kernel": (12, 8), "bias": (8,)},
    "LayerNorm": {"scale": (8,), "bias": (8,)},
    "word_embeddings": {"embedding": (16, 8)},
}
# (step, tensor, factor): a gradient much larger than its history, so g^2 / v_hat > 1 on average.
SPIKES = [
    (6, ("dense", "kernel"), 30.0),
    (9, ("dense", "bias"), 20.0),
    (13, ("word_embeddings", "embedding"), 50.0),
]


def _flat(tree):
    return {path: np.asarray(x) for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _initial_params():
    rng = np.random.default_rng(0)

    def init(path, shape):
        if path[-1] == "bias":
            return np.zeros(shape, np.float32)
        if path[-1] == "scale":
            return np.ones(shape, np.float32)
        return rng.normal(0.0, 0.5, shape).astype(np.float32)

    return {
        module: {name: init((module, name), shape) for name, shape in tensors.items()}
        for module, tensors in SHAPES.items()
    }


def _gradients():
    rng = np.random.default_rng(1)
    grads = []
    for step in range(STEPS):
        g = {
            module: {
                name: rng.normal(0.0, 1.0, shape).astype(np.float32) for name, shape in t.items()
            }
            for module, t in SHAPES.items()
        }
        for spike_step, (module, name), factor in SPIKES:
            if step == spike_step:
                g[module][name] = g[module][name] * np.float32(factor)
        grads.append(g)
    return grads


def _config(**optimizer) -> ml_collections.ConfigDict:
    c = base.get_config()
    c.optimizer.update(optimizer)
    return c


def _run_bertjax(config):
    """Parameters after each of STEPS updates, and the per-step learning rates."""
    tx, schedule = optim.create_optimizer(config, total_steps=STEPS)
    params = jax.tree.map(jnp.asarray, _initial_params())
    state = tx.init(params)
    update = jax.jit(tx.update)
    history = []
    for g in _gradients():
        updates, state = update(jax.tree.map(jnp.asarray, g), state, params)
        params = optax.apply_updates(params, updates)
        history.append(_flat(params))
    return history, [float(schedule(step)) for step in range(STEPS)]


def _torch_groups(weight_decay):
    """Torch tensors of the initial parameters in two groups: decayed (bertjax's mask) or not."""
    params = _initial_params()
    mask = _flat(optim.weight_decay_mask(params))
    tensors = {k: torch.tensor(v, requires_grad=True) for k, v in _flat(params).items()}
    decay = [t for k, t in tensors.items() if mask[k]]
    no_decay = [t for k, t in tensors.items() if not mask[k]]
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return tensors, groups


def _run_torch(make_optimizer, weight_decay, lrs, clip_norm=0.0):
    """Parameters after each step of the torch optimizer fed the same gradients and learning
    rates, and the largest per-tensor RMS ratio g^2 / v_hat of each step."""
    tensors, groups = _torch_groups(weight_decay)
    opt = make_optimizer(groups)
    history, ratios = [], []
    for lr, g in zip(lrs, _gradients()):
        flat = _flat(g)
        for k, t in tensors.items():
            t.grad = torch.tensor(flat[k])
        if clip_norm:
            torch.nn.utils.clip_grad_norm_(list(tensors.values()), clip_norm)
        for group in opt.param_groups:
            group["lr"] = lr
        grads = {k: t.grad.clone() for k, t in tensors.items()}
        opt.step()
        if isinstance(opt, optimi.StableAdamW):  # its exp_avg_sq is the bias-corrected v_hat
            v_hats = {k: opt.state[t]["exp_avg_sq"].clamp_min(1e-12) for k, t in tensors.items()}
            ratios.append(max(float((grads[k] ** 2 / v_hats[k]).mean().sqrt()) for k in grads))
        history.append({k: t.detach().numpy().copy() for k, t in tensors.items()})
    return history, ratios


def _assert_matches(ours, reference):
    """Every tensor after every step within RTOL of the reference, relative to the tensor's largest
    value (elementwise, an entry crossing zero would compare fp32 rounding with itself)."""
    worst = 0.0
    for step, (a, b) in enumerate(zip(ours, reference)):
        for k in b:
            scale = float(np.max(np.abs(b[k])))
            difference = float(np.max(np.abs(a[k] - b[k])))
            worst = max(worst, difference / scale if scale else difference)
            assert difference <= RTOL * scale, (
                f"step {step + 1}, {jax.tree_util.keystr(k)}: max |ours - reference| = "
                f"{difference:.3g}, with max |reference| = {scale:.3g}"
            )
    return worst


def _assert_moved(history):
    """The comparison is not vacuous: every tensor moved well beyond the tolerance."""
    start = _flat(_initial_params())
    for k, v in history[-1].items():
        assert np.max(np.abs(v - start[k])) > 1e-3, jax.tree_util.keystr(k)


@pytest.mark.parametrize("schedule", ["linear", "wsd"])
def test_adamw_matches_torch_adamw(schedule):
    """BERT's recipe (clip to global norm 1, decay 0.01 on kernels and embeddings)."""
    config = _config(
        name="adamw",
        learning_rate=1e-2,
        warmup_steps=4,
        weight_decay=0.01,
        schedule=schedule,
        decay_fraction=0.3,
        end_lr_factor=0.1,
    )
    ours, lrs = _run_bertjax(config)

    def make(groups):
        return torch.optim.AdamW(groups, lr=lrs[0], betas=(0.9, 0.999), eps=1e-6, foreach=False)

    # torch's clip divides by (norm + 1e-6), optax's by norm: 1e-6 / norm relative on the
    # gradient, which Adam's m / sqrt(v) all but cancels.
    reference, _ = _run_torch(make, 0.01, lrs, clip_norm=1.0)
    _assert_moved(ours)
    _assert_matches(ours, reference)


def test_adamw_decoupled_lr_matches_optimi_adamw():
    """decouple_lr=True: the decay follows lr_t / peak (optimi's AdamW, max_lr = the peak)."""
    config = _config(
        name="adamw",
        learning_rate=1e-2,
        warmup_steps=4,
        weight_decay=5e-4,
        decouple_lr=True,
        grad_clip_norm=0.0,
    )
    ours, lrs = _run_bertjax(config)

    def make(groups):
        return optimi.AdamW(
            groups,
            lr=1e-2,
            betas=(0.9, 0.999),
            eps=1e-6,
            decouple_lr=True,
            kahan_sum=False,
            foreach=False,
            triton=False,
        )

    reference, _ = _run_torch(make, 5e-4, lrs)
    _assert_moved(ours)
    _assert_matches(ours, reference)


@pytest.mark.parametrize(
    "decouple_lr,weight_decay", [(False, 0.1), (True, 5e-4)], ids=["coupled", "decoupled"]
)
def test_stableadamw_matches_optimi(decouple_lr, weight_decay):
    """ModernBERT's recipe: wsd with a 1-sqrt decay, b2 0.98, no gradient clipping."""
    config = _config(
        name="stableadamw",
        learning_rate=1e-2,
        warmup_steps=3,
        b2=0.98,
        weight_decay=weight_decay,
        decouple_lr=decouple_lr,
        grad_clip_norm=0.0,
        schedule="wsd",
        decay_fraction=0.3,
        decay_shape="1-sqrt",
    )
    ours, lrs = _run_bertjax(config)

    def make(groups):
        # lr = the peak, so max_lr (decouple_lr's divisor) is the peak, as in ModernBERT's main.py.
        return optimi.StableAdamW(
            groups,
            lr=1e-2,
            betas=(0.9, 0.98),
            eps=1e-6,
            decouple_lr=decouple_lr,
            kahan_sum=False,
            foreach=False,
            triton=False,
        )

    reference, ratios = _run_torch(make, weight_decay, lrs)
    assert max(ratios) > 3.0  # the spikes are clipped
    _assert_moved(ours)
    _assert_matches(ours, reference)


def test_stableadamw_clipping_divides_the_weight_decay_too():
    """At a step whose RMS ratio is above 1 the decay term is divided by it as well, as in optimi:
    the difference between the updates with and without decay is lr_t / max(1, rms) * wd * p."""
    lr, wd, spike_step = 1e-2, 0.1, SPIKES[0][0]
    configs = [
        _config(
            name="stableadamw",
            learning_rate=lr,
            warmup_steps=0,
            b2=0.98,
            weight_decay=decay,
            grad_clip_norm=0.0,
            schedule="wsd",
            decay_fraction=0.0,
        )
        for decay in (wd, 0.0)
    ]
    with_decay, _ = optim.create_optimizer(configs[0], total_steps=STEPS)
    without_decay, _ = optim.create_optimizer(configs[1], total_steps=STEPS)
    params = jax.tree.map(jnp.asarray, _initial_params())
    state = with_decay.init(params)
    grads = _gradients()
    for g in grads[:spike_step]:
        updates, state = with_decay.update(g, state, params)
        params = optax.apply_updates(params, updates)
    g = grads[spike_step]
    decayed, _ = with_decay.update(g, state, params)
    plain, new_state = without_decay.update(g, state, params)
    kernel = params["dense"]["kernel"]
    v_hat = new_state[0][0].nu["dense"]["kernel"] / (1 - 0.98 ** (spike_step + 1))
    rms = float(np.sqrt(np.mean(g["dense"]["kernel"] ** 2 / np.maximum(v_hat, 1e-12))))
    assert rms > 2.0
    np.testing.assert_allclose(
        decayed["dense"]["kernel"] - plain["dense"]["kernel"],
        -lr / rms * wd * kernel,
        rtol=1e-4,
    )


def _numpy_lamb(lrs, weight_decay, b1=0.9, b2=0.999, eps=1e-6, clip_norm=1.0):
    """LAMB, Algorithm 2 of You et al. (2020, arXiv:1904.00962) with phi(z) = z, in float64:
    m_hat / (sqrt(v_hat) + eps) + wd * x, scaled by ||x|| / ||that|| (1 where a norm is zero), after
    clipping the gradient to global norm ``clip_norm`` (bertjax's default grad_clip_norm)."""
    params = {k: v.astype(np.float64) for k, v in _flat(_initial_params()).items()}
    mask = _flat(optim.weight_decay_mask(_initial_params()))
    m = {k: np.zeros_like(v) for k, v in params.items()}
    v = {k: np.zeros_like(x) for k, x in params.items()}
    history = []
    for t, (lr, g) in enumerate(zip(lrs, _gradients()), start=1):
        g = {k: x.astype(np.float64) for k, x in _flat(g).items()}
        norm = np.sqrt(sum(np.sum(x**2) for x in g.values()))
        if norm > clip_norm:
            g = {k: x * clip_norm / norm for k, x in g.items()}
        for k, x in params.items():
            m[k] = b1 * m[k] + (1 - b1) * g[k]
            v[k] = b2 * v[k] + (1 - b2) * g[k] ** 2
            r = (m[k] / (1 - b1**t)) / (np.sqrt(v[k] / (1 - b2**t)) + eps)
            r = r + (weight_decay if mask[k] else 0.0) * x
            x_norm, r_norm = np.linalg.norm(x), np.linalg.norm(r)
            ratio = x_norm / r_norm if x_norm > 0 and r_norm > 0 else 1.0
            params[k] = x - lr * ratio * r
        history.append(dict(params))
    return history


def test_lamb_matches_the_papers_algorithm():
    """bertjax's lamb (optax.lamb's chain) is the paper's Algorithm 2 with the trust ratio on every
    tensor, the undecayed biases and LayerNorm scales too (NVIDIA's FusedLAMB and TF Addons' LAMB
    leave those out); the biases start at ||x|| = 0 and take a ratio of 1."""
    config = _config(
        name="lamb", learning_rate=1e-2, warmup_steps=4, weight_decay=0.01, end_lr_factor=0.1
    )
    ours, lrs = _run_bertjax(config)
    reference = _numpy_lamb(lrs, weight_decay=0.01)
    _assert_moved(ours)
    _assert_matches(ours, reference)


def test_decouple_lr_is_refused_where_the_optimizer_has_none():
    with pytest.raises(ValueError, match="optimizer.decouple_lr=True: lamb"):
        optim.create_optimizer(
            _config(name="lamb", decouple_lr=True, warmup_steps=1), total_steps=10
        )


def test_modernbert_configs_decay_as_modernbert():
    """ModernBERT's decoupled_stableadamw: weight decay 1e-5 with decouple_lr, no gradient clip."""
    from configs import demo, modernbert_base, modernbert_large

    for module in (modernbert_base, modernbert_large, demo):
        opt = module.get_config().optimizer
        assert (opt.name, opt.decouple_lr, opt.weight_decay) == ("stableadamw", True, 1e-5)
        assert opt.grad_clip_norm == 0.0 and opt.b2 == 0.98
    assert modernbert_base.get_config().optimizer.learning_rate == 8e-4
    assert base.get_config().optimizer.decouple_lr is False


def test_state_layout_is_the_previous_one():
    """Checkpoints of earlier runs still restore: each optimizer's state has the tree of the
    optax construction it replaces (optax.adamw, optax.lamb, the former stableadamw chain)."""
    params = jax.tree.map(jnp.asarray, _initial_params())
    mask = optim.weight_decay_mask
    lr = optax.constant_schedule(1.0)
    previous = {
        "adamw": optax.adamw(lr, weight_decay=0.01, mask=mask),
        "lamb": optax.lamb(lr, weight_decay=0.01, mask=mask),
        "stableadamw": optax.chain(
            optax.scale_by_adam(),
            optax.add_decayed_weights(0.01, mask),
            optax.scale_by_learning_rate(lr),
        ),
    }
    for name, old in previous.items():
        tx, _ = optim.create_optimizer(_config(name=name, warmup_steps=1), total_steps=10)
        old = optax.chain(optax.clip_by_global_norm(1.0), old)
        assert jax.tree.structure(tx.init(params)) == jax.tree.structure(old.init(params)), name
