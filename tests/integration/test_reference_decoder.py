"""evaluate.decoder: acceptance by z-lab's own decoder (`dflash` 0.1.0, its model class loading our export as it
ships) against ours on the embedded target, for a trained and an untrained drafter; the setting's report fields,
its reuse, and the error without the package."""

from __future__ import annotations

import sys

import pytest
import torch

from dflash_pipeline.drafter.config import EvalConfig, TrainConfig
from dflash_pipeline.drafter.evaluate import evaluate_export
from dflash_pipeline.drafter.export import export_drafter, spec_of_export
from dflash_pipeline.drafter.model import DFlashDrafter
from dflash_pipeline.drafter.reference_decoder import PIP
from dflash_pipeline.errors import ConfigError

SKIP = "z-lab's dflash 0.1.0 is not installed (pip install --no-deps dflash==0.1.0)"
EVAL = {"num_prompts": 8, "max_new_tokens": 24, "device": "cpu", "baseline": "off"}


TRAIN = {
    "block_size": 6, "num_draft_layers": 1, "batch_size": 4, "epochs": 17, "lr": 5e-3, "warmup_ratio": 0.1,
    "anchors_per_sample": 48, "checkpoint_every": 1000, "num_workers": 0, "device": "cpu",
}  # fmt: skip


@pytest.fixture(scope="module")
def store(model_dir, tmp_path_factory):
    """A validated store of the embedded target: 24 samples, layers [1, 3, 5]."""
    from tests.helpers import extract_local

    root = tmp_path_factory.mktemp("reference_decoder")
    over = {"data.max_samples": 24, "layers.preset": "explicit", "layers.ids": [1, 3, 5]}
    over["validate.recompute_samples"] = 1
    return extract_local(root, over, validate=True)


def _train(store, out, **settings) -> str:
    from dflash_pipeline.drafter.train import train

    return train(TrainConfig(**{**TRAIN, **settings}), store.store, store.report, out).export_dir


@pytest.fixture(scope="module")
def trained(store, tmp_path_factory):
    """A tiny drafter (1 layer, block 6) trained for 102 steps."""
    return {"export": _train(store, tmp_path_factory.mktemp("drafter")), "report": store.report}


def _agree(rep) -> None:
    assert rep.reference_acceptance_length is not None and rep.decoder == "both"
    print(
        f"acceptance length: ours {rep.acceptance_length:.4f}, reference {rep.reference_acceptance_length:.4f} "
        f"(ratio {rep.decoder_agreement:.4f}; {rep.num_prompts} prompts, {rep.verify_steps} steps)"
    )
    assert abs(rep.decoder_agreement - 1) <= 0.02
    assert len(rep.reference_position_accept_rate) == rep.block_size - 1


def test_trained_drafter_ours_and_reference_agree(trained):
    pytest.importorskip("dflash.model", reason=SKIP)
    rep = evaluate_export(trained["export"], trained["report"], EvalConfig(decoder="both", **EVAL))
    _agree(rep)
    assert rep.acceptance_length > 1.1  # a drafter that drafts: accepted tokens beside the bonus, not only ~1
    # on this target and these prompts the two decoders agree step for step (KV caches vs recomputing: float
    # rounding could flip a near-tie argmax; it does not here)
    assert [p["produced"] for p in rep.per_prompt] == [p["produced"] for p in rep.reference_per_prompt]
    md = rep.to_markdown()
    assert "z-lab's reference decoder" in md and f"{rep.reference_acceptance_length:.3f}" in md

    again = evaluate_export(trained["export"], trained["report"], EvalConfig(decoder="both", **EVAL))
    assert again.reused and again.target_forwards == 0
    assert again.reference_acceptance_length == rep.reference_acceptance_length

    only = evaluate_export(trained["export"], trained["report"], EvalConfig(decoder="reference", **EVAL))
    assert only.decoder == "reference" and not only.reused and only.target_forwards > 0
    assert only.acceptance_length == rep.reference_acceptance_length and only.reference_acceptance_length is None
    assert "by z-lab's reference decoder" in only.reuse_line()


def test_sliding_window_drafter_ours_and_reference_agree(store, tmp_path):
    """A drafter whose layer is a sliding-window one (window 3 < block 6: causal inside the block, as z-lab's
    layer_types mean it): the two decoders read the export's layer_types and window alike."""
    pytest.importorskip("dflash.model", reason=SKIP)
    export = _train(store, tmp_path / "drafter", sliding_window=3, epochs=12)
    rep = evaluate_export(export, store.report, EvalConfig(decoder="both", **EVAL))
    _agree(rep)
    assert rep.acceptance_length > 1.1


def test_untrained_drafter_ours_and_reference_agree(trained, tmp_path):
    pytest.importorskip("dflash.model", reason=SKIP)
    torch.manual_seed(0)
    export = export_drafter(DFlashDrafter(spec_of_export(trained["export"])), tmp_path / "export", dtype=torch.float32)
    cfg = EvalConfig(decoder="both", **{**EVAL, "max_new_tokens": 12})
    _agree(evaluate_export(str(export), trained["report"], cfg))


def test_reference_without_the_package(trained, monkeypatch):
    monkeypatch.setitem(sys.modules, "dflash.model", None)  # `import dflash.model` raises ImportError
    with pytest.raises(ConfigError, match=f"evaluate.decoder .*`{PIP}`"):
        evaluate_export(trained["export"], trained["report"], EvalConfig(decoder="reference", **EVAL))
    ours = evaluate_export(trained["export"], trained["report"], EvalConfig(**EVAL))  # ours needs no package
    assert ours.decoder == "ours" and ours.reference_acceptance_length is None


def test_a_run_that_asks_for_the_reference_decoder_without_the_package_stops_before_any_work(
    monkeypatch, tmp_path, capsys
):
    """The user's path: `dflash-pipeline run --set evaluate.decoder=reference` without `dflash` is one error line
    from the pre-flight check (exit 2), before Prefect starts or anything is extracted or trained."""
    from dflash_pipeline.cli import main

    monkeypatch.setitem(sys.modules, "dflash.model", None)
    rc = main(["run", "--set", f"output_dir={tmp_path}", "--set", "evaluate.decoder=reference"])
    err = capsys.readouterr().err
    assert rc == 2 and f"`{PIP}`" in err and "Traceback" not in err, err
    assert not any(tmp_path.iterdir())  # nothing prepared, extracted or trained
