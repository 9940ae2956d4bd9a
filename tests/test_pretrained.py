"""load_pretrained: head policy, bertjax training checkpoints (scanned layers), batching, errors."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import make_hf_model

from bertjax import PreTrainingModel
from bertjax.checkpointing import Checkpointer
from bertjax.models.bert import get_preset
from bertjax.pretrained import encode_batch, load_pretrained
from bertjax.text import load_tokenizer
from bertjax.text.features import truncate_pair

IDS = np.array([[2, 40, 41, 42, 3, 0, 0], [2, 50, 3, 60, 61, 3, 0]], np.int32)
TYPES = np.array([[0, 0, 0, 0, 0, 0, 0], [0, 0, 0, 1, 1, 1, 0]], np.int32)
MASK = (np.arange(7)[None] < np.array([[5], [6]])).astype(np.int32)


def test_heads_all_initialises_only_the_missing_heads(tmp_path, uncased_vocab):
    make_hf_model(tmp_path / "enc", uncased_vocab, "BertModel")  # encoder + pooler, no prefix
    plain = load_pretrained(str(tmp_path / "enc"))
    assert plain.missing == ("mlm", "nsp") and plain.heads == ("pooler",)
    out = plain(IDS, TYPES, MASK)
    assert out.mlm_logits is None and out.nsp_logits is None and out.pooled_output.shape == (2, 48)
    full = load_pretrained(str(tmp_path / "enc"), heads="all", seed=0)
    assert full.missing == ("mlm", "nsp") and full.heads == ("pooler", "mlm", "nsp")
    got = full(IDS, TYPES, MASK)
    assert got.mlm_logits.shape == (2, 7, 1001) and got.nsp_logits.shape == (2, 2)
    np.testing.assert_array_equal(got.sequence_output, out.sequence_output)
    np.testing.assert_array_equal(
        got.pooled_output, out.pooled_output
    )  # loaded, not re-initialised
    again = load_pretrained(str(tmp_path / "enc"), heads="all", seed=0)(IDS, TYPES, MASK)
    other = load_pretrained(str(tmp_path / "enc"), heads="all", seed=1)(IDS, TYPES, MASK)
    np.testing.assert_array_equal(again.mlm_logits, got.mlm_logits)
    assert not np.allclose(other.nsp_logits, got.nsp_logits)
    with pytest.raises(ValueError, match="heads='some' must be 'available' or 'all'"):
        load_pretrained(str(tmp_path / "enc"), heads="some")


def _training_checkpoint(workdir, scan_layers=True):
    """What a pretraining run leaves: WORKDIR/checkpoints/<step> with the experiment config."""
    experiment = {
        "task": "pretrain",
        "model": {
            "preset": "tiny",
            "dtype": "float32",
            "hidden_dropout": 0.1,
            "attention_dropout": 0.1,
            "max_position_embeddings": 64,
            "type_vocab_size": 2,
            "attention_impl": "xla",
            "remat": "none",
            "scan_layers": scan_layers,
        },
        "data": {"vocab": "", "prepared_dir": ""},
    }
    config = get_preset("tiny", vocab_size=101, max_position_embeddings=64, scan_layers=scan_layers)
    module = PreTrainingModel(config)
    init = jax.jit(lambda rng: nn.meta.unbox(module.init(rng, jnp.asarray(IDS))["params"]))
    params = init(jax.random.key(3))
    ckpt = Checkpointer(str(workdir / "checkpoints"), async_save=False)
    state = {"params": params, "step": np.int32(7)}
    ckpt.save(7, state, {"position": 1}, json.dumps(experiment), force=True)
    ckpt.close()
    return module, params


def test_training_checkpoint_with_scanned_layers(tmp_path):
    module, params = _training_checkpoint(tmp_path)
    # The run is saving step 8 now: a reader must leave its unfinished folder alone.
    saving = tmp_path / "checkpoints" / "8.orbax-checkpoint-tmp-1795860000000000"
    (saving / "state").mkdir(parents=True)
    expected = jax.jit(module.apply)({"params": params}, IDS, TYPES, MASK)
    model = load_pretrained(str(tmp_path))  # the run's WORKDIR is enough
    assert (saving / "state").is_dir()
    assert model.config.num_layers == 2 and not model.config.scan_layers
    assert "layer_1" in model.params["bert"]["encoder"] and model.tokenizer is None
    out = model(IDS, TYPES, MASK)
    for name in ("sequence_output", "pooled_output", "mlm_logits", "nsp_logits"):
        np.testing.assert_allclose(getattr(out, name), expected[name], atol=1e-5, err_msg=name)
    by_name = model(IDS, segment_ids=TYPES, input_mask=MASK)
    np.testing.assert_array_equal(by_name.sequence_output, out.sequence_output)
    # bertjax 0.4's input names are one line naming the new ones, on the loader and on a module.
    with pytest.raises(TypeError, match=r"^token_type_ids= is now segment_ids= "):
        model(IDS, token_type_ids=TYPES)
    with pytest.raises(TypeError, match=r"^attention_mask= is now input_mask= "):
        module.apply({"params": params}, IDS, attention_mask=MASK)
    with pytest.raises(TypeError, match="unexpected keyword argument 'input_maks'"):
        model(IDS, input_maks=MASK)
    low = load_pretrained(str(tmp_path / "checkpoints"), dtype="bfloat16")(IDS, TYPES, MASK)
    assert low.sequence_output.dtype == jnp.bfloat16
    assert np.abs(np.asarray(low.sequence_output, np.float32) - out.sequence_output).max() < 0.1


def test_sequence_longer_than_the_position_table(tmp_path, uncased_vocab):
    _training_checkpoint(tmp_path, scan_layers=False)
    model = load_pretrained(str(tmp_path), fmt="bertjax")
    with pytest.raises(
        ValueError, match=r"sequence length 65 exceeds .*max_position_embeddings=64"
    ):
        model(np.zeros((1, 65), np.int32))
    with pytest.raises(ValueError, match="no vocabulary file found"):
        model.encode_batch(["text"])


def test_vocab_override_must_match_the_embeddings(tmp_path, uncased_vocab):
    _training_checkpoint(tmp_path, scan_layers=False)
    with pytest.raises(ValueError, match=r"vocabulary has 30522 tokens .*\[101, 128\]"):
        load_pretrained(str(tmp_path), vocab=str(uncased_vocab))


def test_encode_batch_pairs_truncation_and_padding(uncased_vocab):
    tok = load_tokenizer(str(uncased_vocab))
    long_a = "the quick brown fox jumps over the lazy dog " * 2
    batch = encode_batch(tok, ["hello world", (long_a, "a short one")], max_length=12)
    ids, types, mask = batch["input_ids"], batch["segment_ids"], batch["input_mask"]
    assert ids.shape == (2, 12) and ids.dtype == np.int32
    assert tok.convert_ids_to_tokens(ids[0, :4]) == ["[CLS]", "hello", "world", "[SEP]"]
    assert mask[0].tolist() == [1] * 4 + [0] * 8 and ids[0, 4:].tolist() == [tok.pad_id] * 8
    tokens = tok.convert_ids_to_tokens(ids[1])  # longest-first: A cut to 6 pieces, B kept
    assert tokens == [
        "[CLS]",
        "the",
        "quick",
        "brown",
        "fox",
        "jumps",
        "over",
        "[SEP]",
        "a",
        "short",
        "one",
        "[SEP]",
    ]
    assert types[1].tolist() == [0] * 8 + [1] * 4 and mask[1].sum() == 12
    assert truncate_pair([1, 2, 3, 4], [5, 6], 4) == ([1, 2], [5, 6])
    assert truncate_pair([1, 2], [5, 6, 7, 8, 9], 5) == ([1, 2], [5, 6, 7])
    padded = encode_batch(tok, ["hi"], max_length=9, pad_to_max_length=True)
    assert padded["input_ids"].shape == (1, 9)


def test_unrecognised_paths(tmp_path):
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        load_pretrained(str(tmp_path / "nothing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="empty: not a recognised checkpoint"):
        load_pretrained(str(tmp_path / "empty"))
