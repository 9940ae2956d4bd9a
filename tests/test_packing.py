"""Sequence packing: the packer, the block-diagonal model, packed pretraining data and training."""

import collections
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow as tf
from train_fixtures import read_metrics

from bertjax import PreTrainingModel, train
from bertjax.data import masking, packing, pipeline, prepare
from bertjax.models.bert import BertModel, get_preset
from bertjax.tasks.pretraining import PretrainingTask
from bertjax.text import load_tokenizer
from configs import base

WORDS = (
    "the a of and to in it was he she said that his her on at with for as had you not be this but by "
    "from they we all there were one so an out up into when who which what time day man house"
).split()
CLS, SEP, PAD = 2, 3, 0
VOCAB = 60


# ---- the packer ---------------------------------------------------------------------------------
@pytest.mark.parametrize("max_items, window", [(0, 64), (3, 64), (0, 2), (2, 1)])
def test_packer_keeps_items_whole_and_is_deterministic(max_items, window):
    lengths = np.random.default_rng(0).integers(1, 41, 300).tolist()
    rows = packing.pack(lengths, 40, max_items=max_items, window=window)
    assert sorted(i for row in rows for i in row) == list(range(300))  # every item once, whole
    assert all(sum(lengths[i] for i in row) <= 40 for row in rows)
    if max_items:
        assert max(map(len, rows)) <= max_items
    assert rows == packing.pack(lengths, 40, max_items=max_items, window=window)
    full = sum(lengths) / (40 * len(rows))
    assert full > (0.9 if window > 2 and not max_items else 0.5)  # vs ~0.52 unpacked
    # The streaming packer gives the same rows, never holding more than `window` open.
    packer, streamed = packing.Packer(40, max_items=max_items, window=window), []
    for i, n in enumerate(lengths):
        streamed += packer.add(i, n)
        assert len(packer._rows) <= window
    assert streamed + packer.flush() == rows


def test_packer_first_fit_order_and_errors():
    # 30 opens row 0, 30 opens row 1, 10 fits row 0 (full: closed), 5 goes to row 1.
    assert packing.pack([30, 30, 10, 5], 40) == [[0, 2], [1, 3]]
    assert packing.pack([30, 30, 10, 5], 40, window=1) == [[0], [1, 2], [3]]
    with pytest.raises(ValueError, match=r"item length 41 not in \[1, 40\]"):
        packing.pack([41], 40)


def test_row_layout_restarts_positions_and_numbers_sequences():
    pack_ids, position_ids, starts = packing.row_layout([3, 2, 4], 12)
    np.testing.assert_array_equal(pack_ids, [1, 1, 1, 2, 2, 3, 3, 3, 3, 0, 0, 0])
    np.testing.assert_array_equal(position_ids, [0, 1, 2, 0, 1, 0, 1, 2, 3, 0, 0, 0])
    np.testing.assert_array_equal(starts, [0, 3, 5])
    with pytest.raises(ValueError, match="13 tokens do not fit in 12"):
        packing.row_layout([6, 7], 12)


def _features(n=40, seq=16, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(2, seq + 1, n)
    real = np.arange(seq)[None] < lengths[:, None]
    ids = np.where(real, rng.integers(5, VOCAB, (n, seq)), PAD).astype(np.int32)
    ids[:, 0] = CLS
    ids[np.arange(n), lengths - 1] = SEP
    labels = np.where(real & (rng.random((n, seq)) < 0.5), rng.integers(0, 5, (n, seq)), -1)
    return {
        "input_ids": ids,
        "input_mask": real.astype(np.int32),
        "segment_ids": (real & (np.arange(seq)[None] >= lengths[:, None] // 2)).astype(np.int32),
        "label_ids": labels.astype(np.int32),
        "label": rng.random(n).astype(np.float32),
    }


def test_pack_features_round_trip():
    feats = _features()
    packed, layout = packing.pack_features(feats, 3)
    rows = len(packed["input_ids"])
    assert rows < 40 and packed["cls_positions"].shape == packed["label"].shape == (rows, 3)
    assert packed["example_weights"].sum() == 40 and packed["example_weights"].dtype == np.float32
    assert int(packed["input_mask"].sum()) == int(feats["input_mask"].sum())  # all tokens kept
    np.testing.assert_array_equal(packed["pack_ids"] > 0, packed["input_mask"] > 0)
    assert (packed["label_ids"][packed["input_mask"] == 0] == -1).all()  # padding keeps -1
    assert (packed["input_ids"][packed["input_mask"] == 0] == PAD).all()
    cls = np.take_along_axis(packed["input_ids"], packed["cls_positions"], axis=1)
    assert (cls[packed["example_weights"] > 0] == CLS).all()
    for key in ("input_ids", "segment_ids", "label_ids"):
        back = packing.unpack_tokens(packed[key], layout, fill=-1)
        np.testing.assert_array_equal(np.where(feats["input_mask"] > 0, feats[key], -1), back)
    np.testing.assert_array_equal(packing.unpack_examples(packed["label"], layout), feats["label"])
    starts = np.diff(np.concatenate([[0], packed["pack_ids"][0]])) > 0  # positions restart at 0
    assert (packed["position_ids"][0][starts] == 0).all()
    with pytest.raises(ValueError, match="packed already"):
        packing.pack_features(packed, 3)
    with pytest.raises(ValueError, match="data.max_examples_per_row=0"):
        packing.pack_features(feats, 0)


# ---- the model ----------------------------------------------------------------------------------
def _packed_row(seqs, seq_len):
    """(ids, types, pack_ids, position_ids) [1, seq_len] of sequences laid end to end."""
    pack_ids, position_ids, starts = packing.row_layout([len(s) for s, _ in seqs], seq_len)
    ids, types = np.zeros(seq_len, np.int32), np.zeros(seq_len, np.int32)
    for (s, t), start in zip(seqs, starts):
        ids[start : start + len(s)], types[start : start + len(s)] = s, t
    return [x[None].astype(np.int32) for x in (ids, types, pack_ids, position_ids)], starts


@pytest.mark.parametrize("impl", ["xla", "dot_product"])
def test_packed_row_equals_the_sequences_run_separately(impl):
    cfg = get_preset("tiny", vocab_size=VOCAB, max_position_embeddings=32, attention_impl=impl)
    rng = np.random.default_rng(1)
    seqs = []
    for n in (6, 9, 4):
        ids = np.array([CLS, *rng.integers(5, VOCAB, n - 2), SEP])
        seqs.append((ids, (np.arange(n) >= n // 2).astype(np.int32)))
    (ids, types, pack_ids, positions), starts = _packed_row(seqs, 24)
    model = BertModel(cfg)
    params = model.init(jax.random.key(0), jnp.asarray(ids))["params"]
    apply = jax.jit(model.apply)
    out = apply(
        {"params": params},
        ids,
        types,
        None,
        position_ids=positions,
        pack_ids=pack_ids,
        pool_positions=starts[None],
    )
    assert out.pooled_output.shape == (1, 3, cfg.hidden_size)
    # Each sequence alone, padded to 12 with attention_mask (one batch), and the first unpadded.
    padded = [np.stack([np.pad(x, (0, 12 - len(x))) for x in xs]) for xs in zip(*seqs)]
    alone = apply({"params": params}, *padded, (padded[0] > 0).astype(np.int32))
    first = apply({"params": params}, seqs[0][0][None], seqs[0][1][None])
    for i, ((s, _), start) in enumerate(zip(seqs, starts)):
        got = out.sequence_output[0, start : start + len(s)]
        np.testing.assert_allclose(got, alone.sequence_output[i, : len(s)], atol=1e-5)
        np.testing.assert_allclose(out.pooled_output[0, i], alone.pooled_output[i], atol=1e-5)
    np.testing.assert_allclose(out.sequence_output[0, :6], first.sequence_output[0], atol=1e-5)
    np.testing.assert_allclose(out.pooled_output[0, 0], first.pooled_output[0], atol=1e-5)


def _pretrain_config(tmp_path, **data):
    c = base.get_config()
    c.model.preset = "tiny"
    c.model.max_position_embeddings = 64
    c.model.hidden_dropout = c.model.attention_dropout = 0.0
    c.data.nsp = False
    for key, value in data.items():
        c.data[key] = value
    return c


def test_packed_mlm_loss_is_the_weighted_mean_of_the_separate_losses(tmp_path):
    cfg = get_preset("tiny", vocab_size=VOCAB, max_position_embeddings=64)
    model = PreTrainingModel(cfg, nsp=False)
    rng = np.random.default_rng(2)
    seqs, picks = [], []
    for n, k in ((11, 2), (7, 1), (14, 3)):
        seqs.append((np.array([CLS, *rng.integers(5, VOCAB, n - 2), SEP]), np.zeros(n, np.int32)))
        picks.append(np.sort(rng.choice(np.arange(1, n - 1), k, replace=False)))
    (ids, types, pack_ids, positions), starts = _packed_row(seqs, 40)
    pred = 6
    mlm = {k: np.zeros((1, pred), np.int32) for k in ("masked_lm_positions", "masked_lm_ids")}
    mlm["masked_lm_weights"] = np.zeros((1, pred), np.float32)
    flat = np.concatenate([p + s for p, s in zip(picks, starts)])
    mlm["masked_lm_positions"][0, : len(flat)] = flat
    mlm["masked_lm_ids"][0, : len(flat)] = ids[0, flat]
    mlm["masked_lm_weights"][0, : len(flat)] = 1.0
    ids = ids.copy()
    ids[0, flat] = 4  # [MASK]
    batch = dict(
        input_ids=ids,
        segment_ids=types,
        input_mask=(pack_ids > 0).astype(np.int32),
        pack_ids=pack_ids,
        position_ids=positions,
        next_sentence_labels=np.zeros(1, np.int32),
        **mlm,
    )
    params = model.init(jax.random.key(0), jnp.asarray(ids))["params"]

    def loss_fn(task):
        def run(batch):
            norms = task.normalizers(batch)
            return task.loss(model, params, batch, jax.random.key(0), norms, True)[0]

        return jax.jit(run)

    packed = loss_fn(PretrainingTask(_pretrain_config(tmp_path, packing=True), str(tmp_path)))
    plain = loss_fn(PretrainingTask(_pretrain_config(tmp_path), str(tmp_path)))
    losses, counts = [], []
    for (s, t), pick in zip(seqs, picks):  # each alone (padded to 16, at most 3 predictions)
        masked = np.pad(s, (0, 16 - len(s)))
        masked[pick] = 4
        one = dict(
            input_ids=masked[None],
            segment_ids=np.pad(t, (0, 16 - len(t)))[None],
            input_mask=(np.arange(16) < len(s)).astype(np.int32)[None],
            masked_lm_positions=np.pad(pick, (0, 3 - len(pick)))[None],
            masked_lm_ids=np.pad(s[pick], (0, 3 - len(pick)))[None],
            masked_lm_weights=(np.arange(3) < len(pick)).astype(np.float32)[None],
            next_sentence_labels=np.zeros(1, np.int32),
        )
        losses.append(float(plain(one)))
        counts.append(len(pick))
    packed = packed(batch)
    np.testing.assert_allclose(float(packed), np.average(losses, weights=counts), atol=1e-5)


def test_packing_with_nsp_is_a_one_line_error(tmp_path):
    with pytest.raises(ValueError, match=r"^config key data.packing=True needs data.nsp=False"):
        PretrainingTask(_pretrain_config(tmp_path, packing=True, nsp=True), str(tmp_path))
    with pytest.raises(ValueError, match=r"^prepare option packing=True: needs nsp=False"):
        prepare.PrepareConfig(packing=True, nsp=True).validate()


# ---- pretraining data -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A vocab and 2 files of documents of varied length (many short ones: lots of padding)."""
    root = tmp_path_factory.mktemp("packing_corpus")
    letters = "abcdefghijklmnopqrstuvwxyz"
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", ","] + WORDS
    tokens += [c for c in letters if c not in WORDS] + [f"##{c}" for c in letters]
    (root / "vocab.txt").write_text("\n".join(tokens) + "\n")
    rng = np.random.default_rng(0)
    for f in range(2):
        docs = []
        for _ in range(20):
            sentences = [
                " ".join(rng.choice(WORDS, rng.integers(3, 12))).capitalize() + "."
                for _ in range(rng.integers(1, 6))
            ]
            docs.append("\n".join(sentences))
        (root / f"part-{f}.txt").write_text("\n\n".join(docs) + "\n")
    return root


def _prepare(corpus, out, **kw):
    tok = load_tokenizer(str(corpus / "vocab.txt"), do_lower_case=True)
    opts = dict(
        max_seq_length=48,
        max_predictions_per_seq=8,
        nsp=False,
        dupe_factor=1,
        num_shards=2,
        num_workers=1,
        show_progress=False,
    )
    return tok, prepare.prepare(f"{corpus}/part-*.txt", str(out), tok, **{**opts, **kw})


def _records(out, meta, split="train"):
    seq, pred = meta["max_seq_length"], meta["max_predictions_per_seq"]
    spec = {k: tf.io.FixedLenFeature([seq], tf.int64) for k in ("input_ids", "input_mask")}
    if meta["packing"]:
        spec.update({k: tf.io.FixedLenFeature([seq], tf.int64) for k in packing.PACKED_KEYS})
    if meta["masking"] == "static":
        spec["masked_lm_positions"] = tf.io.FixedLenFeature([pred], tf.int64)
        spec["masked_lm_ids"] = tf.io.FixedLenFeature([pred], tf.int64)
        spec["masked_lm_weights"] = tf.io.FixedLenFeature([pred], tf.float32)
    files = [str(out / name) for name in meta["shard_files"][split]]
    ds = tf.data.TFRecordDataset(files).map(lambda r: tf.io.parse_single_example(r, spec))
    return list(ds.as_numpy_iterator())


def _sequences(records):
    """Every packed sequence (token tuple), split at pack_ids (or one per unpacked record)."""
    out = collections.Counter()
    for rec in records:
        ids = rec["input_ids"][rec["input_mask"] > 0]
        groups = rec["pack_ids"][rec["input_mask"] > 0] if "pack_ids" in rec else np.ones(len(ids))
        for g in np.unique(groups):
            out[tuple(ids[groups == g])] += 1
    return out


def test_prepare_packs_the_same_sequences_into_fewer_rows(corpus, tmp_path):
    _, plain = _prepare(corpus, tmp_path / "plain", masking="dynamic", short_seq_prob=0.3)
    _, packed = _prepare(
        corpus, tmp_path / "packed", masking="dynamic", short_seq_prob=0.3, packing=True
    )
    assert packed["packing"] and not plain["packing"]
    a, b = _records(tmp_path / "plain", plain), _records(tmp_path / "packed", packed)
    assert _sequences(a) == _sequences(b)  # no sequence split, lost or changed
    pad_a = 1 - np.mean([r["input_mask"].mean() for r in a])
    pad_b = 1 - np.mean([r["input_mask"].mean() for r in b])
    assert len(b) < len(a) and pad_b < pad_a / 2
    for rec in b:
        real = rec["input_mask"] > 0
        ids, groups, pos = rec["input_ids"][real], rec["pack_ids"][real], rec["position_ids"]
        assert groups[0] == 1 and (np.diff(groups) >= 0).all() and (np.diff(groups) <= 1).all()
        firsts = np.flatnonzero(np.diff(np.concatenate([[0], groups])))
        assert (ids[firsts] == CLS).all() and (pos[firsts] == 0).all()
        assert (ids[np.append(firsts[1:], len(ids)) - 1] == SEP).all()


def test_prepare_masks_packed_rows_as_a_whole(corpus, tmp_path):
    tok, meta = _prepare(corpus, tmp_path / "out", packing=True, short_seq_prob=0.3)
    again = _prepare(corpus, tmp_path / "again", packing=True, short_seq_prob=0.3)[1]
    for name in meta["shard_files"]["train"]:  # deterministic
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / "again" / name).read_bytes()
    assert again["shards"] == meta["shards"]
    for rec in _records(tmp_path / "out", meta):
        n = int(rec["input_mask"].sum())
        k = int(rec["masked_lm_weights"].sum())
        assert k == masking.num_to_predict(n, meta["masked_lm_prob"], 8)  # per row
        pos = rec["masked_lm_positions"][:k]
        assert (rec["masked_lm_ids"][:k] != CLS).all() and (rec["masked_lm_ids"][:k] != SEP).all()
        assert (rec["pack_ids"][pos] > 0).all()  # row-global positions on real tokens
    with pytest.raises(ValueError, match=r"differs in packing"):
        _prepare(corpus, tmp_path / "out", short_seq_prob=0.3)


@pytest.mark.slow  # spawns worker processes that import TensorFlow (~20 s on 2 busy cores)
def test_packed_prepare_is_the_same_for_any_worker_count(corpus, tmp_path):
    _, one = _prepare(corpus, tmp_path / "w1", packing=True, dupe_factor=2)
    _, two = _prepare(corpus, tmp_path / "w2", packing=True, dupe_factor=2, num_workers=2)
    assert one["shards"] == two["shards"]
    for name in one["shards"]:
        assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes()


def test_dynamic_masking_never_masks_the_special_tokens_of_packed_sequences(corpus, tmp_path):
    tok, meta = _prepare(corpus, tmp_path / "dyn", packing=True, masking="dynamic")
    ds = pipeline.pretraining_dataset(
        str(tmp_path / "dyn"),
        "train",
        8,
        seed=0,
        repeat=False,
        dynamic_masking=pipeline.dynamic_masking_config(meta, None),
    )
    plain = {tuple(r["input_ids"]): r for r in _records(tmp_path / "dyn", meta)}
    batches = 0
    for batch in ds.as_numpy_iterator():
        assert batch["pack_ids"].shape == batch["position_ids"].shape == batch["input_ids"].shape
        for row in range(len(batch["input_ids"])):
            k = int(batch["masked_lm_weights"][row].sum())
            labels = batch["masked_lm_ids"][row, :k]
            assert k > 0 and not {CLS, SEP, PAD} & set(labels.tolist())
            original = batch["input_ids"][row].copy()
            original[batch["masked_lm_positions"][row, :k]] = labels
            assert tuple(original) in plain
        batches += 1
    assert batches > 0


# ---- end to end ---------------------------------------------------------------------------------
def test_prepare_and_train_with_packing(corpus, tmp_path):
    c = _pretrain_config(tmp_path, packing=True)
    c.data.corpus = f"{corpus}/part-*.txt"
    c.data.corpus_format = "bert"
    c.data.vocab = str(corpus / "vocab.txt")
    c.data.max_seq_length, c.data.max_predictions_per_seq = 32, 5
    c.data.dupe_factor, c.data.num_shards, c.data.eval_fraction = 1, 2, 0.2
    c.train.steps, c.train.global_batch_size, c.train.log_every = 3, 8, 1
    c.optimizer.warmup_steps = 1  # not longer than the run
    c.train.eval_every, c.train.eval_steps, c.train.checkpoint_every = 3, 1, 3
    c.train.async_checkpoints = False
    c.mesh.num_devices = 1
    c.tensorboard = False
    result = train.train_and_evaluate(c, str(tmp_path / "run"))
    assert result["step"] == 3
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(np.isfinite(r["mlm_loss"]) for r in records) and "nsp_loss" not in records[0]
    assert np.isfinite(read_metrics(tmp_path / "run", "eval")[-1]["mlm_loss"])
    assert os.path.exists(tmp_path / "run" / "data" / "metadata.json")
    c.data.packing = False  # the prepared data were packed: a clear error, not silent misuse
    task = PretrainingTask(c, str(tmp_path / "run"))
    with pytest.raises(
        ValueError, match=r"metadata.json: packing=True but config key data.packing"
    ):
        task.after_prepare()


def test_evaluate_mlm_runs_packed_rows_as_their_sequences():
    from bertjax.commands.mlm_eval import masked_lm_sums

    cfg = get_preset("tiny", vocab_size=VOCAB, max_position_embeddings=32)
    rng = np.random.default_rng(2)
    seqs = [
        (np.array([CLS, *rng.integers(5, VOCAB, n - 2), SEP]), np.zeros(n, np.int32))
        for n in (7, 10, 5)
    ]
    (ids, types, pack_ids, positions), starts = _packed_row(seqs, 24)
    local = [np.array([1, 3]), np.array([2, 5, 8]), np.array([1])]  # masked positions per sequence
    targets = [rng.integers(5, VOCAB, len(p)) for p in local]
    model = PreTrainingModel(cfg, nsp=False)
    params = jax.jit(model.init)(
        jax.random.key(0), jnp.asarray(ids), masked_lm_positions=jnp.zeros((1, 6), jnp.int32)
    )["params"]
    # Jitted as `bertjax evaluate-mlm` runs it (eagerly: 266 compiles, one per op and shape).
    sums = jax.jit(lambda batch: masked_lm_sums(model, params, batch))
    packed = {
        "input_ids": ids,
        "segment_ids": types,
        "input_mask": (ids > 0).astype(np.int32),
        "pack_ids": pack_ids,
        "position_ids": positions,
        "masked_lm_positions": np.concatenate([p + s for p, s in zip(local, starts)])[None],
        "masked_lm_ids": np.concatenate(targets)[None].astype(np.int32),
        "masked_lm_weights": np.ones((1, 6), np.float32),
    }
    got = np.asarray(sums(packed))
    want = np.zeros(3)
    for (s, t), p, y in zip(seqs, local, targets):
        alone = {
            "input_ids": s[None].astype(np.int32),
            "segment_ids": t[None],
            "input_mask": np.ones((1, len(s)), np.int32),
            "masked_lm_positions": p[None].astype(np.int32),
            "masked_lm_ids": y[None].astype(np.int32),
            "masked_lm_weights": np.ones((1, len(p)), np.float32),
        }
        want += np.asarray(sums(alone))
    np.testing.assert_allclose(got, want, rtol=1e-5)
