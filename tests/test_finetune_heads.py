"""Fine-tuning starts from the init checkpoint's own task head (``bertjax.head_init``).

A transformers task model (ModernBERT and BERT: sequence classification, token classification,
question answering, multiple choice; EuroBERT, NomicBERT and GTE: sequence and token
classification) with random O(1) weights is written by transformers itself;
fine-tuning the matching task from it gives step-0 eval logits equal to PyTorch's within 1e-4 in
fp32 (the encoder and the head both converted). A classifier with another label count, or a head of
another kind, stays freshly initialised with a warning, and the log names what was taken.
"""

from __future__ import annotations

import logging
import shutil

import jax
import numpy as np
import pytest
from helpers import small_config
from hf_random import randomize

from bertjax import train
from bertjax.tasks.registry import get_task
from configs import glue as glue_config
from configs import ner as ner_config
from configs import squad as squad_config
from configs import swag as swag_config

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

# conftest.py: `files` (tiny files in the official formats) and a module-scoped XLA cache, as in
# test_finetune; small_config (helpers.py) is their shared tiny run config.

TOL = 1e-4
NER_LABELS = 9  # CoNLL-2003's tag set (the fixture's tags are a subset of it)
TASKS = {  # kind -> (task, config module, data folder, overrides, transformers class suffix)
    "sequence": ("glue/sst2", glue_config, "glue", {}, "ForSequenceClassification"),
    "token": ("ner/conll2003", ner_config, "ner", {}, "ForTokenClassification"),
    "span": (
        "squad/v1.1",
        squad_config,
        "squad",
        {"data.max_query_length": 10, "data.doc_stride": 8},
        "ForQuestionAnswering",
    ),
    "choice": ("swag", swag_config, "swag", {}, "ForMultipleChoice"),
}


def _hf_config(arch: str, vocab_size: int, num_labels: int):
    if arch in ("nomicbert", "gte"):
        config_class = {"nomicbert": "NomicBertConfig", "gte": "GteConfig"}[arch]
        return getattr(transformers, config_class)(
            vocab_size=vocab_size,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=40,
            max_position_embeddings=64,
            pad_token_id=0,
            num_labels=num_labels,
            attn_implementation="eager",
        )
    if arch == "eurobert":
        return transformers.EuroBertConfig(
            vocab_size=vocab_size,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=40,
            max_position_embeddings=64,
            pad_token_id=0,
            bos_token_id=2,
            eos_token_id=3,
            mask_token_id=4,
            num_labels=num_labels,
            attn_implementation="eager",
        )
    if arch == "modernbert":
        return transformers.ModernBertConfig(
            vocab_size=vocab_size,
            hidden_size=32,
            num_hidden_layers=3,
            num_attention_heads=2,
            intermediate_size=40,
            max_position_embeddings=64,
            global_attn_every_n_layers=2,
            local_attention=8,  # shorter than the sequences: sliding-window layers matter
            pad_token_id=0,
            cls_token_id=2,
            sep_token_id=3,
            bos_token_id=2,
            eos_token_id=3,
            num_labels=num_labels,
            attn_implementation="eager",
        )
    return transformers.BertConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=num_labels,
        attn_implementation="eager",
    )


def _write_hf_model(files, path, arch: str, suffix: str, num_labels: int, seed: int = 0):
    """A random transformers task model saved as a directory (vocab.txt beside it); its weights
    are rescaled to O(1) activations (HF's 0.02 init leaves every layer near the identity)."""
    vocab_size = len((files / "vocab.txt").read_text().split())
    prefix = {
        "modernbert": "ModernBert",
        "eurobert": "EuroBert",
        "nomicbert": "NomicBert",
        "gte": "Gte",
    }
    prefix = prefix.get(arch, "Bert")
    torch.manual_seed(seed)
    config = _hf_config(arch, vocab_size, num_labels)
    model = getattr(transformers, prefix + suffix)(config).eval()
    randomize(model, seed)
    model.save_pretrained(path)
    shutil.copy(files / "vocab.txt", path / "vocab.txt")
    return model


def _setup(files, tmp_path, kind: str, ckpt):
    task_name, config, data_dir, extra, _ = TASKS[kind]
    c = small_config(
        config.get_config(), files, data_dir, task=task_name, init_checkpoint=str(ckpt), **extra
    )
    task = get_task(c.task, c, str(tmp_path / "run"))
    task.after_prepare()
    setup = train.build(c, str(tmp_path / "run"), task)
    return task, setup, setup.init_state(jax.random.key_data(jax.random.key(0)))


def _step0_logits(task, setup, state, batch):
    """The fine-tuning model's eval logits from the initial state (what step 0 evaluates), jitted
    as the trainer's evaluation is (one compile, not one per eager op and shape)."""
    apply = jax.jit(lambda params, inputs: setup.model.apply({"params": params}, **inputs))
    out = apply(state.params, task.model_inputs(batch))
    return np.stack(out, -1) if isinstance(out, tuple) else np.asarray(out)


def _torch_logits(model, arch: str, batch):
    def t(key):
        return torch.from_numpy(np.asarray(batch[key])).long()

    kwargs = {"attention_mask": t("input_mask")}
    if arch == "bert":
        kwargs["token_type_ids"] = t("segment_ids")
    with torch.no_grad():
        out = model(t("input_ids"), **kwargs)
    if hasattr(out, "start_logits"):
        return np.stack([out.start_logits.numpy(), out.end_logits.numpy()], -1)
    return out.logits.numpy()


@pytest.mark.parametrize(
    "arch,kind",
    [
        ("modernbert", "sequence"),
        ("modernbert", "token"),
        ("modernbert", "span"),
        ("modernbert", "choice"),
        ("bert", "sequence"),
        ("bert", "token"),
        ("bert", "span"),
        ("bert", "choice"),
        ("eurobert", "sequence"),  # transformers has no EuroBERT QA or multiple-choice class
        ("eurobert", "token"),
        ("nomicbert", "sequence"),  # nor a NomicBERT or GTE one
        ("nomicbert", "token"),
        ("gte", "sequence"),
        ("gte", "token"),
    ],
)
def test_fine_tuning_starts_from_the_checkpoints_task_head(files, tmp_path, caplog, arch, kind):
    labels = {"sequence": 2, "token": NER_LABELS, "span": 2, "choice": 1}[kind]
    model = _write_hf_model(files, tmp_path / "ckpt", arch, TASKS[kind][4], labels)
    with caplog.at_level(logging.INFO, logger="bertjax"):
        task, setup, state = _setup(files, tmp_path, kind, tmp_path / "ckpt")
    lines = [r.getMessage() for r in caplog.records if "task head from" in r.getMessage()]
    assert len(lines) == 1 and "freshly initialised none" in lines[0], lines
    assert not [
        r for r in caplog.records if r.levelno >= logging.WARNING and r.module == "head_init"
    ]
    batch = {k: v[:8] for k, v in task.eval_sets[0].features.items()}
    got = _step0_logits(task, setup, state, batch)
    want = _torch_logits(model, arch, batch)
    if kind in ("token", "span"):  # per-token logits: padding positions are not compared
        real = np.asarray(batch["input_mask"]).astype(bool)
        got, want = got[real], want[real]
    assert got.shape == want.shape
    diff = float(np.max(np.abs(got - want)))
    assert diff <= TOL, f"{arch}/{kind}: max abs difference {diff:.2e}"
    assert float(np.max(np.abs(want))) > 0.1  # O(1) logits: the comparison is not vacuous


def test_a_head_that_does_not_fit_stays_fresh_with_a_warning(files, tmp_path, caplog):
    # Five labels for SST-2's two: the pooler (HF's head) comes along, the classifier is fresh.
    _write_hf_model(files, tmp_path / "ckpt", "modernbert", "ForSequenceClassification", 5)
    with caplog.at_level(logging.INFO, logger="bertjax"):
        _, _, state = _setup(files, tmp_path, "sequence", tmp_path / "ckpt")
    messages = [r.getMessage() for r in caplog.records]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(
        "classifier/kernel has shape (32, 5), the task wants (32, 2)" in m
        and "classifier freshly initialised" in m
        for m in warned
    ), warned
    assert any("taken pooler; freshly initialised classifier" in m for m in messages), messages
    assert state.params["classifier"]["kernel"].shape == (32, 2)

    # A token classifier's head for a sequence task: not taken, said so.
    caplog.clear()
    _write_hf_model(files, tmp_path / "tok", "modernbert", "ForTokenClassification", 2)
    with caplog.at_level(logging.INFO, logger="bertjax"):
        _setup(files, tmp_path, "sequence", tmp_path / "tok")
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("token classifier (ModernBertForTokenClassification) head" in m for m in warned)
    assert any("not taken" in m for m in warned), warned
