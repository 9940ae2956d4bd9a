"""Bad input to the commands other than pretraining (fine-tuning data, `convert`, `evaluate`,
`extract-features`, config files, `launch/local.sh`): one line naming the file and line, the key
or the place in the file; never a traceback, a silent score or a half-written output."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from bertjax.commands import extract_features, score
from bertjax.tasks import glue_data, ner_data, squad_data, swag_data

REPO = pathlib.Path(__file__).resolve().parent.parent
LATIN1 = "caf\xe9".encode("latin-1")  # not UTF-8

SQUAD = {
    "version": "1.1",
    "data": [
        {
            "title": "t",
            "paragraphs": [
                {
                    "context": "the movie is good",
                    "qas": [
                        {
                            "id": f"q{i}",
                            "question": "is it good?",
                            "answers": [{"text": "good", "answer_start": 13}],
                        }
                        for i in range(3)
                    ],
                }
            ],
        }
    ],
}
SWAG_HEADER = ",video-id,fold-ind,startphrase,sent1,sent2,gold-source,"
SWAG_HEADER += "ending0,ending1,ending2,ending3,label\n"


def _reader_case(name, tmp_path):
    """(file, reader) with a non-UTF-8 byte on line 3 of the file."""
    path = tmp_path / name
    if name == "train.tsv":
        path.write_bytes(b"sentence\tlabel\na b\t0\n" + LATIN1 + b"\t1\n")
        return path, lambda p: glue_data.read_glue_tsv(p, "sst2", "train")
    if name == "train.txt":
        path.write_bytes(b"the O\nmovie O\n" + LATIN1 + b" O\n")
        return path, ner_data.read_conll
    if name == "train.csv":
        row = "0,v,0,x,a,b,gold,e0,e1,e2,e3,1\n"
        path.write_bytes((SWAG_HEADER + row).encode() + LATIN1 + b",v,1,x,a,b,g,e,e,e,e,1\n")
        return path, swag_data.read_swag
    if name == "train-v1.1.json":
        path.write_bytes(json.dumps(SQUAD, indent=1).encode().replace(b"movie", LATIN1))
        return path, squad_data.load_squad_json
    if name == "dev.json":  # `bertjax evaluate squad`'s dataset file
        path.write_bytes(json.dumps(SQUAD, indent=1).encode().replace(b"movie", LATIN1))
        (tmp_path / "pred.json").write_text("{}")
        return path, lambda p: score.evaluate_squad_files(str(p), str(tmp_path / "pred.json"))
    path.write_bytes(b"one sentence\nanother ||| pair\n" + LATIN1 + b"\n")  # sentences.txt
    return path, extract_features.read_examples


@pytest.mark.parametrize(
    "name",
    ["train.tsv", "train.txt", "train.csv", "train-v1.1.json", "dev.json", "sentences.txt"],
)
def test_a_file_that_is_not_utf8_is_one_line_naming_the_line(tmp_path, name):
    path, read = _reader_case(name, tmp_path)
    line = next(i for i, x in enumerate(path.read_bytes().split(b"\n"), 1) if LATIN1 in x)
    with pytest.raises(ValueError, match=f"^{path}:{line}: not valid UTF-8") as err:
        read(path)
    assert "\n" not in str(err.value)


def _squad_edit(edit):
    data = json.loads(json.dumps(SQUAD))
    edit(data)
    return data


QA = "data[0].paragraphs[0].qas[1]"


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d["data"][0].pop("paragraphs"), "data[0] has no 'paragraphs'"),
        (
            lambda d: d["data"][0]["paragraphs"][0].pop("context"),
            "data[0].paragraphs[0] has no 'context'",
        ),
        (lambda d: d["data"][0]["paragraphs"][0].pop("qas"), "data[0].paragraphs[0] has no 'qas'"),
        (
            lambda d: d["data"][0]["paragraphs"][0]["qas"][1]["answers"][0].pop("text"),
            f"question q1 ({QA}.answers[0]) has no 'text'",
        ),
        (
            lambda d: d["data"][0]["paragraphs"][0]["qas"][1]["answers"][0].pop("answer_start"),
            f"question q1 ({QA}.answers[0]) has no 'answer_start'",
        ),
        (
            lambda d: d["data"][0]["paragraphs"][0]["qas"][1]["answers"][0].update(
                answer_start="13"
            ),
            f"question q1 ({QA}.answers[0]): 'answer_start' is \"13\", not an integer",
        ),
        (
            lambda d: d["data"][0]["paragraphs"][0]["qas"][1].update(answers=None),
            f"question q1 ({QA}): 'answers' is null, not a list",
        ),
        (lambda d: d.update(data={"title": "t"}), "'data' is a dict, not a list of articles"),
        (lambda d: d["data"].append("x"), "data[1] is a str, not a article object"),
    ],
)
def test_squad_file_without_a_key_names_the_place_and_the_key(tmp_path, edit, message):
    path = tmp_path / "train-v1.1.json"
    path.write_text(json.dumps(_squad_edit(edit)))
    with pytest.raises(ValueError) as err:
        squad_data.read_squad_examples(path, is_training=True)
    assert str(err.value) == f"{path}: {message}"


def test_evaluate_squad_checks_the_keys_it_reads_and_only_those(tmp_path):
    (tmp_path / "pred.json").write_text(json.dumps({"q0": "good", "q1": "bad", "q2": "good"}))
    dataset = tmp_path / "dev.json"
    dataset.write_text(json.dumps(_squad_edit(lambda d: d.update(data={"title": "t"}))))
    with pytest.raises(ValueError, match="'data' is a dict, not a list of articles"):
        score.evaluate_squad_files(str(dataset), str(tmp_path / "pred.json"))

    def strip(d):  # a scoring-only file: no contexts, questions or offsets
        paragraph = d["data"][0]["paragraphs"][0]
        paragraph.pop("context")
        for qa in paragraph["qas"]:
            qa.pop("question")
            qa["answers"][0].pop("answer_start")

    dataset.write_text(json.dumps(_squad_edit(strip)))
    result = score.evaluate_squad_files(str(dataset), str(tmp_path / "pred.json"))
    assert result["exact_match"] == pytest.approx(200 / 3)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A random 1-layer BERT written as a Hugging Face directory by `convert`'s writer."""
    import flax.linen as nn
    import jax

    from bertjax.convert import Checkpoint, flatten_params, save_checkpoint
    from bertjax.models.bert import BertConfig, BertModel

    root = tmp_path_factory.mktemp("hf")
    (root / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a"]))
    config = BertConfig(
        vocab_size=6,
        hidden_size=8,
        num_layers=1,
        num_heads=2,
        intermediate_size=16,
        max_position_embeddings=16,
    )
    ids = np.zeros((1, 4), np.int32)
    init = jax.jit(lambda ids: nn.meta.unbox(BertModel(config).init(jax.random.key(0), ids)))
    params = init(ids)["params"]  # one compiled program, not one per primitive
    tensors = {k: np.asarray(v) for k, v in flatten_params({"bert": params}).items()}
    ckpt = Checkpoint(config, tensors, str(root / "vocab.txt"), True, "test")
    save_checkpoint(ckpt, str(root / "hf"), "hf")
    save_checkpoint(ckpt, str(root / "bertjax"), "bertjax")
    return root


def _copy(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    shutil.copytree(src, dst)
    return dst


def _convert_error(src, tmp_path, *args) -> str:
    from bertjax.convert import main as convert_main

    out = tmp_path / "out"
    with pytest.raises(ValueError) as err:
        convert_main([str(src), "--to=bertjax", str(out), *args])
    assert not out.exists() and "\n" not in str(err.value)
    return str(err.value)


def test_convert_names_the_json_file_that_is_wrong(hf_dir, tmp_path):
    src = _copy(hf_dir / "hf", tmp_path / "list")
    (src / "config.json").write_text("[1, 2]")
    message = _convert_error(src, tmp_path)
    assert message == f"{src}/config.json: the model config is a JSON list, not an object"

    src = _copy(hf_dir / "hf", tmp_path / "tokenizer")
    (src / "tokenizer_config.json").write_text("{bad")
    assert _convert_error(src, tmp_path).startswith(
        f"{src}/tokenizer_config.json: cannot read the tokenizer config (Expecting property"
    )

    for index, expected in [
        ('{"metadata": {}}', "no 'weight_map' object (tensor name -> shard file)"),
        ('{"weight_map": ', "cannot read the weights index (Expecting value"),
    ]:
        src = _copy(hf_dir / "hf", tmp_path / f"index{len(index)}")
        (src / "model.safetensors").rename(src / "model-00001-of-00001.safetensors")
        (src / "model.safetensors.index.json").write_text(index)
        message = _convert_error(src, tmp_path)
        assert message.startswith(f"{src}/model.safetensors.index.json: {expected}"), message


def test_a_corrupted_bertjax_checkpoint_is_one_line_naming_the_step(hf_dir, tmp_path):
    src = _copy(hf_dir / "bertjax", tmp_path / "bj")
    data = [p for p in (src / "0" / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    assert data
    for path in data:  # the tensor data files, truncated
        path.write_bytes(path.read_bytes()[:10])
    message = _convert_error(src, tmp_path)
    assert (
        message.startswith(f"checkpoint step 0 in {src} does not restore (") and "\n" not in message
    )
    assert str(src / "0" / "state") in message

    src = _copy(hf_dir / "bertjax", tmp_path / "noconfig")
    shutil.rmtree(src / "0" / "config")
    message = _convert_error(src, tmp_path)
    assert 'does not restore (KeyError: Item "config" was not found' in message


def _bertjax(*args, cwd=REPO, timeout=300):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", "bertjax.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc.returncode, proc.stderr.strip().splitlines()


@pytest.mark.parametrize(
    "body, expected",
    [
        (None, "bertjax finetune: error: --config={config}: no such config file"),
        (
            "def get_config(:\n",
            "bertjax finetune: error: {config}:1: invalid config file: invalid syntax",
        ),
        (
            "def other():\n    pass\n",
            "bertjax finetune: error: {config}: the config file defines no get_config()",
        ),
        (
            "def get_config():\n    x = 1\n    raise ValueError('no such preset: huge')\n",
            "bertjax finetune: error: {config}:3: get_config() failed: ValueError: no such preset: huge",
        ),
        (
            "def get_config():\n    open('/nonexistent/x')\n",  # reported when the config is used
            "bertjax finetune: error: Configuration is not available because of an earlier failure to load: "
            "[Errno 2] No such file or directory: '/nonexistent/x'",
        ),
    ],
)
def test_a_config_file_that_does_not_load_is_one_line(tmp_path, body, expected):
    config = tmp_path / "configs" / "mine.py"
    if body is not None:
        config.parent.mkdir()
        config.write_text(body)
    rc, err = _bertjax("finetune", f"--config={config}", f"--workdir={tmp_path / 'w'}")
    assert rc == 1 and err == [expected.format(config=config)], err


def test_finetune_of_a_pretraining_config_is_one_line(tmp_path):
    rc, err = _bertjax("finetune", "--config=configs/demo.py", f"--workdir={tmp_path / 'w'}")
    assert rc == 1 and err == [
        "bertjax finetune: error: finetune needs --config.task=<a fine-tuning task>"
    ], err


def test_local_sh_without_a_command_stops_before_starting_processes(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "BERTJAX_CMD"}
    proc = subprocess.run(
        [str(REPO / "launch" / "local.sh"), "2", "--"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "local.sh: error: no bertjax command after '--' (e.g. -- pretrain --config=... --workdir=...)"
    )
    assert not (tmp_path / "workdir").exists()


BAD_JSON_LINE = '{"_id": "c" "text": "z"}'  # a comma missing before column 13


def _read_with(reader):
    from bertjax.commands import plot
    from bertjax.data import formats
    from bertjax.retrieval import beir, corpus_input
    from bertjax.retrieval.reranker import task as reranker

    return {
        "corpus": lambda path: corpus_input.read_corpus(str(path)),
        "beir": lambda path: list(beir.json_objects(str(path))),
        "jsonl_texts": lambda path: list(formats.jsonl_texts(str(path))),
        "reranker": lambda path: reranker.read_pairs(str(path)),
        "plot": lambda path: plot.read_records(str(path.parent)),
    }[reader]


@pytest.mark.parametrize("reader", ["corpus", "beir", "jsonl_texts", "reranker", "plot"])
def test_invalid_json_line_names_file_line_and_column(tmp_path, reader):
    path = tmp_path / ("metrics.jsonl" if reader == "plot" else "corpus.jsonl")
    good = '{"_id": "a", "text": "x", "query": "q", "passage": "p", "label": 1}'
    path.write_text(f"{good}\n{good.replace('a', 'b', 1)}\n{BAD_JSON_LINE}\n")
    with pytest.raises(ValueError) as err:
        _read_with(reader)(path)
    assert str(err.value) == f"{path}:3: invalid JSON at column 13: Expecting ',' delimiter"


def test_invalid_json_line_cut_short_points_past_its_end(tmp_path):
    from bertjax.retrieval import corpus_input

    path = tmp_path / "corpus.jsonl"
    path.write_text('{"_id": "a", "text": "x"}\n{"_id": "b", "text": "x"\n')
    with pytest.raises(ValueError) as err:
        corpus_input.read_corpus(str(path))
    assert str(err.value) == f"{path}:2: invalid JSON at column 25: Expecting ',' delimiter"


def test_invalid_json_file_names_file_line_and_column(tmp_path):
    from bertjax.data import metadata

    (tmp_path / "metadata.json").write_text('{\n  "max_seq_length": 128,\n  "nsp" true\n}\n')
    with pytest.raises(ValueError) as err:
        metadata.read_metadata(str(tmp_path))
    expected = f"{tmp_path}/metadata.json:3: invalid JSON at column 9: Expecting ':' delimiter"
    assert str(err.value) == expected
    squad = tmp_path / "squad.json"
    squad.write_text('{"version": "1.1", "data": [}')
    with pytest.raises(ValueError) as err:
        squad_data.load_squad_json(squad)
    assert str(err.value) == f"{squad}:1: invalid JSON at column 29: Expecting value"
