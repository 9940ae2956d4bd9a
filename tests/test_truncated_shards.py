"""A prepared shard cut short (in the middle of a record, or at a record boundary so that fewer
records remain) is one line naming the shard, never a score over part of the data: the reader
checks every shard's record count against metadata.json: nothing lost, nothing silent."""

import struct

import pytest
from train_fixtures import VOCAB_SIZE, write_prepared

from bertjax import cli
from bertjax.data import pipeline


def _cut(path, where: str) -> None:
    """Cuts a TFRecord file in the middle of a record, or after its first 10 records."""
    data = path.read_bytes()
    if where == "mid-record":
        path.write_bytes(data[: len(data) // 2 + 3])
        return
    offset = 0
    for _ in range(10):
        (length,) = struct.unpack("<Q", data[offset : offset + 8])
        offset += 12 + length + 4  # length, its crc, data, its crc
    path.write_bytes(data[:offset])


def _expected(path, where: str) -> str:
    if where == "mid-record":  # TF reads a cut last record as the end of the file: 8 remain
        return f"{path}: 8 records, but metadata.json says 16 (truncated?); prepare it again"
    return f"{path}: 10 records, but metadata.json says 16 (truncated?); prepare it again"


@pytest.mark.parametrize("repeat", [False, True], ids=["single pass", "training-time eval"])
@pytest.mark.parametrize("where", ["mid-record", "record boundary"])
def test_a_cut_eval_shard_is_named_with_its_counts(tmp_path, where, repeat):
    root = write_prepared(tmp_path / "data")  # eval-00000-of-00001.tfrecord: 16 records
    shard = root / "eval-00000-of-00001.tfrecord"
    _cut(shard, where)
    data = pipeline.PretrainingData(
        str(root),
        "eval",
        4,
        seed=0,
        process_index=0,
        process_count=1,
        repeat=repeat,
        shuffle=False,
        drop_remainder=not repeat,
    )
    with pytest.raises(pipeline.ShardCorruptedError) as err:
        for _ in range(8):
            next(data)
    message = str(err.value)
    assert message == _expected(shard, where)


def test_evaluate_mlm_on_a_cut_shard_is_one_line(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=32,
    )
    torch.manual_seed(0)
    transformers.BertForMaskedLM(config).save_pretrained(tmp_path / "hf")
    root = write_prepared(tmp_path / "data")
    shard = root / "eval-00000-of-00001.tfrecord"
    _cut(shard, "record boundary")
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bertjax", "evaluate-mlm", f"--checkpoint={tmp_path / 'hf'}", f"--data={root}"])
    assert str(exit_.value) == f"bertjax evaluate-mlm: error: {_expected(shard, 'record boundary')}"
    assert "mlm_loss" not in capsys.readouterr().out
