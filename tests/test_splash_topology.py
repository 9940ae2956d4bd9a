"""ModernBERT with the splash kernel (a full mask on global layers, a LocalMask on sliding-window
ones) lowers and compiles for a simulated TPU slice (``bertjax compile --topology``) on a CPU-only
machine: the Mosaic kernel is lowered for the slice's compile-only devices, never run here."""

import importlib.util
import json
import subprocess
import sys

import pytest

REPO = __import__("pathlib").Path(__file__).resolve().parent.parent
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


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
@pytest.mark.slow  # about 40 s on the loaded 2-core box
def test_modernbert_splash_compiles_for_a_simulated_tpu_slice(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "bertjax.cli", "compile", "--config=configs/modernbert_base.py",
         f"--workdir={tmp_path}", "--topology=v5p:2x2x1", "--json",
         *(f"--config.{k}={v}" for k, v in TINY_MODERNBERT.items())],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    report = json.loads(out.stdout)
    assert report["devices"] == 4 and report["platform"] == "tpu"
    assert report["fits"] is True and report["hbm_bytes_per_device"] > 0
