"""The hand-written fast paths equal what autodiff / the straightforward code computes."""

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax import losses
from bertjax.layers import fast_ops
from bertjax.layers.attention import HeadProjection
from bertjax.layers.fast_ops import gelu, tied_decoder
from bertjax.models.bert import fused_qkv, get_preset


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tied_decoder_value_and_gradients_equal_autodiff(dtype):
    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(k1, (3, 5, 16), dtype)  # [batch, predictions, hidden]
    emb = (jax.random.normal(k2, (37, 16)) * 0.3).astype(dtype)  # [vocab, hidden]
    bias = jax.random.normal(k3, (37,))
    cot = jax.random.normal(k4, (3, 5, 37))

    def reference(x, emb, bias):
        return jnp.einsum("...h,vh->...v", x, emb).astype(jnp.float32) + bias

    @functools.partial(jax.jit, static_argnums=0)  # one program each (op by op, ~20 compiles)
    def value_and_vjp(f, x, emb, bias):
        out, vjp = jax.vjp(f, x, emb, bias)
        return out, vjp(cot)

    ours, grads = value_and_vjp(tied_decoder, x, emb, bias)
    ref, ref_grads = value_and_vjp(reference, x, emb, bias)
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(ours, ref, rtol=tol, atol=tol)
    for a, b in zip(grads, ref_grads):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_allclose(
            np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol * 10
        )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("chunk", [8, 37, 0])  # 4 equal chunks + a tail of 5; one; the default
def test_decoder_nll_equals_the_decoder_then_the_cross_entropy(dtype, chunk):
    """The fused decoder + cross-entropy, chunk by chunk over the vocabulary, gives the loss,
    the correctness and the gradients of ``losses.nll_and_correct(tied_decoder(...))``."""
    k1, k2, k3, k4, k5 = jax.random.split(jax.random.key(1), 5)
    x = jax.random.normal(k1, (3, 5, 16), dtype)
    emb = (jax.random.normal(k2, (37, 16)) * 0.5).astype(dtype)
    bias = jax.random.normal(k3, (37,))
    labels = jax.random.randint(k4, (3, 5), 0, 37)
    weights = jax.random.uniform(k5, (3, 5))

    def reference(x, emb, bias):
        nll, correct = losses.nll_and_correct(tied_decoder(x, emb, bias), labels)
        return (nll * weights).sum(), correct

    def fused(x, emb, bias):
        nll, margin = fast_ops.decoder_nll(x, emb, bias, labels, chunk)
        return (nll * weights).sum(), (margin >= 0).astype(jnp.float32)

    (want, want_correct), want_grads = jax.jit(
        jax.value_and_grad(reference, (0, 1, 2), has_aux=True)
    )(x, emb, bias)
    (got, correct), grads = jax.jit(jax.value_and_grad(fused, (0, 1, 2), has_aux=True))(
        x, emb, bias
    )
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(got, want, rtol=tol)
    np.testing.assert_array_equal(correct, want_correct)
    for a, b in zip(grads, want_grads):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_allclose(
            np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=tol, atol=tol
        )


def test_the_pretraining_loss_has_no_vocabulary_sized_buffer():
    """The pretraining step's loss (PreTrainingModel with the labels) holds no [predictions,
    vocab] array: its largest intermediate over the vocabulary is one chunk."""
    from bertjax.models.heads import PreTrainingModel

    cfg = get_preset("tiny", vocab_size=3 * fast_ops.DECODER_CHUNK + 11, num_layers=1)
    model = PreTrainingModel(cfg, nsp=False)
    ids = jnp.ones((2, 8), jnp.int32)
    positions, labels = jnp.zeros((2, 6), jnp.int32), jnp.ones((2, 6), jnp.int32)
    # shapes only: lowering needs no values (and an init op by op is some 80 small compiles)
    params = jax.eval_shape(model.init, jax.random.key(0), ids, ids, ids, positions)["params"]

    def loss(params):
        out = model.apply({"params": params}, ids, ids, ids, positions, masked_lm_ids=labels)
        return out["mlm_nll"].sum()

    text = jax.jit(jax.grad(loss)).lower(params).as_text()
    wide = {int(n) for n in re.findall(r"tensor<\d+x\d+x(\d+)x?f32>", text)}
    wide |= {int(n) for n in re.findall(r"tensor<12x(\d+)xf32>", text)}
    assert cfg.vocab_size not in wide and fast_ops.DECODER_CHUNK in wide, sorted(wide)


class _SeparateQKV(nn.Module):
    config: object

    @nn.compact
    def __call__(self, x):
        return tuple(HeadProjection(self.config, name=n)(x) for n in ("query", "key", "value"))


class _FusedQKV(nn.Module):
    config: object

    @nn.compact
    def __call__(self, x):
        return fused_qkv(self.config, x)


def test_fused_qkv_has_the_same_params_and_outputs_as_three_projections():
    cfg = get_preset("tiny", vocab_size=50)
    x = jax.random.normal(jax.random.key(1), (2, 7, cfg.hidden_size))
    params = jax.jit(_SeparateQKV(cfg).init)(jax.random.key(2), x)
    fused_params = jax.eval_shape(_FusedQKV(cfg).init, jax.random.key(2), x)
    assert jax.tree.structure(params) == jax.tree.structure(fused_params)
    ref = jax.jit(_SeparateQKV(cfg).apply)(params, x)
    ours = jax.jit(_FusedQKV(cfg).apply)(params, x)
    for a, b in zip(ours, ref):
        assert a.shape == (2, 7, cfg.num_heads, cfg.head_dim)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    def loss(p, module):
        return sum(jnp.sum(jnp.sin(t)) for t in module.apply(p, x))

    grad = jax.jit(jax.grad(loss), static_argnums=1)
    g_ref = grad(params, _SeparateQKV(cfg))
    g_ours = grad(params, _FusedQKV(cfg))
    for a, b in zip(jax.tree.leaves(g_ours), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_loss_and_accuracy_from_one_max_equal_logsumexp_and_argmax():
    logits = jax.random.normal(jax.random.key(3), (4, 6, 101)) * 4
    labels = jax.random.randint(jax.random.key(4), (4, 6), 0, 101)
    labels = labels.at[0, :3].set(jnp.argmax(logits[0, :3], axis=-1))  # some correct ones

    @jax.jit  # one program (op by op, some 60 small compiles)
    def ours_and_reference(logits, labels):
        nll, correct = losses.nll_and_correct(logits, labels)
        grad = jax.grad(lambda z: losses.cross_entropy(z, labels).sum())(logits)
        ref_nll = (
            jax.nn.logsumexp(logits, -1)
            - jnp.take_along_axis(logits, labels[..., None], -1)[..., 0]
        )
        ref_correct = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
        ref_grad = jax.nn.softmax(logits) - jax.nn.one_hot(labels, 101)
        return (nll, correct, grad), (ref_nll, ref_correct, ref_grad)

    (nll, correct, grad), (ref_nll, ref_correct, ref_grad) = ours_and_reference(logits, labels)
    np.testing.assert_allclose(nll, ref_nll, rtol=1e-6, atol=1e-5)
    np.testing.assert_array_equal(correct, ref_correct)
    np.testing.assert_allclose(grad, ref_grad, atol=1e-6)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gelu_keeping_phi_equals_exact_gelu_and_its_autodiff(dtype):
    x = (jnp.linspace(-8.0, 8.0, 4001) + 0.0013).astype(dtype)
    ref_fn = functools.partial(jax.nn.gelu, approximate=False)
    tol = 1e-6 if dtype == jnp.float32 else 1e-2

    @functools.partial(jax.jit, static_argnums=0)  # one program each (op by op, ~18 compiles)
    def value_and_grad(f, x):
        return f(x), jax.vmap(jax.grad(lambda v: f(v).astype(jnp.float32)))(x)

    (value, grad), (ref, ref_grad) = value_and_grad(gelu, x), value_and_grad(ref_fn, x)
    np.testing.assert_allclose(
        np.asarray(value, np.float32), np.asarray(ref, np.float32), rtol=tol, atol=tol
    )
    np.testing.assert_allclose(
        np.asarray(grad, np.float32), np.asarray(ref_grad, np.float32), rtol=tol, atol=tol * 5
    )


@pytest.mark.parametrize(
    "spec, a_shape, b_shape",
    [
        ("abc,cd->abd", (2, 5, 8), (8, 6)),  # a dense layer
        ("abc,cxyz->abxyz", (2, 5, 8), (8, 3, 2, 4)),  # fused QKV
        ("abcd,cde->abe", (2, 5, 3, 4), (3, 4, 6)),  # attention output (two axes in)
    ],
)
def test_mixed_precision_einsum_accumulates_in_fp32_forward_and_backward(spec, a_shape, b_shape):
    """``fast_ops.einsum`` with bf16 operands: the fp32 einsum of the same bf16 values, rounded
    once to bf16, and gradients equal to the fp32 reference's within bf16 rounding; fp32 operands
    take the plain einsum (bit for bit)."""
    k1, k2, k3 = jax.random.split(jax.random.key(4), 3)
    a = jax.random.normal(k1, a_shape).astype(jnp.bfloat16)
    b = jax.random.normal(k2, b_shape).astype(jnp.bfloat16)
    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)

    @jax.jit  # one program (op by op, some 20 small compiles)
    def ours_and_reference(a, b, cot):
        ours, vjp = jax.vjp(lambda a, b: fast_ops.einsum(spec, a, b), a, b)
        ref, ref_vjp = jax.vjp(lambda a, b: jnp.einsum(spec, a, b), f32(a), f32(b))
        return ours, vjp(cot), ref, ref_vjp(f32(cot))

    shape = jax.eval_shape(lambda a, b: fast_ops.einsum(spec, a, b), a, b).shape
    cot = jax.random.normal(k3, shape).astype(jnp.bfloat16)
    ours, grads, ref, ref_grads = ours_and_reference(a, b, cot)
    assert ours.dtype == jnp.bfloat16
    np.testing.assert_array_equal(f32(ours), f32(ref.astype(jnp.bfloat16)))
    for got, want in zip(grads, ref_grads):
        assert got.dtype == jnp.bfloat16 and got.shape == want.shape
        np.testing.assert_allclose(f32(got), want, rtol=1e-2, atol=1e-2)
    # Every product, forward and backward, takes bf16 operands and accumulates in fp32 (XLA CPU
    # runs those at twice the fp32 rate; autodiff's backward would upcast the operands).
    # On TPU (also when compiled for one on a CPU host) the plain product is kept.
    grads = jax.jit(jax.value_and_grad(lambda a, b: f32(fast_ops.einsum(spec, a, b)).sum(), (0, 1)))
    cpu, tpu = r"xbf16>, tensor<[\dx]*xbf16>\) -> tensor<[\dx]*xf32>", r"\) -> tensor<[\dx]*xbf16>"
    for platform, want in (("cpu", cpu), ("tpu", tpu)):
        text = grads.trace(a, b).lower(lowering_platforms=(platform,)).as_text()
        dots = re.findall(r"stablehlo.dot_general.*", text)
        assert len(dots) == 3, (platform, dots)
        assert all(re.search(want + "$", dot) for dot in dots), (platform, dots)
    a32, b32 = f32(a), f32(b)
    np.testing.assert_array_equal(fast_ops.einsum(spec, a32, b32), jnp.einsum(spec, a32, b32))
    num_in = 2 if spec.startswith("abcd") else 1  # the same product as fast_ops.contract
    np.testing.assert_array_equal(f32(fast_ops.contract(a, b, num_in)), f32(ours))


def test_the_chunked_mlm_loss_trains_as_the_logits(tmp_path):
    """Two pretraining steps with ``train.mlm_loss=chunked`` give the losses, metrics and params of
    ``logits`` (to float rounding); an unknown mode is one line naming the key."""
    from train_fixtures import tiny_config

    from bertjax import train

    config = tiny_config(tmp_path, steps=2)  # one prepared dataset for the three configs
    batches = []  # the first run's two batches, given to the second as they are

    def run(mode):
        config.train.mlm_loss = mode
        task = train.prepared_task(config, str(tmp_path / mode))
        setup = train.build(config, str(tmp_path / mode), task)
        state = setup.init_state(jax.random.key_data(jax.random.key(0)))
        step = train.jit_train_step(setup, 1)
        if not batches:
            data = task.train_data(setup.phases[0], 0, 1)
            batches.extend({k: jnp.asarray(v) for k, v in next(data).items()} for _ in range(2))
        metrics = []
        for batch in batches:
            state, m = step(state, batch)
            metrics.append({k: float(v) for k, v in jax.device_get(m).items()})
        return jax.device_get(state.params), metrics

    chunked_params, chunked = run("chunked")
    params, plain = run("logits")
    for got, want in zip(chunked, plain):
        assert got.keys() == want.keys()
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)
    for a, b in zip(jax.tree.leaves(chunked_params), jax.tree.leaves(params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    config.train.mlm_loss = "fused"
    task = train.prepared_task(config, str(tmp_path / "fused"))
    with pytest.raises(ValueError, match=r"^config key train.mlm_loss='fused' is not one of"):
        task.chunked_mlm_loss((2, 3), 100)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_layer_norm_equals_flax_values_and_gradients(dtype):
    """bertjax's exact-variance LayerNorm: Flax's values bit for bit (both variance forms, with
    and without bias), and autodiff's gradients to rounding; its module has Flax's parameters."""
    from bertjax.layers.core import LayerNorm

    k1, k2, k3, k4 = jax.random.split(jax.random.key(0), 4)
    x = (jax.random.normal(k1, (3, 5, 48)) * 3 + 1.5).astype(dtype)  # a common offset
    dy = jax.random.normal(k2, x.shape).astype(dtype)
    scale = 1 + 0.1 * jax.random.normal(k3, (48,))
    bias = 0.1 * jax.random.normal(k4, (48,))
    for exact in (True, False):
        for with_bias in (True, False):
            ref = nn.LayerNorm(
                epsilon=1e-5, use_fast_variance=not exact, use_bias=with_bias, dtype=dtype
            )
            params = {"params": {"scale": scale, **({"bias": bias} if with_bias else {})}}
            mine = LayerNorm(epsilon=1e-5, exact_variance=exact, use_bias=with_bias, dtype=dtype)
            init = nn.unbox(mine.init(jax.random.key(0), x))
            assert jax.tree.map(jnp.shape, init) == jax.tree.map(jnp.shape, params)

            @functools.partial(jax.jit, static_argnums=0)
            def both(modules, params, x, dy):
                out = []
                for module in modules:
                    y, vjp = jax.vjp(module.apply, params, x)
                    out.append((y, vjp(dy)))
                return out

            (y_ref, g_ref), (y, g) = both((ref, mine), params, x, dy)
            np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_ref, np.float32))
            tol = (
                {"rtol": 2e-6, "atol": 5e-6}
                if dtype == jnp.float32
                else {"rtol": 1e-2, "atol": 2e-2}
            )
            for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
                np.testing.assert_allclose(
                    np.asarray(a, np.float32), np.asarray(b, np.float32), **tol
                )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_add_layer_norm_equals_the_sum_then_the_norm(dtype):
    """A pre-LN block's residual sum and its norm with one backward: the values of ``x + delta``
    and Flax's norm of it bit for bit, and autodiff's gradients of that composition (the
    residual's cotangent and the norm's summed) to rounding."""
    from bertjax.layers.core import LayerNorm

    k1, k2, k3, k4 = jax.random.split(jax.random.key(1), 4)
    x = (jax.random.normal(k1, (3, 5, 48)) * 2 + 1.0).astype(dtype)
    delta = jax.random.normal(k2, x.shape).astype(dtype)
    dh, dy = (jax.random.normal(k, x.shape).astype(dtype) for k in jax.random.split(k3))
    params = {"params": {"scale": 1 + 0.1 * jax.random.normal(k4, (48,))}}
    ref = nn.LayerNorm(epsilon=1e-5, use_fast_variance=False, use_bias=False, dtype=dtype)
    mine = LayerNorm(epsilon=1e-5, exact_variance=True, use_bias=False, dtype=dtype)

    @jax.jit
    def both(params, x, delta):
        def composed(params, x, delta):  # the sum materialised (no excess precision into the norm)
            h = jax.lax.optimization_barrier(x + delta)
            return h, ref.apply(params, h)

        def fused(params, x, delta):
            return mine.apply(params, x, add=delta)

        out = []
        for f in (composed, fused):
            (h, y), vjp = jax.vjp(f, params, x, delta)
            out.append((h, y, vjp((dh, dy))))
        return out

    (h_ref, y_ref, g_ref), (h, y, g) = both(params, x, delta)
    np.testing.assert_array_equal(np.asarray(h, np.float32), np.asarray(h_ref, np.float32))
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(y_ref, np.float32))
    tol = {"rtol": 2e-6, "atol": 5e-6} if dtype == jnp.float32 else {"rtol": 1e-2, "atol": 2e-2}
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), **tol)
