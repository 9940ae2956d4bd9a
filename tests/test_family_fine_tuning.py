"""Fine-tuning from a transformers checkpoint of each newer family (EuroBERT, NomicBERT, GTE): a
GLUE and a SQuAD run of 2 steps start from the directory's encoder; the GLUE run's folder exports
to transformers (an empty loading report) and gives the logits ``load_pretrained(RUN)`` gives; the
SQuAD run's export says in one line that transformers has no QA class of the family. (NER's and
multiple choice's heads are architecture-independent: tests/test_finetune_heads.py holds the
families' token classifiers to transformers at step 0.)"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import small_config
from hf_random import randomize

import bertjax
from bertjax import convert, train
from configs import glue as glue_config
from configs import squad as squad_config

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

# conftest.py: `files` (tiny files in the official formats) and a module-scoped XLA cache.

TASKS = {
    "glue": (glue_config, "glue/sst2", "glue", {}),
    "squad": (
        squad_config,
        "squad/v1.1",
        "squad",
        {"data.max_query_length": 10, "data.doc_stride": 8},
    ),
}
FAMILIES = {  # architecture -> transformers MLM class and config (GQA / untied decoders)
    "eurobert": (
        "EuroBertForMaskedLM",
        "EuroBertConfig",
        dict(num_attention_heads=4, num_key_value_heads=2, bos_token_id=2, eos_token_id=3),
    ),
    "nomicbert": ("NomicBertForMaskedLM", "NomicBertConfig", dict(num_attention_heads=4)),
    "gte": ("GteForMaskedLM", "GteConfig", dict(num_attention_heads=4)),  # one token type
}


@pytest.fixture(scope="module")
def mlm_dirs(files, tmp_path_factory):
    """``mlm_dirs(arch)``: a random transformers masked-LM directory of the family over the
    fine-tuning files' vocabulary (hidden 32, 2 layers, untied decoder), built on first use."""
    root = tmp_path_factory.mktemp("families")
    built = {}

    def get(arch):
        if arch not in built:
            cls, config_cls, extra = FAMILIES[arch]
            size = len((files / "vocab.txt").read_text().split())
            config = getattr(transformers, config_cls)(
                vocab_size=size,
                hidden_size=32,
                intermediate_size=48,
                num_hidden_layers=2,
                max_position_embeddings=64,
                pad_token_id=0,
                tie_word_embeddings=False,
                **extra,
            )
            torch.manual_seed(0)
            model = getattr(transformers, cls)(config).eval()
            randomize(model, seed=5)
            model.save_pretrained(root / arch)
            (root / arch / "vocab.txt").write_text((files / "vocab.txt").read_text())
            built[arch] = root / arch
        return built[arch]

    return get


@pytest.mark.parametrize("kind", list(TASKS))
@pytest.mark.parametrize("arch", list(FAMILIES))
def test_fine_tuning_from_the_familys_directory(files, mlm_dirs, tmp_path, arch, kind):
    module, task, data_dir, extra = TASKS[kind]
    c = small_config(
        module.get_config(),
        files,
        data_dir,
        task=task,
        init_checkpoint=str(mlm_dirs(arch)),
        **extra,
    )
    c.train.steps = 2
    workdir = tmp_path / "run"
    result = train.train_and_evaluate(c, str(workdir))
    assert result["step"] == 2 and np.isfinite(result["train"]["loss"])
    ckpt = convert.load_checkpoint(str(workdir))
    assert ckpt.config.architecture == arch and ckpt.config.num_layers == 2
    if kind == "squad":
        with pytest.raises(ValueError) as info:
            convert.save_checkpoint(ckpt, str(tmp_path / "hf"), "hf")
        assert "\n" not in str(info.value) and "--to=bertjax" in str(info.value)
        assert not (tmp_path / "hf").exists()
        return
    convert.main([str(workdir), "--to=hf", str(tmp_path / "hf")])
    hf, loading = transformers.AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "hf", attn_implementation="eager", output_loading_info=True
    )
    assert not any(loading.values()), loading
    assert hf.config.num_labels == 2
    rng = np.random.default_rng(3)
    ids = rng.integers(5, ckpt.config.vocab_size, (2, 16)).astype(np.int32)
    mask = (np.arange(16)[None, :] < np.array([[16], [9]])).astype(np.int32)
    ids[:, 0], ids = 2, np.where(mask > 0, ids, 0)
    with torch.no_grad():
        want = hf.eval()(torch.from_numpy(ids).long(), attention_mask=torch.from_numpy(mask))
    got = bertjax.load_pretrained(str(workdir))(ids, input_mask=mask).logits
    np.testing.assert_allclose(np.asarray(got), want.logits.numpy(), atol=1e-4)
    assert float(np.abs(want.logits.numpy()).max()) > 1e-3  # not a vacuous comparison
