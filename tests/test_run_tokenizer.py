"""A pretraining run's checkpoint keeps the tokenizer it trained with: a cased tokenizer.json run
reloads, converts and continues (the file decides its casing, not data.do_lower_case), and
continued pretraining refuses a vocabulary other than the init checkpoint's, even of its size."""

import logging

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
from train_fixtures import VOCAB_SIZE, tiny_config, write_vocab

from bertjax import convert, train
from bertjax.pretrained import load_pretrained


def _tokenizer_json(path, vocab_txt, lowercase: bool):
    """A BERT WordPiece tokenizer.json over the tokens of ``vocab_txt``."""
    tokens = vocab_txt.read_text().split()
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(tokens)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


@pytest.mark.slow
def test_a_cased_tokenizer_json_run_reloads_converts_and_continues(tmp_path, caplog):
    """A run on a cased tokenizer.json with base's data.do_lower_case (unset)."""
    tmp, run = tmp_path, tmp_path / "run"
    cased = _tokenizer_json(tmp / "cased" / "tokenizer.json", write_vocab(tmp / "vocab.txt"), False)
    train.train_and_evaluate(tiny_config(tmp, steps=2, **{"data.vocab": str(cased)}), str(run))
    model = load_pretrained(str(run))
    assert model.tokenizer.kind == "hf" and not model.tokenizer.do_lower_case
    convert.main(["--to=hf", str(run), str(tmp / "hf")])
    exported = load_pretrained(str(tmp / "hf"))
    assert exported.tokenizer.kind == "hf" and not exported.tokenizer.do_lower_case
    ids = np.array([[2, 10, 11, 12, 3]], np.int32)
    np.testing.assert_allclose(
        exported(ids).sequence_output, model(ids).sequence_output, rtol=1e-5, atol=1e-5
    )
    # Continued pretraining from the run; an explicit data.do_lower_case against the file warns.
    c = tiny_config(tmp, steps=1, **{"data.vocab": str(cased), "init_checkpoint": str(run)})
    c.data.do_lower_case = True
    with caplog.at_level(logging.WARNING, logger="bertjax"):
        result = train.train_and_evaluate(c, str(tmp / "continued"))
    assert result["step"] == 1
    warned = [r.getMessage() for r in caplog.records if "data.do_lower_case=True" in r.getMessage()]
    assert warned and "ignored" in warned[0] and "keeps case" in warned[0]


def _hf_checkpoint(tmp, vocab_txt):
    """A random 1-layer BERT encoder as a Hugging Face directory, with ``vocab_txt`` beside it."""
    import flax.linen as nn
    import jax

    from bertjax.convert import Checkpoint, flatten_params, save_checkpoint
    from bertjax.models.bert import BertConfig, BertModel

    cfg = BertConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    ids = np.zeros((1, 8), np.int32)
    params = nn.meta.unbox(BertModel(cfg).init(jax.random.key(0), ids)["params"])
    tensors = {k: np.asarray(v) for k, v in flatten_params({"bert": params}).items()}
    save_checkpoint(Checkpoint(cfg, tensors, str(vocab_txt), True, "test"), str(tmp), "hf")
    return tmp


def test_continued_pretraining_refuses_another_vocabulary_of_the_same_size(tmp_path):
    vocab = write_vocab(tmp_path / "vocab.txt")
    ckpt = _hf_checkpoint(tmp_path / "ckpt", vocab)
    tokens = vocab.read_text().split()
    tokens[5], tokens[6] = tokens[6], tokens[5]  # the same size, two ids swapped
    swapped = tmp_path / "swapped.txt"
    swapped.write_text("\n".join(tokens) + "\n")
    c = tiny_config(tmp_path, steps=1, **{"data.vocab": str(swapped), "init_checkpoint": str(ckpt)})
    with pytest.raises(ValueError) as err:
        train.train_and_evaluate(c, str(tmp_path / "swapped_run"))
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"config key data.vocab={swapped} is not the vocabulary of the init ")
    assert str(ckpt / "vocab.txt") in message and f"token 5 is {tokens[5]!r} here" in message
    # The same tokens in another file (a tokenizer.json) are the same vocabulary.
    c.data.vocab = str(_tokenizer_json(tmp_path / "same" / "tokenizer.json", vocab, True))
    task = train.prepared_task(c, str(tmp_path / "same_run"))
    assert task.model_config().vocab_size == VOCAB_SIZE


def test_hf_export_of_a_modernbert_with_its_own_tokenizer_loads_in_transformers(tmp_path):
    """A ModernBERT trained on its own small vocabulary (the preset's special-token ids, 50281-3,
    lie outside it) exports with the vocabulary's ids in config.json and tokenizer files, so
    transformers' AutoModelForMaskedLM, AutoTokenizer and pipeline("fill-mask") load it."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    vocab = write_vocab(tmp_path / "vocab.txt")
    tokenizer_json = _tokenizer_json(tmp_path / "tok" / "tokenizer.json", vocab, lowercase=True)
    config = transformers.ModernBertConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=48,
        max_position_embeddings=64,
        pad_token_id=0,
        cls_token_id=2,
        sep_token_id=3,
        bos_token_id=2,
        eos_token_id=3,
    )
    torch.manual_seed(0)
    transformers.ModernBertForMaskedLM(config).save_pretrained(tmp_path / "hf")
    ckpt = convert.load_checkpoint(str(tmp_path / "hf"))
    # as a bertjax run of the preset leaves it: the preset's ids, the run's own tokenizer.json
    ckpt.config = ckpt.config.replace(pad_token_id=50283, cls_token_id=50281, sep_token_id=50282)
    ckpt.vocab_file = str(tokenizer_json)
    convert.save_checkpoint(ckpt, str(tmp_path / "export"), "hf")
    exported = transformers.AutoConfig.from_pretrained(tmp_path / "export")
    assert (exported.pad_token_id, exported.cls_token_id, exported.sep_token_id) == (0, 2, 3)
    model = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "export").eval()
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "export")
    assert (tok.mask_token, tok.mask_token_id, tok.pad_token_id) == ("[MASK]", 4, 0)
    fill = transformers.pipeline("fill-mask", model=model, tokenizer=tok, device="cpu")
    assert len(fill("w1 w2 [MASK] w4", top_k=3)) == 3
