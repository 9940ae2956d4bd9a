"""ModernBERT with the splash kernel (a full mask on global layers, a LocalMask on sliding-window
ones) lowers and compiles for a simulated TPU slice (``bertjax compile --topology``) on a CPU-only
machine: the Mosaic kernel is lowered for the slice's compile-only devices, never run here."""

import pytest
from helpers import compile_report, needs_libtpu

TINY_MODERNBERT = {
    "model.preset": "modernbert-tiny",
    "model.num_layers": 2,  # layer 0 global, layer 1 sliding-window
    "model.local_attention": 128,
    "model.attention_impl": "splash",
    "model.dtype": "float32",
    "train.global_batch_size": 8,
    "data.vocab": "",
    "data.vocab_size": 512,
    "data.phases": (),
    "data.max_seq_length": 256,
    "data.max_predictions_per_seq": 40,
}


@needs_libtpu
@pytest.mark.slow  # about 40 s on the loaded 2-core box
def test_modernbert_splash_compiles_for_a_simulated_tpu_slice(tmp_path):
    report = compile_report(tmp_path, "configs/modernbert_base.py", TINY_MODERNBERT, timeout=600)
    assert report["devices"] == 4 and report["platform"] == "tpu"
    assert report["fits"] is True and report["hbm_bytes_per_device"] > 0
    # the kernel is priced: XLA counts its declared FLOPs (it counted none before), and says so
    assert report["kernel_cost"].startswith("declared")
    assert report["est_step_seconds"] > 0
    from bertjax.layers.splash_cost import kernel_costs

    costs = kernel_costs(2, 256, 64, "float32", 256, 64)  # per example: heads 2, seq 256, dim 64
    kernel = 2 * 2 * sum(c.flops for c in costs.values())  # 2 examples per chip x 2 layers
    assert report["xla_flops_per_device"] > kernel  # the kernel plus the rest of the step
