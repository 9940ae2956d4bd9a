"""The BERT paper's feature-based approach (Section 5.3, Table 7) through the one trainer.

``train.freeze_encoder=True`` trains the head alone: the encoder's parameters (its pooler excepted)
stay bitwise as loaded, the optimizer state holds none of them and the encoder runs without
dropout. ``head.features`` reads a combination of layers (``sum_last4``, ``concat_last4``,
``scalar_mix``) and ``head.bilstm`` puts a two-layer BiLSTM under the NER classifier. A frozen run
with ``features=last`` is a run as any other (test_round_trips.py's ``frozen_glue`` run takes it
through every consumer); a feature-based head loads as its encoder alone (RUN and RUN/best) and
refuses a transformers export in one line. Tiny models (H32), 2-3 steps.
"""

from __future__ import annotations

import pathlib

import flax.linen as nn
import jax
import numpy as np
import pytest
from helpers import opt_state_paths, random_bert_hf_dir, small_config

import bertjax
from bertjax import convert, flops, sharding, train
from bertjax.convert.checkpoint import flatten_params
from bertjax.data import packing
from bertjax.models.heads import SequenceClassifier
from configs import glue as glue_config
from configs import ner as ner_config
from configs import retrieval as retrieval_config
from configs import squad as squad_config


def _frozen(config, files, data_dir, **overrides):
    return small_config(
        config.get_config(), files, data_dir, **{"train.freeze_encoder": True, **overrides}
    )


def _steps(c, workdir, steps: int):
    """The task, its setup, the params it starts from (host copies) and after ``steps`` steps."""
    task = train.prepared_task(c, workdir)
    setup = train.build(c, workdir, task)
    state = setup.init_state(jax.random.key_data(jax.random.key(0)))
    before = jax.device_get(state.params)
    step = train.jit_train_step(setup, 1)
    data = task.train_data(setup.phases[0], 0, 1)
    losses = []
    with jax.set_mesh(setup.mesh), nn.logical_axis_rules(setup.rules):
        for _ in range(steps):
            batch = sharding.global_batch(next(data), setup.mesh, setup.rules)
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
    assert all(np.isfinite(losses))
    return task, setup, before, jax.device_get(state)


def _changed(a, b) -> set[str]:
    fa, fb = flatten_params(a), flatten_params(b)
    assert fa.keys() == fb.keys()
    return {k for k in fa if not np.array_equal(fa[k], fb[k])}


def _bert(**fields):
    from bertjax.models import bert

    return bert.BertConfig(
        vocab_size=40, hidden_size=32, num_heads=2, intermediate_size=64, **fields
    )


IDS = np.arange(16, dtype=np.int32).reshape(2, 8) % 40


def test_a_frozen_encoder_runs_without_dropout():
    """Training mode (deterministic=False) drops units in the encoder unless it is frozen."""
    config = _bert(num_layers=1, hidden_dropout=0.5, attention_dropout=0.5)
    for frozen in (False, True):
        model = SequenceClassifier(config, num_labels=2, frozen_encoder=frozen)
        params = jax.jit(lambda key, model=model: model.init(key, IDS)["params"])(jax.random.key(0))

        @jax.jit
        def encoded(seed, model=model, params=params):
            _, inter = model.apply(
                {"params": params},
                IDS,
                deterministic=False,
                rngs={"dropout": jax.random.key(seed)},
                capture_intermediates=lambda m, _: m.name == "bert",
            )
            return inter["intermediates"]["bert"]["__call__"][0].sequence_output

        assert np.array_equal(encoded(1), encoded(2)) == frozen


@pytest.mark.parametrize(
    ("features", "pooling"), [("sum_last4", "cls"), ("concat_last4", "mean"), ("scalar_mix", "cls")]
)
def test_each_feature_combination_reads_its_layers_packed_or_not(features, pooling):
    """The classifier reads [CLS] of the combination (the sum or the concatenation of the last
    four hidden states, the scalar mix of all five) or its mean over the example's tokens, without
    pooler, and every head parameter gets a gradient. Three examples packed into one row (packed
    evaluation and batch packing are on by default) give their unpacked logits."""
    lengths = np.array([5, 3, 6])
    mask = (np.arange(16)[None, :] < lengths[:, None]).astype(np.int32)  # [3, 16]
    ids = np.where(mask > 0, np.arange(48).reshape(3, 16) % 37 + 3, 0).astype(np.int32)
    model = SequenceClassifier(
        _bert(num_layers=4, max_position_embeddings=16),
        num_labels=2,
        features=features,
        pooling=pooling,
    )
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(0), ids, None, mask)["params"])
    assert "pooler" not in params["bert"]
    width = 4 * 32 if features == "concat_last4" else 32
    assert params["classifier"]["kernel"].shape == (width, 2)
    head = {k: v for k, v in params.items() if k != "bert"}
    assert set(head) == (
        {"classifier", "scalar_mix"} if features == "scalar_mix" else {"classifier"}
    )

    @jax.jit
    def unpacked(head):
        def logits(head):
            out = model.apply({"params": {**params, **head}}, ids, np.zeros_like(ids), mask)
            return out.sum(), out

        return jax.grad(logits, has_aux=True)(head)

    grads, want = unpacked(head)  # [3, 2]
    assert all(np.abs(g).sum() > 0 for g in jax.tree.leaves(grads))
    packed, _ = packing.pack_features(
        {"input_ids": ids, "segment_ids": np.zeros_like(ids), "input_mask": mask}, 4
    )
    assert packed["input_ids"].shape[0] == 1  # one row of 14 tokens
    logits = jax.jit(model.apply)(
        {"params": params},
        packed["input_ids"],
        packed["segment_ids"],
        packed["input_mask"],
        position_ids=packed["position_ids"],
        pack_ids=packed["pack_ids"],
        cls_positions=packed["cls_positions"],
    )  # [1, 4, 2]: three examples and an empty slot
    np.testing.assert_allclose(logits[0, :3], want, rtol=1e-5, atol=1e-5)


def test_a_scalar_mix_head_learns_its_layer_weights_on_a_frozen_encoder(files, tmp_path):
    """GLUE with the scalar mix of 4 layers on a frozen encoder (training batches packed: each
    example's [CLS]): the head alone moves, its softmax weights and gamma included."""
    c = _frozen(
        glue_config,
        files,
        "glue",
        **{
            "head.features": "scalar_mix",
            "model.num_layers": 4,
            "optimizer.warmup_proportion": 0.0,
        },
    )
    task, setup, before, after = _steps(c, str(tmp_path), 2)
    assert setup.model.features == "scalar_mix" and setup.model.frozen_encoder
    assert task.batch_packing
    head = {"classifier/kernel", "classifier/bias", "scalar_mix/weights", "scalar_mix/gamma"}
    np.testing.assert_array_equal(before["scalar_mix"]["weights"], np.zeros(5))  # 4 layers + 1
    assert _changed(before, after.params) == head
    assert opt_state_paths(after.opt_state) == {tuple(k.split("/")) for k in head}
    phase, config = setup.phases[0], setup.model.config  # the encoder's forward pass alone
    full = flops.train_flops_per_step(config, phase.global_batch_size, 32, 0)
    assert task.flops_per_step(config, phase) == pytest.approx(full / 3)


def test_the_paper_ner_setup_bilstm_on_concat_last4_trains_and_loads_as_its_encoder(
    files, tmp_path, caplog
):
    """CoNLL NER as Table 7: a two-layer BiLSTM on the concatenated last four layers of a frozen
    encoder. It trains (rows unpacked), evaluates, and its checkpoint loads as the encoder alone
    (embeddings work) while an export to transformers is refused in one line."""
    init = random_bert_hf_dir(files, tmp_path / "init")
    c = _frozen(
        ner_config,
        files,
        "ner",
        init_checkpoint=str(tmp_path / "init"),
        **{"head.features": "concat_last4", "head.bilstm": True, "train.steps": 2},
    )
    run = tmp_path / "run"
    task, setup, before, after = _steps(c, str(tmp_path / "steps"), 2)
    assert not (task.batch_packing or task.eval_packing)
    moved = _changed(before, after.params)
    assert {k.split("/")[0] for k in moved} == {"bilstm", "classifier"}
    assert "bilstm/forward_1/hi/kernel" in moved and "bilstm/backward_0/ii/kernel" in moved
    assert after.params["bilstm"]["forward_0"]["ii"]["kernel"].shape == (4 * 32, 32)
    result = train.train_and_evaluate(c, str(run))
    assert 0.0 <= result["final"]["dev"]["f1"] <= 1.0
    loaded = bertjax.load_pretrained(str(run))
    assert "feature-based task head (head.features=concat_last4) is not run here" in caplog.text
    got = flatten_params(jax.device_get(loaded.params))
    assert got.keys() == {k for k in init if "/pooler/" not in k}  # NER has no pooler
    assert all(np.array_equal(got[k], init[k]) for k in got)
    assert loaded.embed(["john smith"]).shape == (1, 32)
    best = bertjax.load_pretrained(str(run / "best"))  # the kept step's encoder, as RUN's
    assert flatten_params(jax.device_get(best.params)).keys() == got.keys()
    np.testing.assert_allclose(best.embed(["john smith"]), loaded.embed(["john smith"]))
    for folder in (run, run / "best"):
        with pytest.raises(ValueError) as err:
            convert.main([str(folder), "--to=hf", str(tmp_path / "hf")])
        assert "its task head is feature-based (head.features=concat_last4), which no hf" in str(
            err.value
        )
        assert "\n" not in str(err.value) and not (tmp_path / "hf").exists()
    convert.main([str(run), "--to=sentence-transformers", str(tmp_path / "st")])  # the encoder
    exported = bertjax.load_pretrained(str(tmp_path / "st"))
    np.testing.assert_allclose(exported.embed(["john smith"]), loaded.embed(["john smith"]))


@pytest.mark.parametrize(
    ("config", "data_dir", "overrides", "error"),
    [
        (
            squad_config,
            "squad",
            {"head.features": "concat_last4"},
            "^config key head.features=concat_last4: the head of task squad/v1.1 reads the "
            "last layer only",
        ),
        (glue_config, "glue", {"head.bilstm": True}, "^config key head.bilstm=True: task "),
        (
            retrieval_config,
            "",
            {"train.freeze_encoder": True},
            "^config key train.freeze_encoder=True: task retrieval cannot freeze its encoder",
        ),
        (glue_config, "glue", {"head.features": "last8"}, "^config key head.features='last8': "),
        (
            glue_config,
            "glue",
            {"head.features": "sum_last4"},  # small_config's model has 1 layer
            r"^config key head.features=sum_last4: the encoder has 1 layers \(needs 4\)",
        ),
        (
            glue_config,
            "glue",
            {"head.features": "scalar_mix", "model.scan_layers": True},
            "^config key head.features=scalar_mix reads every layer's hidden states: set "
            "model.scan_layers=False",
        ),
        (
            ner_config,
            "ner",
            {"head.features": "concat_last4", "head.pooling": "mean"},
            "^config key head.pooling=mean: the head of task ner/conll2003 does not pool",
        ),
        (
            glue_config,
            "glue",
            {"head.pooling": "mean"},
            "^config key head.pooling=mean pools a layer combination: with head.features=last",
        ),
        (glue_config, "glue", {"head.pooling": "max"}, "^config key head.pooling='max': choose"),
        (
            ner_config,
            "ner",
            {"head.bilstm": True, "data.packing": True},
            r"^config key data.packing=True: task ner/conll2003 cannot be packed \(a BiLSTM",
        ),
    ],
)
def test_a_head_option_the_run_cannot_use_is_a_one_line_error(
    files, tmp_path, config, data_dir, overrides, error
):
    c = small_config(config.get_config(), files, data_dir, **overrides)
    with pytest.raises(ValueError, match=error) as err:
        train.prepared_task(c, str(tmp_path / "run"))
    assert "\n" not in str(err.value)
    assert not pathlib.Path(tmp_path / "run").exists()
