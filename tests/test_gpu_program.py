"""The train step as XLA's GPU compiler lays it out for an H100, compiled on this CPU (no GPU, no
driver): `bertjax compile --topology=h100`, the kernel inventory and the roofline of
bertjax.hlo_roofline, and the properties of the program that the speed work bought (no bf16
scatter, no f32 buffer over batch x predictions x vocabulary, cuDNN attention in every layer that
`auto` gives it, a bound on copies per layer). The compiling
tests need JAX's CUDA plugin and cuDNN's library (the test and aot extras)."""

import importlib.util
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from bertjax import gpu_topology, hlo_roofline, topology
from bertjax.compile import compile_train_step, with_overrides

REPO = __import__("pathlib").Path(__file__).resolve().parent.parent
needs_cuda_plugin = pytest.mark.skipif(
    importlib.util.find_spec("jax_plugins.xla_cuda12") is None
    or importlib.util.find_spec("nvidia.cudnn") is None,
    reason="JAX's CUDA plugin or cuDNN's wheel is not installed (pip install -e '.[aot]')",
)
H100 = gpu_topology.CHIPS["h100"].roofline


@pytest.mark.parametrize(
    "name,chips,nodes,kind",
    [
        ("h100", 1, 1, "NVIDIA H100 80GB HBM3"),
        ("h100-8", 8, 1, "NVIDIA H100 80GB HBM3"),
        ("h200-8", 8, 1, "NVIDIA H200"),
        ("a100-8", 8, 1, "NVIDIA A100-SXM4-80GB"),
        ("h100-8x4", 32, 4, "NVIDIA H100 80GB HBM3"),
    ],
)
def test_gpu_system_names(name, chips, nodes, kind):
    system = topology.parse(name)
    assert isinstance(system, gpu_topology.GpuSystem)
    assert (system.chips, system.nodes, system.chip.description) == (chips, nodes, kind)


@pytest.mark.parametrize(
    "name,match",
    [("h100-16", "1 to 8 GPUs per node"), ("b200-8", "expected"), ("h100-3x2", "power of two")],
)
def test_bad_gpu_system_names_are_one_line(name, match):
    with pytest.raises(ValueError, match=match) as err:
        topology.parse(name)
    assert "\n" not in str(err.value) and f"--topology={name}" in str(err.value)


@needs_cuda_plugin
def test_roofline_of_a_known_program_matches_its_arithmetic():
    """A bf16 [1024, 2048] x [2048, 512] product and a softmax on a compile-only H100: the parser
    finds the dot's FLOPs exactly and the bytes of its operands and output."""
    devices = gpu_topology.devices(topology.parse("h100"))
    sharding = jax.sharding.SingleDeviceSharding(devices[0])
    a = jax.ShapeDtypeStruct((1024, 2048), jnp.bfloat16, sharding=sharding)
    b = jax.ShapeDtypeStruct((2048, 512), jnp.bfloat16, sharding=sharding)
    compiled = (
        jax.jit(lambda x, y: jax.nn.softmax((x @ y).astype(jnp.float32))).lower(a, b).compile()
    )
    program = hlo_roofline.Program(compiled.as_text())
    roof = program.roofline(H100)
    assert roof["dot_flops"] == 2 * 1024 * 2048 * 512
    # At least the two operands read and the f32 result written once.
    assert roof["hbm_bytes"] >= (1024 * 2048 + 2048 * 512) * 2 + 1024 * 512 * 4
    assert roof["est_step_seconds"] >= 2 * 1024 * 2048 * 512 / H100.bf16_flops
    inventory = program.inventory()
    assert inventory["scatters"] == {} and inventory["collectives"] == {}
    assert inventory["kernels"] >= 2


def test_a_fusion_that_slices_an_operand_reads_only_the_slices():
    """RoPE and the band blocks read q, k or v out of the fused QKV product: a kernel that only
    slices an operand is priced for the slices it reads, not the whole operand. A hand-written
    program (the parser needs no compiler): a fusion reading two [256, 64] slices of a
    [256, 1024] f32 operand and writing their [256, 64] sum."""
    text = """HloModule m, num_partitions=1

%fused_add (p0: f32[256,1024], p1: f32[64]) -> f32[256,64] {
  %p0 = f32[256,1024]{1,0} parameter(0)
  %p1 = f32[64]{0} parameter(1)
  %b = f32[256,16,64]{2,1,0} bitcast(%p0)
  %s0 = f32[256,1,64]{2,1,0} slice(%b), slice={[0:256], [0:1], [0:64]}
  %s1 = f32[256,1,64]{2,1,0} slice(%b), slice={[0:256], [5:6], [0:64]}
  %r0 = f32[256,64]{1,0} bitcast(%s0)
  %r1 = f32[256,64]{1,0} bitcast(%s1)
  %a = f32[256,64]{1,0} add(%r0, %r1)
  %bc = f32[256,64]{1,0} broadcast(%p1), dimensions={1}
  ROOT %out = f32[256,64]{1,0} add(%a, %bc)
}

%fused_neg (q0: f32[256,1024]) -> f32[256,1024] {
  %q0 = f32[256,1024]{1,0} parameter(0)
  ROOT %n = f32[256,1024]{1,0} negate(%q0)
}

ENTRY %main (x: f32[256,1024], y: f32[64]) -> (f32[256,64], f32[256,1024]) {
  %x = f32[256,1024]{1,0} parameter(0)
  %y = f32[64]{0} parameter(1)
  %sliced = f32[256,64]{1,0} fusion(%x, %y), kind=kLoop, calls=%fused_add
  %whole = f32[256,1024]{1,0} fusion(%x), kind=kLoop, calls=%fused_neg
  ROOT %t = (f32[256,64]{1,0}, f32[256,1024]{1,0}) tuple(%sliced, %whole)
}
"""
    program = hlo_roofline.Program(text)
    costs = {i.name: program.kernel_cost(c, i, H100).bytes for c, i, _ in program.kernels()}
    slice_bytes, whole = 256 * 64 * 4, 256 * 1024 * 4
    assert costs["sliced"] == 2 * slice_bytes + 64 * 4 + slice_bytes  # two slices, y, the output
    assert costs["whole"] == 2 * whole  # an operand read elementwise is read whole


# The shipped recipes with fewer layers: every property below is per layer or of the layers' shared
# ends (embeddings, heads, loss), and a 3-layer program compiles in a fifth of the 12-layer one's time.
LAYERS = 3


@needs_cuda_plugin
@pytest.mark.slow
def test_bert_base_h100_program():
    """The shipped BERT-base recipe (256 x 128, dropout 0.1) in bf16 with cuDNN attention."""
    from configs import bert_base

    overrides = {
        "model.dtype": "bfloat16",
        "model.attention_impl": "auto",
        "model.dropout_impl": "kernel",
        "model.num_layers": LAYERS,
    }
    config = with_overrides(bert_base.get_config(), overrides)
    report = compile_train_step(config, None, devices=gpu_topology.devices(topology.parse("h100")))
    kernels = report["kernels"]
    assert report["device_kind"] == "NVIDIA H100 80GB HBM3" and report["fits"]
    assert "bf16" not in kernels["scatters"], kernels["scatter_shapes"]
    # Only the word-embedding gradient scatters (f32, [vocab, hidden]).
    assert kernels["scatter_shapes"] == ["f32[30522,768]"]
    # No f32 [batch, predictions, vocab] buffer (the one-hot of take_along_axis's gradient).
    assert all(r["bytes"] < 256 * 20 * 30522 * 4 for r in kernels["largest_outputs"]), kernels[
        "largest_outputs"
    ]
    calls = kernels["custom_calls"]
    assert calls.get("__cudnn$fmhaScaleBiasSoftmaxDropout") == LAYERS, calls
    assert calls.get("__cudnn$fmhaScaleBiasSoftmaxDropoutBackward") == LAYERS, calls
    # 15 + 16 per layer on 2026-11-28 (jax 0.10.2): 63 at 3 layers, 207 at 12; main had 487 at 12.
    assert kernels["copies"] <= 22 * LAYERS, kernels["copies"]
    assert kernels["transposes"] == 0
    assert 0 < report["est_step_seconds"] and 0 < report["est_mfu"] < 1


@needs_cuda_plugin
@pytest.mark.slow
def test_modernbert_base_h100_program(monkeypatch):
    """ModernBERT-base at 1024 tokens, packed, bf16, on one H100: cuDNN attention in every layer
    (the global ones over the whole row, the sliding-window ones as a batch of band blocks), no
    bf16 scatter, no transposes, no fp32 [tokens, hidden] buffer (autodiff's LayerNorm backward
    wrote one per norm for the scale's gradient)."""
    from bertjax import compile as compile_module
    from configs import modernbert_base

    programs = []
    gpu_report = compile_module.gpu_report

    def keep_program(compiled, *args):
        programs.append(hlo_roofline.Program(compiled.as_text()))
        return gpu_report(compiled, *args)

    monkeypatch.setattr(compile_module, "gpu_report", keep_program)
    layers, overrides = 4, {"model.attention_impl": "auto", "train.global_batch_size": 32}
    config = with_overrides(modernbert_base.get_config(), {**overrides, "model.num_layers": layers})
    report = compile_train_step(config, None, devices=gpu_topology.devices(topology.parse("h100")))
    fp32_activations = [
        inst.op_name
        for _, inst, _ in programs[0].kernels()
        for dtype, dims in hlo_roofline.arrays(inst.shape)
        if dtype == "f32" and dims in ((32, 1024, 768), (32 * 1024, 768))
    ]
    assert not fp32_activations, fp32_activations[:3]
    kernels = report["kernels"]
    assert report["fits"], report["hbm_bytes_per_device"]
    assert "bf16" not in kernels["scatters"], kernels["scatter_shapes"]
    calls = {k: v for k, v in kernels["custom_calls"].items() if "fmha" in k}
    assert sum(v for k, v in calls.items() if not k.endswith("Backward")) == layers, calls
    assert sum(v for k, v in calls.items() if k.endswith("Backward")) == layers, calls
    # 29 at 4 layers on 2026-11-28 (jax 0.10.2), 137 at 22.
    assert kernels["copies"] <= 8 * layers, kernels["copies"]
    assert kernels["transposes"] == 0


@needs_cuda_plugin
@pytest.mark.parametrize("rate", [0.0, 0.1])
def test_sliding_window_attention_is_cudnn_on_band_blocks(rate):
    """A sliding-window layer's attention on an H100 (bf16, 1024 tokens, window 128): one fused
    cuDNN call over [batch x 4, 256 queries, 384 keys] blocks forward and backward, with attention
    dropout inside the kernel (``dropout_impl=kernel``) where the rate is set; no [q, k] scores
    in memory."""
    import flax.linen as nn

    from bertjax.layers.attention import attend

    class Window(nn.Module):
        @nn.compact
        def __call__(self, q, k, v, bias):
            kernel = dict(impl="cudnn", dropout_rate=rate, dropout_impl="kernel", kernel_seed=7)
            return attend(q, k, v, bias, **kernel, deterministic=rate == 0.0, local_window=128)

    devices = gpu_topology.devices(topology.parse("h100"))
    sharding = jax.sharding.SingleDeviceSharding(devices[0])
    qkv = jax.ShapeDtypeStruct((2, 1024, 4, 64), jnp.bfloat16, sharding=sharding)
    bias = jax.ShapeDtypeStruct((2, 1, 1, 1024), jnp.bfloat16, sharding=sharding)

    def loss(q, k, v, b):
        return Window().apply({}, q, k, v, b, rngs={"dropout": jax.random.key(0)}).sum()

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    program = hlo_roofline.Program(step.lower(qkv, qkv, qkv, bias).compile().as_text())
    calls = program.inventory()["custom_calls"]
    name = "__cudnn$fmhaScaleBiasSoftmax" + ("Dropout" if rate else "")
    assert calls.get(name) == 1 and calls.get(name + "Backward") == 1, calls
    shapes = [i.shape for _, i, _ in program.kernels() if i.opcode == "custom-call"]
    assert any("bf16[8,4,256,64]" in s or "bf16[8,256,4,64]" in s for s in shapes), shapes
    largest = program.inventory()["largest_outputs"][0]["bytes"]
    assert largest < 2 * 4 * 1024 * 1024 * 2, largest  # less than one [q, k] score matrix


# `python -c _COMMAND_THEN_TF ARGS` is `bertjax ARGS`, then says on stderr whether TensorFlow was
# imported.
_COMMAND_THEN_TF = """
import sys
from bertjax import cli
try:
    cli.main()
finally:
    state = "imported" if "tensorflow" in sys.modules else "not imported"
    print("tensorflow: " + state, file=sys.stderr)
"""


@needs_cuda_plugin
def test_compile_topology_h100_8_from_the_command_line(tmp_path):
    """`bertjax compile --topology=h100-8 --json`: the report keys a user reads, from a tiny
    config, with no data and no credentials (the config's vocabulary is a bucket path), and
    without importing TensorFlow (a compile for a topology reads no data through it)."""
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            _COMMAND_THEN_TF,
            "compile",
            "--config=configs/bert_base.py",
            "--topology=h100-8",
            "--json",
            "--config.model.preset=tiny",
            "--config.model.num_layers=1",  # what is checked is of the whole step, not per layer
            "--config.model.dtype=bfloat16",
            "--config.train.global_batch_size=8",  # one row per GPU
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "tensorflow: not imported" in out.stderr, out.stderr[-2000:]
    report = json.loads(out.stdout)
    for key in (
        "devices",
        "device_kind",
        "hbm_bytes_per_device",
        "hbm_capacity_bytes",
        "fits",
        "est_step_seconds",
        "est_tokens_per_sec_per_chip",
        "est_mfu",
        "kernels",
    ):
        assert key in report, key
    assert report["devices"] == 8 and report["fits"]
    assert report["kernels"]["collectives"], "8 GPUs with fsdp exchange gradients and parameters"
    assert report["roofline"]["link_seconds"] > 0


@pytest.mark.parametrize(
    "overrides,attentions",
    [
        ({}, {"xla"}),  # attention dropout on: training attention is explicit whatever the kernel
        ({"model.dropout_impl": "kernel"}, {"cudnn"}),  # cuDNN's own dropout: only cuDNN runs it
        ({"model.attention_dropout": 0.0}, {"cudnn", "xla"}),
        ({"model.attention_dropout": 0.0, "model.dtype": "float32"}, {"xla"}),  # cuDNN: 16-bit
    ],
)
def test_plan_offers_cudnn_on_a_gpu_where_training_runs_it(overrides, attentions):
    from bertjax import plan
    from configs import bert_base

    config = with_overrides(bert_base.get_config(), {"model.dtype": "bfloat16", **overrides})
    found = plan.candidates(config, 8, 80 * 2**30, platform="gpu")
    assert found and {c["model.attention_impl"] for c in found} == attentions


@pytest.mark.parametrize("attention", ["auto", "xla"])
def test_kernel_dropout_where_cudnn_does_not_run_is_one_line(attention):
    """dropout_impl=kernel on this CPU (auto picks xla) or with xla attention: the run would
    ignore the setting, so building it is an error naming the key, before any step is traced."""
    from bertjax import compile as aot
    from bertjax import train
    from configs import bert_base

    config = with_overrides(
        bert_base.get_config(),
        {
            "model.preset": "tiny",
            "model.dropout_impl": "kernel",
            "model.attention_impl": attention,
            "train.global_batch_size": 8,
        },
    )
    with pytest.raises(
        ValueError, match=r"model.dropout_impl=kernel .* needs cuDNN attention"
    ) as e:
        train.build(config, None, aot.shapes_only_task(config, None))
    assert "\n" not in str(e.value) and "'xla' on cpu" in str(e.value)
