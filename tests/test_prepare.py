"""Pretraining data preparation: the original instance algorithm, records, determinism, errors."""

import hashlib
import json
import os

import numpy as np
import pytest
import tensorflow as tf

from bertjax.data import masking, pipeline, prepare
from bertjax.text import load_tokenizer

WORDS = (
    "the a of and to in it was he she said that his her on at with for as had you not be this but by "
    "from they we all there were one so an out up into when who which what time day man house"
).split()
PAD, UNK, CLS, SEP, MASK = range(5)


@pytest.fixture(scope="module")
def tiny_vocab(tmp_path_factory):
    """A WordPiece vocab: specials, common words, letters and ## letters (rare words split)."""
    letters = "abcdefghijklmnopqrstuvwxyz"
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", ","] + WORDS
    tokens += [c for c in letters if c not in WORDS] + [f"##{c}" for c in letters]
    path = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    path.write_text("\n".join(tokens) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def tok(tiny_vocab):
    return load_tokenizer(tiny_vocab, do_lower_case=True)


def _write_corpus(folder, num_files=3, docs_per_file=12, seed=0):
    """Files in the "bert" format with sentences of common and made-up (split) words."""
    rng = np.random.default_rng(seed)
    os.makedirs(folder, exist_ok=True)
    paths = []
    for f in range(num_files):
        docs = []
        for _ in range(docs_per_file):
            sentences = []
            for _ in range(rng.integers(2, 14)):
                words = [
                    str(rng.choice(WORDS))
                    if rng.random() < 0.8
                    else "".join(rng.choice(list("xyzq"), 3))
                    for _ in range(rng.integers(3, 15))
                ]
                sentences.append(" ".join(words).capitalize() + ".")
            docs.append("\n".join(sentences))
        paths.append(os.path.join(folder, f"part-{f}.txt"))
        with open(paths[-1], "w") as fh:
            fh.write("\n\n".join(docs) + "\n")
    return paths


def _read(path, meta, static=True):
    seq, pred = meta["max_seq_length"], meta["max_predictions_per_seq"]
    spec = {
        k: tf.io.FixedLenFeature([seq], tf.int64)
        for k in ("input_ids", "input_mask", "segment_ids")
    }
    spec["next_sentence_labels"] = tf.io.FixedLenFeature([1], tf.int64)
    if static:
        spec["masked_lm_positions"] = tf.io.FixedLenFeature([pred], tf.int64)
        spec["masked_lm_ids"] = tf.io.FixedLenFeature([pred], tf.int64)
        spec["masked_lm_weights"] = tf.io.FixedLenFeature([pred], tf.float32)
    ds = tf.data.TFRecordDataset(path).map(lambda r: tf.io.parse_single_example(r, spec))
    return list(ds.as_numpy_iterator())


class _OriginalRandom:
    """The `random.Random` calls the original script makes, on a NumPy generator."""

    def __init__(self, gen):
        self.gen = gen

    def random(self):
        return self.gen.random()

    def randint(self, a, b):  # inclusive, like random.randint
        return int(self.gen.integers(a, b + 1))


def _original_instances(all_documents, document_index, max_seq_length, short_seq_prob, rng):
    """google-research/bert create_instances_from_document (instance part), written from the paper's script."""
    document = all_documents[document_index]
    max_num_tokens = max_seq_length - 3
    target_seq_length = max_num_tokens
    if rng.random() < short_seq_prob:
        target_seq_length = rng.randint(2, max_num_tokens)
    instances, current_chunk, current_length, i = [], [], 0, 0
    while i < len(document):
        current_chunk.append(document[i])
        current_length += len(document[i])
        if i == len(document) - 1 or current_length >= target_seq_length:
            if current_chunk:
                a_end = rng.randint(1, len(current_chunk) - 1) if len(current_chunk) >= 2 else 1
                tokens_a = [t for j in range(a_end) for t in current_chunk[j]]
                tokens_b = []
                if len(current_chunk) == 1 or rng.random() < 0.5:
                    is_random_next = True
                    target_b_length = target_seq_length - len(tokens_a)
                    for _ in range(10):
                        random_document_index = rng.randint(0, len(all_documents) - 1)
                        if random_document_index != document_index:
                            break
                    random_document = all_documents[random_document_index]
                    random_start = rng.randint(0, len(random_document) - 1)
                    for j in range(random_start, len(random_document)):
                        tokens_b.extend(random_document[j])
                        if len(tokens_b) >= target_b_length:
                            break
                    i -= len(current_chunk) - a_end
                else:
                    is_random_next = False
                    for j in range(a_end, len(current_chunk)):
                        tokens_b.extend(current_chunk[j])
                while len(tokens_a) + len(tokens_b) > max_num_tokens:
                    trunc = tokens_a if len(tokens_a) > len(tokens_b) else tokens_b
                    if rng.random() < 0.5:
                        del trunc[0]
                    else:
                        trunc.pop()
                instances.append((tokens_a, tokens_b, is_random_next))
            current_chunk, current_length = [], 0
        i += 1
    return instances


def _synthetic_docs(rng, n_docs, min_sent=1, max_sent=30):
    """Documents of sentences of consecutive integers (so contiguity can be checked)."""
    docs, next_id = [], 10
    for _ in range(n_docs):
        doc = []
        for _ in range(rng.integers(min_sent, max_sent)):
            length = int(rng.integers(1, 25))
            doc.append(list(range(next_id, next_id + length)))
            next_id += length
        docs.append(doc)
    return docs


def test_truncate_seq_pair_trims_longer_side():
    gen = np.random.default_rng(0)
    a, b = list(range(10)), list(range(100, 104))
    prepare.truncate_seq_pair(a, b, 9, gen)
    assert len(a) == 5 and b == [100, 101, 102, 103]
    assert a == list(range(a[0], a[0] + 5))  # a contiguous piece: trimmed at the ends only


def test_instances_equal_the_original_algorithm():
    docs = _synthetic_docs(np.random.default_rng(1), 40)
    for index in range(len(docs)):
        for seed in range(3):
            ours = prepare.create_instances_from_document(
                docs,
                index,
                max_seq_length=64,
                short_seq_prob=0.3,
                nsp=True,
                rng=np.random.default_rng([seed, index]),
            )
            ref = _original_instances(
                docs, index, 64, 0.3, _OriginalRandom(np.random.default_rng([seed, index]))
            )
            assert ours == ref


def test_instance_statistics():
    rng = np.random.default_rng(2)
    docs = _synthetic_docs(rng, 1500, min_sent=8, max_sent=40)
    owner = {t: d for d, doc in enumerate(docs) for s in doc for t in s}
    labels, short_docs = [], 0
    for index in range(len(docs)):
        instances = prepare.create_instances_from_document(
            docs, index, max_seq_length=128, short_seq_prob=0.1, nsp=True, rng=rng
        )
        short_docs += (
            all(len(a) + len(b) < 125 for a, b, _ in instances[:-1]) and len(instances) > 1
        )
        for a, b, is_random in instances:
            assert 1 <= len(a) and 1 <= len(b) and len(a) + len(b) <= 125
            assert {owner[t] for t in a} == {index}
            assert (owner[b[0]] != index) == is_random or len(docs[index]) == 1
            if not is_random:  # the real next: later text of the same document (maybe trimmed)
                assert min(b) > max(a) and {owner[t] for t in b} == {index}
            labels.append(is_random)
    assert 0.47 < np.mean(labels) < 0.56  # ~50% random next (a bit more: 1-sentence chunks)
    assert 0.07 < short_docs / len(docs) < 0.13  # short_seq_prob of the documents


def test_mlm_only_instances_fill_the_sequence():
    docs = _synthetic_docs(np.random.default_rng(3), 30, min_sent=5)
    gen = np.random.default_rng(4)
    for index in range(len(docs)):
        instances = prepare.create_instances_from_document(
            docs, index, max_seq_length=40, short_seq_prob=0.0, nsp=False, rng=gen
        )
        flat = [t for s in docs[index] for t in s]
        for a, b, is_random in instances[:-1]:
            assert len(a) == 38 and b == [] and not is_random
            assert (
                a == list(range(a[0], a[0] + 38)) and a[0] in flat
            )  # consecutive text of this doc


def _check_static_record(rec, meta, tok):
    n = int(rec["input_mask"].sum())
    ids, seg = rec["input_ids"], rec["segment_ids"]
    assert rec["input_mask"][:n].all() and not ids[n:].any() and not seg[n:].any()
    k = int(rec["masked_lm_weights"].sum())
    pos, labels = rec["masked_lm_positions"][:k], rec["masked_lm_ids"][:k]
    assert k == masking.num_to_predict(n, meta["masked_lm_prob"], meta["max_predictions_per_seq"])
    assert not rec["masked_lm_positions"][k:].any() and not rec["masked_lm_ids"][k:].any()
    assert list(pos) == sorted(pos) and 0 < pos.min() and pos.max() < n - 1
    original = ids.copy()
    original[pos] = labels
    assert original[0] == tok.cls_id and original[n - 1] == tok.sep_id
    seps = np.flatnonzero(original[:n] == tok.sep_id)
    assert (
        len(seps) == 2 and original[:n].max() < tok.vocab_size and tok.mask_id not in original[:n]
    )
    assert original[:n].min() > 0  # no [PAD] inside
    np.testing.assert_array_equal(seg[:n], np.arange(n) > seps[0])
    assert set(ids[pos]) <= set(range(tok.vocab_size))
    return original[:n]


def test_prepare_static_records(tmp_path, tok):
    paths = _write_corpus(tmp_path / "corpus")
    meta = prepare.prepare(
        f"{tmp_path}/corpus/*.txt",
        str(tmp_path / "out"),
        tok,
        max_seq_length=48,
        max_predictions_per_seq=6,
        dupe_factor=2,
        num_shards=3,
        eval_fraction=0.2,
        num_workers=1,
        show_progress=False,
    )
    names = sorted(os.listdir(tmp_path / "out"))
    assert names == ["eval-00000-of-00001.tfrecord", "metadata.json"] + [
        f"train-{i:05d}-of-00003.tfrecord" for i in range(3)
    ]
    assert json.loads((tmp_path / "out" / "metadata.json").read_text()) == meta
    assert (
        meta["sources"] == paths
        and meta["vocab_size"] == tok.vocab_size
        and meta["masking"] == "static"
    )
    assert (
        meta["documents"]["train"] + meta["documents"]["eval"] == 36
        and meta["documents"]["eval"] >= 2
    )
    labels = []
    for split in ("train", "eval"):
        for name in meta["shard_files"][split]:
            records = _read(str(tmp_path / "out" / name), meta)
            assert len(records) == meta["shards"][name] > 0
            for rec in records:
                _check_static_record(rec, meta, tok)
                labels.append(int(rec["next_sentence_labels"][0]))
        assert meta["examples"][split] == sum(meta["shards"][n] for n in meta["shard_files"][split])
    assert 0.3 < np.mean(labels) < 0.75


@pytest.mark.slow  # spawns worker processes that import TensorFlow (~20 s on 2 busy cores)
def test_prepare_same_output_for_any_worker_count(tmp_path, tok):
    _write_corpus(tmp_path / "corpus", num_files=3, docs_per_file=6)
    kw = dict(
        max_seq_length=32,
        max_predictions_per_seq=5,
        dupe_factor=2,
        num_shards=2,
        show_progress=False,
    )
    one = prepare.prepare(
        f"{tmp_path}/corpus/*.txt", str(tmp_path / "w1"), tok, num_workers=1, **kw
    )
    two = prepare.prepare(
        f"{tmp_path}/corpus/*.txt", str(tmp_path / "w2"), tok, num_workers=2, **kw
    )
    assert one["shards"] == two["shards"]
    for name in one["shards"]:
        assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes()


def test_prepare_reuses_same_settings_and_rejects_others(tmp_path, tok):
    _write_corpus(tmp_path / "corpus", num_files=2, docs_per_file=4)
    kw = dict(max_seq_length=32, dupe_factor=1, num_shards=2, num_workers=1, show_progress=False)
    first = prepare.prepare(f"{tmp_path}/corpus/*.txt", str(tmp_path / "out"), tok, **kw)
    mtime = os.path.getmtime(tmp_path / "out" / "metadata.json")
    assert prepare.prepare(f"{tmp_path}/corpus/*.txt", str(tmp_path / "out"), tok, **kw) == first
    assert os.path.getmtime(tmp_path / "out" / "metadata.json") == mtime  # not rewritten
    with pytest.raises(
        ValueError, match=r"metadata.json was written for other settings \(differs in seed\)"
    ):
        prepare.prepare(f"{tmp_path}/corpus/*.txt", str(tmp_path / "out"), tok, seed=1, **kw)
    # A shard lost after the run: prepared again (same bytes).
    name = first["shard_files"]["train"][0]
    data = (tmp_path / "out" / name).read_bytes()
    os.remove(tmp_path / "out" / name)
    assert (
        prepare.prepare(f"{tmp_path}/corpus/*.txt", str(tmp_path / "out"), tok, **kw)["shards"]
        == first["shards"]
    )
    assert (tmp_path / "out" / name).read_bytes() == data


def test_prepare_dynamic_mlm_only_whole_word(tmp_path, tok):
    _write_corpus(tmp_path / "corpus", num_files=1)
    meta = prepare.prepare(
        str(tmp_path / "corpus" / "part-0.txt"),
        str(tmp_path / "out"),
        tok,
        max_seq_length=40,
        nsp=False,
        masking="dynamic",
        whole_word_mask=True,
        dupe_factor=1,
        short_seq_prob=0.0,
        num_shards=1,
        num_workers=1,
        show_progress=False,
    )
    records = _read(str(tmp_path / "out" / "train-00000-of-00001.tfrecord"), meta, static=False)
    raw = next(
        iter(tf.data.TFRecordDataset(str(tmp_path / "out" / "train-00000-of-00001.tfrecord")))
    )
    assert "masked_lm_ids" not in tf.train.Example.FromString(raw.numpy()).features.feature
    full = 0
    for rec in records:
        n = int(rec["input_mask"].sum())
        ids = rec["input_ids"][:n]
        assert ids[0] == CLS and ids[-1] == SEP and SEP not in ids[1:-1] and MASK not in ids
        assert not rec["segment_ids"].any() and rec["next_sentence_labels"][0] == 0
        full += n == 40
    assert full >= len(records) - meta["documents"]["train"]  # all but a document's last are full
    # The records feed dynamic masking in tf.data (whole words, fresh mask per seed).
    ws = tok.word_start_table()
    ds = tf.data.Dataset.from_tensor_slices(
        {k: np.stack([r[k] for r in records]) for k in ("input_ids", "input_mask")}
    )
    ds = ds.enumerate().map(
        lambda i, r: masking.tf_mask_tokens(
            r["input_ids"],
            r["input_mask"],
            tf.stack([i, 9]),
            ws,
            vocab_size=tok.vocab_size,
            mask_id=tok.mask_id,
            special_ids=(CLS, SEP, PAD),
            max_predictions_per_seq=6,
            whole_word=True,
        )
    )
    for out, rec in zip(ds.as_numpy_iterator(), records):
        k = int(out["masked_lm_weights"].sum())
        assert k >= 1
        np.testing.assert_array_equal(
            out["masked_lm_ids"][:k], rec["input_ids"][out["masked_lm_positions"][:k]]
        )


def test_prepare_errors(tmp_path, tok):
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(ValueError, match=r"corpus .*empty.txt: no non-empty document"):
        prepare.prepare(
            str(tmp_path / "empty.txt"),
            str(tmp_path / "o1"),
            tok,
            num_workers=1,
            show_progress=False,
        )
    (tmp_path / "one.txt").write_text("The one document.\nIt has two sentences.\n")
    with pytest.raises(
        ValueError, match=r"one.txt: only 1 document; next-sentence prediction needs"
    ):
        prepare.prepare(
            str(tmp_path / "one.txt"), str(tmp_path / "o2"), tok, num_workers=1, show_progress=False
        )
    meta = prepare.prepare(
        str(tmp_path / "one.txt"),
        str(tmp_path / "o3"),
        tok,
        nsp=False,
        dupe_factor=1,
        num_shards=1,
        num_workers=1,
        show_progress=False,
    )
    assert meta["examples"]["train"] == 1
    with pytest.raises(FileNotFoundError, match="missing.txt does not exist"):
        prepare.prepare(
            str(tmp_path / "missing.txt"), str(tmp_path / "o4"), tok, show_progress=False
        )
    with pytest.raises(ValueError, match="prepare option masking='random'"):
        prepare.prepare(str(tmp_path / "one.txt"), str(tmp_path / "o5"), tok, masking="random")
    assert not os.path.exists(tmp_path / "o1" / "metadata.json")


def test_cli(tmp_path, tiny_vocab, capsys):
    _write_corpus(tmp_path / "corpus", num_files=2, docs_per_file=4)
    rc = prepare.main(
        [
            "--input",
            f"{tmp_path}/corpus/part-0.txt,{tmp_path}/corpus/part-1.txt",
            "--output_dir",
            str(tmp_path / "out"),
            "--vocab",
            tiny_vocab,
            "--max_seq_length",
            "32",
            "--dupe_factor",
            "1",
            "--num_shards",
            "2",
            "--masking",
            "dynamic",
            "--nsp",
            "false",
            "--num_workers",
            "1",
            "--no_progress",
        ]
    )
    assert rc == 0 and "examples" in capsys.readouterr().out
    meta = json.loads((tmp_path / "out" / "metadata.json").read_text())
    assert (meta["masking"], meta["nsp"], meta["max_seq_length"], meta["dupe_factor"]) == (
        "dynamic",
        False,
        32,
        1,
    )
    with pytest.raises(SystemExit):
        prepare.main(["--input", "x", "--output_dir", "y", "--vocab", tiny_vocab, "--nsp", "maybe"])


@pytest.mark.shared_data
def test_real_gutenberg_sample(tmp_path, uncased_vocab, shared_data):
    """The first ~300 KB of a real novel with the real uncased vocab: NSP ratio and lengths."""
    src = shared_data / "corpus" / "gutenberg" / "Pride-and-Prejudice_1342__1342-0.txt"
    (tmp_path / "sample.txt").write_bytes(src.read_bytes()[:300_000].rsplit(b"\n", 1)[0])
    tokenizer = load_tokenizer(str(uncased_vocab), do_lower_case=True)
    meta = prepare.prepare(
        str(tmp_path / "sample.txt"),
        str(tmp_path / "out"),
        tokenizer,
        corpus_format="text",
        dupe_factor=1,
        num_shards=1,
        num_workers=1,
        show_progress=False,
    )
    records = _read(str(tmp_path / "out" / "train-00000-of-00001.tfrecord"), meta)
    assert len(records) == meta["examples"]["train"] > 400 and meta["documents"]["train"] >= 20
    lengths = np.array([r["input_mask"].sum() for r in records])
    # Most fill the sequence; short_seq_prob makes some short. With 29 documents one short target
    # gives many short (and single-sentence, so random-next) instances: over 40 seeds, the original
    # algorithm gives 47-100% full rows and 49-61% random next here (tests/test_spans.py checks
    # the rates on many documents).
    assert np.mean(lengths == 128) > 0.45
    assert 0.4 < np.mean([r["next_sentence_labels"][0] for r in records]) < 0.66
    text = " ".join(tokenizer.decode(_check_static_record(r, meta, tokenizer)) for r in records)
    assert "elizabeth" in text and "[UNK]" not in text and "project gutenberg" not in text


def test_prepare_empty_eval_split_writes_empty_shards_and_metadata(tmp_path, tok, caplog):
    _write_corpus(tmp_path / "corpus", num_files=1, docs_per_file=4)
    with caplog.at_level("WARNING"):
        meta = prepare.prepare(
            f"{tmp_path}/corpus/*.txt",
            str(tmp_path / "out"),
            tok,
            max_seq_length=32,
            dupe_factor=1,
            num_shards=2,
            eval_fraction=0.02,
            num_workers=1,
            show_progress=False,
        )
    assert meta["documents"]["eval"] == 0 and meta["examples"] == {
        "train": meta["examples"]["train"],
        "eval": 0,
    }
    assert "the eval shards are empty" in caplog.text
    assert json.loads((tmp_path / "out" / "metadata.json").read_text()) == meta
    eval_shard = tmp_path / "out" / "eval-00000-of-00001.tfrecord"
    assert eval_shard.exists() and meta["shards"][eval_shard.name] == 0
    assert _read(str(eval_shard), meta) == []
    assert not [n for n in os.listdir(tmp_path / "out") if n.endswith(".tmp")]
    assert pipeline.split_is_empty(str(tmp_path / "out"), "eval")
    assert not pipeline.split_is_empty(str(tmp_path / "out"), "train")


def test_prepare_records_the_vocabulary_hash(tmp_path, tiny_vocab):
    _write_corpus(tmp_path / "corpus", num_files=1, docs_per_file=4)
    kw = dict(max_seq_length=32, dupe_factor=1, num_shards=1, num_workers=1, show_progress=False)
    vocab = tmp_path / "vocab.txt"
    vocab.write_bytes(open(tiny_vocab, "rb").read())
    tok = load_tokenizer(str(vocab), do_lower_case=True)
    meta = prepare.prepare(f"{tmp_path}/corpus/*.txt", str(tmp_path / "out"), tok, **kw)
    assert meta["vocab_sha256"] == hashlib.sha256(vocab.read_bytes()).hexdigest()
    lines = vocab.read_text().splitlines()
    lines[7], lines[8] = lines[8], lines[7]  # same file, same size, other ids
    vocab.write_text("\n".join(lines) + "\n")
    swapped = load_tokenizer(str(vocab), do_lower_case=True)
    assert swapped.vocab_size == tok.vocab_size
    with pytest.raises(ValueError, match=r"\(differs in vocab_sha256 \(the vocabulary file's"):
        prepare.prepare(f"{tmp_path}/corpus/*.txt", str(tmp_path / "out"), swapped, **kw)


def test_prepare_warns_when_nsp_has_no_real_next_segment(tmp_path, tok, caplog):
    docs = [" ".join(WORDS[i : i + 8]) + "." for i in range(0, 40, 4)]  # one sentence each
    (tmp_path / "one_sentence.txt").write_text("\n\n".join(docs) + "\n")
    kw = dict(max_seq_length=32, dupe_factor=1, num_shards=1, num_workers=1, show_progress=False)
    with caplog.at_level("WARNING"):
        meta = prepare.prepare(str(tmp_path / "one_sentence.txt"), str(tmp_path / "o1"), tok, **kw)
    records = _read(str(tmp_path / "o1" / "train-00000-of-00001.tfrecord"), meta)
    assert records and all(r["next_sentence_labels"][0] == 1 for r in records)
    assert f"nsp: none of the {len(records)} instances has a real next segment" in caplog.text
    caplog.clear()
    _write_corpus(tmp_path / "corpus", num_files=1, docs_per_file=4)
    with caplog.at_level("WARNING"):
        prepare.prepare(f"{tmp_path}/corpus/*.txt", str(tmp_path / "o2"), tok, **kw)
    assert "real next segment" not in caplog.text
