"""`bertjax bench`: the FLOP formula, the JSON of a tiny run, the markdown writer, the data benches."""

import contextlib
import io
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from train_fixtures import write_prepared

from bertjax import PreTrainingModel, flops, models
from bertjax.models.bert import BertConfig
from bertjax.tasks.pretraining import PretrainingTask
from bertjax.tools import bench, bench_data, bench_peers

TINY_ARGS = ["--preset=tiny", "--batch=2", "--seq=16", "--steps=2", "--warmup=1", "--devices=1"]
TINY_ARGS += ["--skip_input", "--skip_prepare", "--matmul_size=256"]


def test_forward_flops_match_a_hand_count():
    cfg = BertConfig(vocab_size=10, hidden_size=4, num_layers=1, num_heads=2, intermediate_size=8)
    # Per token: Q, K, V, O projections 4 * 2*4*4 = 128; FFN 2 * 2*4*8 = 128; scores + context
    # 2 * 2*3*4 = 48 (seq 3). Three tokens: 912. Pooler 2*4*4 + NSP 2*4*2 = 48. MLM at 2 positions:
    # 2 * (2*4*4 + 2*4*10) = 224.
    assert models.forward_flops_per_sequence(cfg, seq_len=3, num_masked=2) == 912 + 48 + 224
    assert flops.train_flops_per_step(cfg, batch=5, seq_len=3, num_masked=2) == 3 * 5 * 1184


def test_forward_flops_agree_with_xla_count():
    """XLA's count of the real forward pass adds only elementwise work on top of the matmuls."""
    cfg = BertConfig(
        vocab_size=512,
        hidden_size=128,
        num_layers=1,
        num_heads=2,
        intermediate_size=512,
        max_position_embeddings=64,
    )
    model = PreTrainingModel(cfg)
    batch, seq, masked = 2, 64, 8
    ids = jnp.ones((batch, seq), jnp.int32)
    positions = jnp.tile(jnp.arange(masked), (batch, 1))
    params = jax.jit(model.init)(jax.random.key(0), ids, masked_lm_positions=positions)
    cost = jax.jit(model.apply).lower(params, ids, masked_lm_positions=positions).compile()
    xla = bench._xla_flops(cost)
    analytic = batch * models.forward_flops_per_sequence(cfg, seq, masked)
    assert 1.0 <= xla / analytic < 1.1, (xla, analytic)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """One tiny `bertjax bench --json --output_dir=...`: (output dir, printed stdout lines)."""
    out = tmp_path_factory.mktemp("bench")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        bench.main([*TINY_ARGS, "--json", f"--output_dir={out}"])
    return out, printed.getvalue().strip().splitlines()


def test_tiny_bench_json_has_positive_numbers(tiny_run):
    _, printed = tiny_run
    assert len(printed) == 1, "--json prints exactly one line"
    result = json.loads(printed[0])
    for key in (
        "tokens_per_sec",
        "sequences_per_sec",
        "step_time_s",
        "compile_s",
        "mfu",
        "tflops_per_sec_per_device",
        "train_flops_per_step",
        "peak_tflops",
    ):
        assert result[key] > 0, key
    assert result["memory"]["peak_bytes"] > 0
    assert result["tokens_per_sec"] == pytest.approx(result["sequences_per_sec"] * 16)
    assert np.isfinite(result["final_loss"])
    assert result["config"]["masked"] == 3  # 15% of 16 rounded up as BERT's 20 of 128
    assert result["peak_source"].startswith("measured fp32")  # CPU: matmul peak of this run


def test_output_dir_holds_json_and_markdown(tiny_run):
    out, printed = tiny_run
    saved = json.loads((out / "results.json").read_text())
    assert saved == json.loads(printed[0])
    assert (out / "results.md").read_text() == bench.to_markdown(saved)


def test_markdown_writer_formats_every_table(tiny_run):
    result = dict(json.loads(tiny_run[1][0]), tokens_per_sec=12345.6, mfu=0.4567)
    result.update(sequences_per_sec=100.0, step_time_s=1.0, step_cpu_s=1.9)
    result["prepare"] = [
        dict(
            scale=4,
            input_mb=76.7,
            documents=6048,
            wall_s=200.0,
            docs_per_sec=30.24,
            mb_per_sec=0.3835,
            cores_used=1.9,
            cpu_s=380.0,
            mb_per_cpu_s=0.2018,
            examples_per_cpu_s=480.4,
            peak_rss_bytes=812e6,
            data_dir="x",
        )
    ]
    run = dict(examples=45000, cpu_s=6.5, examples_per_cpu_s=6923.1, peak_rss_bytes=150e6)
    original = dict(run, cpu_s=47.0, examples_per_cpu_s=957.4, peak_rss_bytes=1.2e9)
    result["prepare_vs_original"] = dict(bertjax=run, original=original, ratio=7.23)
    result["input"] = dict(examples_per_sec=2500.0, ratio_to_model=25.0)
    result["peers"] = {
        "torch": dict(
            framework="transformers-torch",
            step_time_s=2.0,
            step_cpu_s=3.8,
            tokens_per_sec=6172.8,
            bertjax_speedup=2.0,
            bertjax_speedup_cpu_time=2.0,
        )
    }
    lines = bench.to_markdown(result).splitlines()
    assert "| tokens/s | 12,346 |" in lines
    assert "| MFU | 45.7% |" in lines
    assert "| x4 | 76.7 | 6,048 | 200 | 380 | 0.202 | 480 | 1.9 | 812 |" in lines
    assert "| create_pretraining_data.py | 45,000 | 47 | 957 | 1,200 |" in lines
    assert "bertjax prepare / original, instances per CPU-second: 7.23x" in lines
    assert "tf.data input: 2,500 examples/s = 25x the model's 100 seq/s" in lines
    assert "| transformers-torch | 2 | 3.8 | 6,173 | 2.00x, 2.00x |" in lines
    assert "| bertjax | 1 | 1.9 | 12,346 | 1.00x, 1.00x |" in lines
    headers = [line for line in lines if line.startswith("|---")]
    assert len(headers) == 4  # results, prepare, prepare vs the original, peers


def test_bench_config_keys_exist_in_the_base_config():
    """The benchmark's experiment is a subset of configs/base.py (so it cannot drift silently)."""
    from configs import base

    ref = base.get_config()
    cfg = bench.bench_config(bench.parse_args([]))
    for section in ("model", "data", "train", "optimizer", "mesh"):
        for key, value in cfg[section].items():
            assert key in ref[section], f"{section}.{key}"
            if section == "optimizer":
                assert value == ref.optimizer[key], f"optimizer.{key}"


def test_synthetic_batch_is_a_valid_pretraining_batch():
    hf = bench_peers.synthetic_batch(batch=4, seq=32, masked=5, vocab=1000)
    picked = hf["labels"] >= 0
    assert picked.sum(axis=1).tolist() == [5] * 4
    assert not picked[:, 0].any() and not picked[:, -1].any()  # never [CLS] or the last token
    assert (hf["input_ids"][picked] == 103).all()
    args = bench.parse_args(["--preset=tiny", "--batch=4", "--seq=32", "--masked=5"])
    task = PretrainingTask(bench.bench_config(args), "/nonexistent", vocab_size=1000)
    batch = bench.synthetic_batch(task, task.phases()[0], 1000)
    assert batch["masked_lm_positions"].shape == (4, 5)
    rows = np.arange(4)[:, None]
    assert (hf["labels"][rows, batch["masked_lm_positions"]] == batch["masked_lm_ids"]).all()
    assert batch["input_ids"].dtype == np.int32 and (batch["masked_lm_weights"] == 1).all()


def test_input_bench_reads_prepared_records(tmp_path):
    data_dir = write_prepared(tmp_path / "data", seq=16, pred=3)
    result = bench.measure_input(str(data_dir), batch=8, batches=10)
    assert result["examples_per_sec"] > 0 and result["batches"] == 10


def test_corpus_copies_scale_the_file_list(tmp_path):
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text("text\n")
    assert bench_data._corpus_copies(str(tmp_path / "*.txt"), 1, "").count(",") == 1
    glob = bench_data._corpus_copies(str(tmp_path / "*.txt"), 3, str(tmp_path / "x3"))
    assert len(list(pathlib.Path(tmp_path / "x3").iterdir())) == 6 and glob.endswith("*")


@pytest.mark.parametrize("arch", ["modernbert", "eurobert", "nomicbert", "gte"])
def test_bench_runs_next_to_the_architectures_pytorch_peer(arch):
    """`bertjax bench --architecture=ARCH --peers`: the bertjax step and transformers'
    ModernBertForMaskedLM / EuroBertForMaskedLM / NomicBertForMaskedLM / GteForMaskedLM on the
    same shapes, with the speed-up ratio."""
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    args = [f"--architecture={arch}", f"--preset={arch}-tiny", "--vocab_size=500"]
    args += ["--batch=2", "--seq=32", "--masked=4", "--steps=1", "--warmup=1", "--devices=1"]
    args += ["--skip_input", "--skip_prepare", "--matmul_size=128", "--json"]
    args += ["--peers", f"--peers_python={sys.executable}", "--peer_steps=1"]
    if arch != "modernbert":  # its layers differ: it cannot scan them
        args.append("--scan_layers")  # the step compiles one layer, not four (about 4 CPU-s less)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        bench.main(args)
    result = json.loads(printed.getvalue().strip().splitlines()[-1])
    assert result["model_config"]["architecture"] == arch
    peer = result["peers"][f"torch-{arch}"]
    assert peer["framework"] == f"transformers-torch-{arch}" and peer["bertjax_speedup"] > 0
    assert set(result["peers"]) == {f"torch-{arch}"}  # BERT's peers are not run for it


_FAKE_ORIGINAL = """
import sys
from absl import app, flags
flags.DEFINE_string("input_file", None, "")
flags.DEFINE_string("output_file", None, "")
for name in ("vocab_file", "do_lower_case", "max_seq_length", "max_predictions_per_seq",
             "masked_lm_prob", "dupe_factor", "random_seed", "do_whole_word_mask"):
    flags.DEFINE_string(name, None, "")
import tensorflow as tf  # the shim's tf.compat.v1
def main(_):
    with tf.python_io.TFRecordWriter(flags.FLAGS.output_file) as w:
        for i in range(7):
            w.write(b"x" * i)
app.run(main)
"""


def test_prepare_compared_with_the_original_script(tmp_path):
    """--original_script: the same corpus converted to one sentence per line, both timed."""
    corpus = tmp_path / "novel.txt"
    para = "It was a dark night. The wind blew hard. Nobody came."
    corpus.write_text("\n\n".join([para] * 30) + "\n\n\n\n" + "\n\n".join([para] * 30))
    vocab = tmp_path / "vocab.txt"
    words = "it was a dark night . the wind blew hard nobody came".split()
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]) + "\n")
    (tmp_path / "cpd.py").write_text(_FAKE_ORIGINAL)
    args = bench.parse_args(
        [
            f"--corpus={corpus}",
            f"--vocab={vocab}",
            f"--cache_dir={tmp_path / 'cache'}",
            f"--original_script={tmp_path / 'cpd.py'}",
            "--seq=32",
            "--prepare_workers=1",
        ]
    )
    c = bench_data.compare_with_original(args)
    converted = (tmp_path / "cache" / "corpus-bert-format" / "novel.txt").read_text()
    assert converted.startswith("It was a dark night.\nThe wind blew hard.\nNobody came.\n")
    assert c["original"]["examples"] == 7 and c["bertjax"]["examples"] > 0
    assert c["ratio"] == pytest.approx(
        c["bertjax"]["examples_per_cpu_s"] / c["original"]["examples_per_cpu_s"]
    )


_SMALL_GLUE_CONFIG = """
from configs import glue


def get_config():
    c = glue.get_config()
    c.model.num_layers, c.model.hidden_size, c.model.num_heads = 1, 32, 2
    c.model.intermediate_size = 64
    return c
"""


def test_finetune_bench_times_the_task_packed_and_its_pytorch_peer(tmp_path):
    """`bertjax bench --finetune=glue/sst2 --peers`: the real fine-tuning step and dev evaluation,
    unpacked and packed, beside transformers' BertForSequenceClassification on the same shapes."""
    pytest.importorskip("transformers")
    pytest.importorskip("torch")
    words = ["the", "a", "film", "good", "bad", "very", "is", "not", "fun", "long"]
    (tmp_path / "vocab.txt").write_text(
        "\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words])
    )
    rng = np.random.default_rng(0)
    sst = tmp_path / "SST-2"
    sst.mkdir()
    for split, n in (("train", 40), ("dev", 12)):
        rows = [f"{' '.join(rng.choice(words, rng.integers(2, 9)))}\t{i % 2}" for i in range(n)]
        (sst / f"{split}.tsv").write_text("sentence\tlabel\n" + "\n".join(rows) + "\n")
    # configs/glue.py at one layer of 32 (the tiny preset has two of 128): what is asserted below
    # holds for any model, and each of the three modes compiles its own init, steps and evaluation.
    (tmp_path / "glue_small.py").write_text(_SMALL_GLUE_CONFIG)
    args = ["--finetune=glue/sst2", "--preset=tiny", "--seq=32", "--batch=4", "--steps=2"]
    args += [f"--finetune_config={tmp_path / 'glue_small.py'}"]
    args += ["--warmup=1", "--devices=1", f"--glue_dir={sst}", f"--vocab={tmp_path / 'vocab.txt'}"]
    args += ["--json", "--peers", f"--peers_python={sys.executable}", "--peer_steps=1"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        bench.main([*args, f"--output_dir={tmp_path / 'out'}"])
    result = json.loads(printed.getvalue().strip().splitlines()[-1])["finetune"]
    unpacked, packed, peer = result["unpacked"], result["packed"], result["peer"]
    default = result["batch_packed"]
    assert unpacked["examples_per_step"] == 4 and unpacked["eval_examples"] == 12
    assert unpacked["rows_per_step"] == 4
    assert default["examples_per_step"] == 4 and default["rows_per_step"] < 4  # same batches
    assert packed["examples_per_step"] > 4  # sentences of 4-11 tokens share rows of 32
    assert packed["train_rows"] < unpacked["train_rows"] == default["train_rows"] == 40
    for key in ("step_time_s", "step_cpu_s", "eval_s"):
        assert unpacked[key] > 0 and packed[key] > 0 and default[key] > 0 and peer[key] > 0
    assert peer["framework"] == "transformers-torch-cls" and peer["bertjax_speedup_step"] > 0
    assert "bertjax / PyTorch at equal shapes" in (tmp_path / "out" / "results.md").read_text()
