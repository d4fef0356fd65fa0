"""Grid specs, run order, the time estimate behind --time-budget, the choice of the best learning rate, and the
settings check of a resumed grid."""

from dataclasses import asdict

import pytest

from hybrid_attention.synth.models import model_config
from hybrid_attention.synth.run import (
    RunSpec,
    Settings,
    best_by_lr,
    check_settings,
    estimate_seconds,
    grid_runs,
    parse_grid,
)


def test_grid_order_is_length_task_lr_model_and_cells_keep_their_steps():
    runs = grid_runs("mqar,stack/512,1024/kda,mla;palindrome/256/gdn/50", [1e-3, 3e-3], steps=7)
    assert runs[:4] == [RunSpec("mqar", 512, m, lr, 7) for lr in (1e-3, 3e-3) for m in ("kda", "mla")]
    assert runs[4].task == "stack" and runs[8].seq_len == 1024
    assert runs[-1] == RunSpec("palindrome", 256, "gdn", 3e-3, 50) and len(runs) == 18
    assert len(grid_runs("mqar/64/kda;mqar/64/kda", [1e-3], steps=5)) == 1  # a run named twice runs once


@pytest.mark.parametrize(
    "spec, message",
    [("mqar/512", "TASKS/LENGTHS/MODELS"), ("copy/512/kda", "unknown task 'copy'"), ("mqar/5/kda", ">= 8"),
     ("mqar/x/kda", "integers"), (" ; ", "names no cell")],
)  # fmt: skip
def test_bad_grid_specs_name_the_problem(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_grid(spec, steps=10)


def test_estimate_prefers_the_same_model_and_length_then_scales_by_tokens():
    spec = RunSpec("mqar", 1024, "kda", 1e-3, 100)
    assert estimate_seconds(spec, [], 64) is None
    other = {"model": "mla", "seq_len": 512, "batch_size": 64, "s_per_step": 0.01}
    assert estimate_seconds(spec, [other], 64) == pytest.approx(100 * 0.01 * 2)
    same = {"model": "kda", "seq_len": 1024, "batch_size": 64, "s_per_step": 0.05}
    assert estimate_seconds(spec, [other, same], 64) == pytest.approx(5.0)


def test_best_learning_rate_by_accuracy_then_loss():
    row = dict(task="mqar", seq_len=64, model="kda", steps=10, final=1)
    results = [(1e-3, 0.5, 1.0), (3e-3, 0.9, 0.5), (1e-2, 0.9, 0.4), (3e-2, 0.0, None)]  # the last diverged
    rows = [{**row, "lr": lr, "accuracy": accuracy, "loss": loss} for lr, accuracy, loss in results]
    assert best_by_lr(rows)[("mqar", 64, "kda")]["lr"] == 1e-2


def test_models_differ_only_where_they_should():
    kda, gdn, mla = (model_config(m, 100) for m in ("kda", "gdn", "mla"))
    assert kda.layer_types == gdn.layer_types == ("kda", "kda") and mla.layer_types == ("mla", "mla")
    assert (kda.kda_gate, gdn.kda_gate) == ("bounded", "head")
    assert kda.hidden_size == 256 and kda.kda_num_heads == mla.mla_num_heads == 2 and kda.kda_head_dim == 128
    assert kda.residual == "standard"
    with pytest.raises(ValueError, match="unknown synthetic model"):
        model_config("mamba", 100)


def test_resumed_rows_must_share_the_settings_and_a_setting_they_predate_had_its_default(tmp_path):
    settings = Settings(mqar_queries=3)
    stored = asdict(settings)
    check_settings([{"settings": stored}], settings, tmp_path)  # the same: accepted
    older = {k: v for k, v in stored.items() if k != "mqar_pairs"}  # a log written before the setting existed
    check_settings([{"settings": older}], settings, tmp_path)
    with pytest.raises(ValueError, match=r"other settings \(mqar_pairs\)"):
        check_settings([{"settings": older}], Settings(mqar_queries=3, mqar_pairs=8), tmp_path)
    with pytest.raises(ValueError, match=r"other settings \(mqar_queries, seed\)"):
        check_settings([{"settings": stored}], Settings(seed=1), tmp_path)
