"""The accelerator checks (marker ``accelerator``): every test here runs on the CPU in ``make test``
and on a GPU or TPU through ``make device-check`` (``launch/device_check.sh``), which selects them
with ``-m accelerator``. Nothing here imports TensorFlow: the accelerator machine may have none.

Tolerances (stated once, used below):
- an attention path in fp32 against ``xla`` in fp32, at real tokens: 2e-5 absolute (fp32 matmuls
  at "highest" precision, so a GPU's TF32 does not enter);
- a path that runs in bf16 only (cuDNN) against ``xla`` in bf16: max 0.1 and mean 1e-2 absolute on
  hidden states of unit scale (two bf16 programs round differently; a wrong mask is O(1));
- a bf16 pretraining loss against fp32 with the same parameters: 1.5% relative.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bertjax import models
from bertjax.layers.attention import resolve_impl
from bertjax.models.heads import PreTrainingModel, encoder

pytestmark = pytest.mark.accelerator

PLATFORM = jax.default_backend()
# The attention paths each platform can run, compared with ``xla`` there.
IMPLS = {
    "cpu": ["dot_product", "auto"],
    "gpu": ["dot_product", "cudnn", "auto"],
    "tpu": ["dot_product", "splash", "auto"],
}.get(PLATFORM, ["dot_product", "auto"])
BF16_ONLY = {"cudnn"}  # cuDNN's fused attention takes fp16/bf16 operands only
SEQ, WINDOW = 128, 32  # ModernBERT's local layers: half 16 tiles 128 -> the band blocks apply


def _config(arch: str, impl: str, dtype: str):
    common = dict(attention_impl=impl, dtype=dtype, hidden_dropout=0.0, attention_dropout=0.0)
    if arch == "bert":
        return models.get_preset("tiny", "bert", max_position_embeddings=SEQ, **common)
    # layer 0 global, layers 1-2 sliding-window (global every 3rd layer)
    return models.get_preset(
        "modernbert-tiny", "modernbert", num_layers=3, local_attention=WINDOW, **common
    )


def _batch(layout: str, vocab: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    b = 4
    ids = rng.integers(5, vocab, size=(b, SEQ)).astype(np.int32)
    if layout == "padded":
        lengths = [SEQ, 77, 100, 9]
        mask = (np.arange(SEQ)[None] < np.asarray(lengths)[:, None]).astype(np.int32)
        return dict(input_ids=ids * mask, input_mask=mask, pack_ids=None)
    # packed rows: sequences 1..n side by side, 0 = padding at the end
    rows = [[50, 60], [SEQ], [20, 20, 20, 40], [33, 17]]
    pack = np.zeros((b, SEQ), np.int32)
    for r, lengths in enumerate(rows):
        start = 0
        for n, length in enumerate(lengths, start=1):
            pack[r, start : start + length] = n
            start += length
    mask = (pack > 0).astype(np.int32)
    return dict(input_ids=ids * mask, input_mask=mask, pack_ids=pack)


def _encode(cfg, params, batch):
    module = encoder(cfg, add_pooler=False)
    pack = batch["pack_ids"]

    def run(params, ids, mask, pack):
        types = jnp.zeros_like(ids)
        out = module.apply(params, ids, types, mask, deterministic=True, pack_ids=pack)
        return out.sequence_output.astype(jnp.float32)

    pack = None if pack is None else jnp.asarray(pack)
    with jax.default_matmul_precision("highest"):
        return np.asarray(
            jax.jit(run)(
                params, jnp.asarray(batch["input_ids"]), jnp.asarray(batch["input_mask"]), pack
            )
        )


@functools.cache
def _params(arch: str, dtype: str):
    """The encoder's parameters, one set per architecture (they depend on the shapes only: the
    padded and packed batches share them). ``init`` jitted: one compile, not one per op."""
    module = encoder(_config(arch, "xla", dtype), add_pooler=False)
    ids = jnp.zeros((4, SEQ), jnp.int32)
    return jax.jit(functools.partial(module.init, deterministic=True))(
        jax.random.key(0), ids, ids, ids + 1
    )


@functools.cache
def _reference(arch: str, layout: str, dtype: str) -> np.ndarray:
    """``xla``'s hidden states, computed once for every attention path compared with them."""
    cfg = _config(arch, "xla", dtype)
    return _encode(cfg, _params(arch, dtype), _batch(layout, cfg.vocab_size))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", ["padded", "packed"])
@pytest.mark.parametrize("arch", ["bert", "modernbert"])
def test_attention_impl_equals_xla(arch, layout, impl):
    """Every attention path of this platform gives ``xla``'s hidden states at real tokens, on
    padded and packed batches, with BERT's (global) and ModernBERT's (global + sliding) masks."""
    resolved = resolve_impl(impl)
    if impl != "xla" and resolved == "xla":
        pytest.skip(f"{impl} is xla on {PLATFORM}: the reference itself")
    if resolved == "splash" and PLATFORM != "tpu":
        pytest.skip("the splash kernel runs on TPU (its interpreter test is test_splash_attention)")
    dtype = "bfloat16" if resolved in BF16_ONLY else "float32"
    batch = _batch(layout, _config(arch, "xla", dtype).vocab_size)
    want = _reference(arch, layout, dtype)
    got = _encode(_config(arch, impl, dtype), _params(arch, dtype), batch)
    real = batch["input_mask"] > 0
    assert np.isfinite(got[real]).all()
    diff = np.abs(got[real] - want[real])
    if dtype == "float32":
        np.testing.assert_allclose(got[real], want[real], atol=2e-5, rtol=0)
    else:
        assert diff.max() <= 0.1 and diff.mean() <= 1e-2, (diff.max(), diff.mean())


@pytest.mark.parametrize("arch", ["bert", "modernbert"])
def test_bf16_loss_within_tolerance_of_fp32(arch):
    """The masked-LM loss of the same parameters in bf16 (the platform's attention) and fp32."""
    fp32 = _config(arch, "xla", "float32")
    batch = _batch("padded", fp32.vocab_size)
    model = PreTrainingModel(fp32, nsp=False)
    ids, mask = jnp.asarray(batch["input_ids"]), jnp.asarray(batch["input_mask"])
    init = functools.partial(model.init, deterministic=True)
    params = jax.jit(init)(jax.random.key(1), ids, None, mask)  # one compile, not one per op
    labels = jnp.asarray(np.random.default_rng(1).integers(5, fp32.vocab_size, ids.shape))

    def loss(cfg):
        def f(params):
            logits = (
                PreTrainingModel(cfg, nsp=False)
                .apply(params, ids, None, mask, deterministic=True)["mlm_logits"]
                .astype(jnp.float32)
            )
            logp = jax.nn.log_softmax(logits)
            nll = -jnp.take_along_axis(logp, labels[..., None], axis=-1)[..., 0]
            return (nll * mask).sum() / mask.sum()

        with jax.default_matmul_precision("highest"):
            return float(jax.jit(f)(params))

    want, got = loss(fp32), loss(_config(arch, "auto", "bfloat16"))
    assert np.isfinite(got)
    assert abs(got - want) / want < 0.015, (got, want)


def _one_step(num_devices: int, arch: str):
    """Loss and parameters after one real pretraining train_step on the first N local devices."""
    from bertjax import sharding, train
    from bertjax.tasks.pretraining import PretrainingTask
    from bertjax.tools import bench

    preset = "tiny" if arch == "bert" else "modernbert-tiny"
    args = bench.parse_args(
        [
            f"--architecture={arch}",
            f"--preset={preset}",
            "--attention_impl=auto",
            "--seq=64",
            "--batch=8",
            "--vocab_size=512",
            "--dropout=0.1",
            "--attention_dropout=0",
            f"--devices={num_devices}",
        ]
    )
    config = bench.bench_config(args)
    # the fewest layers of each kind: BERT's one, ModernBERT's global layer 0 and a sliding one
    config.model.num_layers = 1 if arch == "bert" else 2
    with tempfile.TemporaryDirectory() as workdir:
        task = PretrainingTask(config, workdir, vocab_size=args.vocab_size)
        setup = train.build(config, workdir, task)
    phase = setup.phases[0]
    with jax.set_mesh(setup.mesh), jax.default_matmul_precision("highest"):
        import flax.linen as nn

        with nn.logical_axis_rules(setup.rules):
            state = setup.init_state(jax.random.key_data(jax.random.key(0)))
            batch = bench.synthetic_batch(task, phase, args.vocab_size)
            batch = sharding.global_batch(batch, setup.mesh, setup.rules)
            state, metrics = train.jit_train_step(setup, accum_steps=1)(state, batch)
            params = jax.device_get(state.params)
            return float(jax.device_get(metrics["loss"])), params


@pytest.mark.parametrize("arch", ["bert", "modernbert"])
def test_sharded_step_equals_one_device(arch):
    """One train step (dropout on) over all local devices equals the same step on one device."""
    n = jax.local_device_count()
    loss_n, params_n = _one_step(n, arch)
    loss_1, params_1 = _one_step(1, arch)
    assert np.isfinite(loss_n)
    assert abs(loss_n - loss_1) <= 1e-5 * max(1.0, abs(loss_1)), (loss_n, loss_1)
    diffs = jax.tree.leaves(
        jax.tree.map(lambda a, b: float(np.abs(a - b).max()), params_n, params_1)
    )
    assert max(diffs) <= 1e-5, max(diffs)


def test_checkpoint_round_trip(tmp_path):
    """Device arrays saved by the trainer's Checkpointer restore bit for bit."""
    from bertjax import checkpointing

    state = {
        "w": jnp.arange(24, dtype=jnp.float32).reshape(4, 6) / 7.0,
        "b": jnp.ones((6,), jnp.bfloat16) * 0.3,
        "step": jnp.asarray(5, jnp.int32),
    }
    ckpt = checkpointing.Checkpointer(str(tmp_path / "ckpt"), keep=1, async_save=False)
    ckpt.save(5, state, {"position": 3}, "{}")
    ckpt.wait()
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state
    )
    restored, data_state, _, step = ckpt.restore(abstract)
    ckpt.close()
    assert step == 5 and data_state == {"position": 3}
    for key, value in state.items():
        assert restored[key].dtype == value.dtype
        np.testing.assert_array_equal(np.asarray(restored[key]), np.asarray(value))
        assert list(restored[key].devices())[0].platform == PLATFORM


@pytest.mark.slow
def test_make_pretrain_end_to_end(tmp_path):
    """``bertjax pretrain`` of the demo config for a few steps on this platform's devices (needs
    TensorFlow for tf.data; on CPU the README test runs the same command)."""
    if importlib.util.find_spec("tensorflow") is None:
        pytest.skip("TensorFlow is not installed: the tf.data input pipeline cannot run")
    if PLATFORM == "cpu":
        pytest.skip("on CPU, tests/test_readme_commands.py runs make pretrain")
    env = dict(os.environ)
    env.pop("JAX_PLATFORMS", None)
    cmd = [
        sys.executable,
        "-m",
        "bertjax.cli",
        "pretrain",
        "--config=configs/demo.py",
        f"--workdir={tmp_path / 'run'}",
        "--config.train.steps=20",
        "--config.optimizer.warmup_steps=5",
    ]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_an_attention_kernel_that_dropout_bypasses_is_named_in_a_warning(tmp_path, caplog):
    """attention_impl other than xla with attention_dropout > 0 trains on the explicit path: the
    run says so, naming both keys (it used to be silent)."""
    import logging

    from bertjax import train
    from bertjax.tasks.pretraining import PretrainingTask
    from bertjax.tools import bench

    args = bench.parse_args(
        [
            "--preset=tiny",
            "--attention_impl=dot_product",
            "--seq=32",
            "--batch=8",
            "--devices=1",
            "--vocab_size=512",
        ]
    )
    for attention_dropout, warned in ((0.1, True), (0.0, False)):
        args.attention_dropout = attention_dropout
        config = bench.bench_config(args)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="bertjax"):
            train.build(
                config, str(tmp_path), PretrainingTask(config, str(tmp_path), vocab_size=512)
            )
        messages = " ".join(r.getMessage() for r in caplog.records)
        assert ("model.attention_impl=dot_product is not used in training" in messages) == warned
        if warned:
            assert "model.attention_dropout=0.1 > 0" in messages
