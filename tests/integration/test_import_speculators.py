"""import-drafter: a DFlash drafter trained by vLLM's speculators 0.9.0 in our export format. A speculators model with
random weights, built by their own model class over the embedded target's shape and saved by their own checkpointer,
converts; our drafter's forward then equals theirs (their training forward, on the same context features and
blocks); our evaluator (and z-lab's decoder, when installed) scores it; bad checkpoints are refused by name. Then
speculators' own trainer, on CPU, from our export-states of a validated store, and its result converted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_pipeline.drafter.config import EvalConfig
from dflash_pipeline.drafter.export import load_drafter
from dflash_pipeline.drafter.import_speculators import import_speculators

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
SKIP = (
    "speculators 0.9.0 is not installed (docs/INTEROP.md: pip install --no-deps speculators==0.9.0 "
    "hs-connectors==0.9.0, and the reference extra)"
)
REPO = Path(__file__).resolve().parents[2]
AUX = [2, 4, 6]  # speculators' numbering of our layers [1, 3, 5]
BLOCK = 4


@pytest.fixture(scope="module")
def store(model_dir, tmp_path_factory):
    """A validated store of the embedded target: 16 samples, layers [1, 3, 5] + the last hidden state."""
    from tests.helpers import extract_local

    over = {"data.max_samples": 16, "layers.preset": "explicit", "layers.ids": [1, 3, 5], "layers.capture_last": True}
    return extract_local(tmp_path_factory.mktemp("import_speculators"), over, validate=True)


def _their_model(model_dir: str, seed: int = 0, sliding_layers=(0,), window: int = 2048, **kw):
    """speculators' DFlashDraftModel as its trainer builds it (create_transformer_layer_config + from_training_args),
    2 draft layers (layer 0 sliding-window, causal in the block; layer 1 full), random weights and norm gains."""
    pytest.importorskip("speculators.models.dflash", reason=SKIP)
    pytest.importorskip("speculators.utils.loading", reason=SKIP)  # it imports loguru (the reference extra)
    from speculators.models.dflash import DFlashDraftModel
    from speculators.train.cli import create_transformer_layer_config

    tl = create_transformer_layer_config(
        model_dir,
        num_layers=2,
        draft_arch="qwen3",
        hidden_act="silu",
        sliding_window=window,
        full_attention_indices=[i for i in range(2) if i not in sliding_layers],
    )
    args = {"block_size": BLOCK, "mask_token_id": 5, "draft_vocab_size": tl.vocab_size, "draft_attn_impl": "sdpa"}
    torch.manual_seed(seed)
    model = DFlashDraftModel.from_training_args(
        tl, verifier_name_or_path=model_dir, target_layer_ids=AUX, **{**args, **kw}
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad and name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)  # gains that differ per channel: a misplaced norm would show
            elif p.requires_grad:
                p.normal_(0.0, 0.08)
    return model


def _save_as_their_trainer(model, root: Path) -> Path:
    """speculators' SingleGPUCheckpointer.save_checkpoint, epoch 0 (bf16, as its trainer saves by default)."""
    from speculators.train.checkpointer import SingleGPUCheckpointer

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    SingleGPUCheckpointer(root).save_checkpoint(model, opt, 0)
    return root / "0"


def test_forward_equals_speculators(model_dir, store, tmp_path, monkeypatch):
    import speculators.models.dflash.core as their_core
    from safetensors.torch import load_file

    from dflash_pipeline.storage.reader import HiddenStateDataset

    theirs = _their_model(model_dir)
    ckpt = _save_as_their_trainer(theirs, tmp_path / "ckpt")
    saved = load_file(str(ckpt / "model.safetensors"))
    assert "embed_tokens.weight" not in saved and "lm_head.weight" not in saved and "fc.weight" in saved
    theirs.load_state_dict(saved, strict=False)  # the reference: the bf16 weights as saved, computed in float32
    theirs = theirs.float().eval()

    out = import_speculators(tmp_path / "ckpt", tmp_path / "export", target=model_dir)  # the save path: epoch 0
    ours = load_drafter(out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dflash_config"] == {"target_layer_ids": [1, 3, 5], "mask_token_id": 5, "block_size": BLOCK}
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"] and cfg["sliding_window"] == 2048
    assert cfg["num_target_layers"] == 8 and cfg["dtype"] == "bfloat16"
    meta = json.loads((out / "dflash_meta.json").read_text())["imported_from"]
    assert meta["format"] == "speculators" and meta["aux_hidden_state_layer_ids"] == AUX

    worst = 0.0
    with HiddenStateDataset(store.cfg.store) as ds:
        for i in range(3):
            item = ds[i]
            t = item["input_ids"].shape[0]
            hidden = item["hidden"].float().flatten(1)[None]  # [1, T, K*H]: the layers in the store's order
            ids = item["input_ids"][None]
            gen = torch.Generator().manual_seed(i)
            n = min(6, t - BLOCK - 1)
            anchors = torch.sort(torch.randperm(t - BLOCK - 1, generator=gen)[:n] + 1).values
            # their training forward with these anchors (select_anchors draws them at random)
            fixed = (anchors, torch.ones(n, dtype=torch.bool))
            monkeypatch.setattr(their_core, "select_anchors", lambda *_a, _fixed=fixed, **_k: _fixed)
            with torch.no_grad():
                want = theirs._backbone_forward(
                    hidden,
                    ids,
                    torch.ones_like(ids),
                    item["last_hidden"].float()[None],
                    torch.zeros_like(ids),
                    max_anchors=n,
                )[0]
                block_ids = torch.full((1, n * BLOCK), 5)
                block_ids[0, ::BLOCK] = ids[0, anchors]
                embeds = theirs.embed_tokens(block_ids)  # the target's embedding (loaded from it by their class)
                block_pos = (anchors[:, None] + torch.arange(BLOCK)).reshape(1, -1)
                masks = ours.block_masks(anchors[None], None, t)
                got = ours(hidden, embeds, torch.arange(t)[None], block_pos, masks)
            assert got.shape == want.shape == (1, n * BLOCK, 64)
            assert torch.isfinite(want).all() and want.std() > 0.1  # a real output, not NaN or a constant
            worst = max(worst, float((got - want).abs().max()))
    print(f"max abs difference, our forward vs speculators' (float32, 3 samples): {worst:.3g}")
    assert worst < 1e-4


def test_our_evaluator_scores_it(model_dir, store, tmp_path):
    theirs = _their_model(model_dir, seed=1)
    out = import_speculators(_save_as_their_trainer(theirs, tmp_path / "ckpt"), tmp_path / "export", target=model_dir)
    from dflash_pipeline.drafter.evaluate import evaluate_export

    try:
        import dflash.model  # noqa: F401

        decoder = "both"
    except ImportError:
        decoder = "ours"
    cfg = EvalConfig(num_prompts=2, max_new_tokens=8, device="cpu", baseline="off", decoder=decoder)
    rep = evaluate_export(str(out), store.report, cfg)
    assert rep.block_size == BLOCK and rep.acceptance_length >= 1.0 and rep.verify_steps > 0
    if decoder == "both":
        assert rep.reference_acceptance_length is not None


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"sample_from_anchor": True}, "sample_from_anchor=true"),
        ({"draft_vocab_size": 100}, "reduced draft vocabulary"),
        ({"sliding_window_non_causal": True}, "sliding_window_non_causal=true"),
        ({"mask_token_id": None}, "mask_token_id is null"),
        ({"aux_hidden_state_layer_ids": [0, 4, 6]}, r"aux_hidden_state_layer_ids=\[0, 4, 6\]"),
        ({"speculators_model_type": "dspark"}, "speculators_model_type='dspark'"),
    ],
)
def test_refusals_name_the_file_and_key(model_dir, tmp_path, change, message):
    ckpt = _save_as_their_trainer(_their_model(model_dir), tmp_path / "ckpt")
    cfg = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(ValueError, match=message) as e:
        import_speculators(ckpt, tmp_path / "export", target=model_dir)
    assert str(ckpt / "config.json") in str(e.value)
    assert not (tmp_path / "export").exists()


def test_refusals_of_weights_and_paths(model_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    with pytest.raises(ValueError, match="neither config.json nor numbered epoch"):
        import_speculators(tmp_path, tmp_path / "export", target=model_dir)
    from dflash_pipeline.cli import main

    assert main(["import-drafter", str(tmp_path), str(tmp_path / "export"), "--target", model_dir]) == 2
    ckpt = _save_as_their_trainer(_their_model(model_dir), tmp_path / "ckpt")
    weights = load_file(str(ckpt / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if k != "fc.weight"}, str(ckpt / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.safetensors: weights missing \['fc.weight'\]"):
        import_speculators(ckpt, tmp_path / "export", target=model_dir)
    save_file({**weights, "lm_head.weight": torch.zeros(3, 64)}, str(ckpt / "model.safetensors"))
    with pytest.raises(ValueError, match="'lm_head.weight': a reduced draft vocabulary"):
        import_speculators(ckpt, tmp_path / "export", target=model_dir)
    other = tmp_path / "other_target"
    other.mkdir()
    (other / "config.json").write_text(
        json.dumps({"hidden_size": 128, "num_hidden_layers": 8, "num_attention_heads": 4, "vocab_size": 955})
    )
    with pytest.raises(ValueError, match="hidden_size 64 .* the target's is 128"):
        import_speculators(ckpt, tmp_path / "export", target=other)
    (other / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="config.json does not give num_hidden_layers"):
        import_speculators(ckpt, tmp_path / "export", target=other)


def test_the_export_never_replaces_the_checkpoint_the_target_or_another_directory(model_dir, tmp_path):
    """The export replaces its directory whole: naming the checkpoint, its --save-path, the target or any directory
    that is not an earlier export is refused before anything is written, and every file there stays."""
    from dflash_pipeline.cli import main

    ckpt = _save_as_their_trainer(_their_model(model_dir), tmp_path / "ckpt")
    before = sorted(p for p in tmp_path.rglob("*"))
    for out in (ckpt, ckpt.parent, Path(model_dir), tmp_path):
        with pytest.raises(ValueError, match="give a new directory"):
            import_speculators(ckpt, out, target=model_dir)
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "keep.txt").write_text("mine")
    assert main(["import-drafter", str(ckpt), str(notes), "--target", model_dir]) == 2
    assert (notes / "keep.txt").read_text() == "mine"
    assert sorted(p for p in tmp_path.rglob("*") if notes not in p.parents and p != notes) == before
    first = import_speculators(ckpt, tmp_path / "export", target=model_dir)
    assert import_speculators(ckpt, first, target=model_dir) == first  # an earlier export is replaced


def test_speculators_trainer_on_cpu_from_our_export(model_dir, store, tmp_path):
    """speculators' own trainer (`speculators train`, its DFlash defaults but for a shape this small) on CPU, fed by
    export-states, through bench/realtext/speculators_run.py's `trainer` (two CPU patches: docs/INTEROP.md), then
    converted and loaded."""
    pytest.importorskip("speculators.train.cli", reason=SKIP)
    from dflash_pipeline.storage.export_states import export_states

    export = tmp_path / "spec-export"
    export_states(store.cfg.store, export)
    save = tmp_path / "run"
    cmd = [sys.executable, str(REPO / "bench/realtext/speculators_run.py"), "trainer"]
    cmd += ["--speculator-type", "dflash", "--verifier-name-or-path", model_dir, "--data-path", str(export)]
    cmd += ["--hidden-states-backend", "file", "--on-missing", "raise", "--target-layer-ids", *map(str, AUX)]
    cmd += ["--save-path", str(save), "--log-dir", str(tmp_path / "logs"), "--epochs", "1", "--num-layers", "1"]
    cmd += ["--block-size", str(BLOCK), "--total-seq-len", "512", "--max-anchors", "16"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (save / "0" / "model.safetensors").is_file()
    from dflash_pipeline.cli import main

    out = tmp_path / "export"
    assert main(["import-drafter", str(save), str(out), "--epoch", "checkpoint_best"]) == 0  # target: as recorded
    drafter = load_drafter(out)
    assert drafter.spec.target_layer_ids == [1, 3, 5] and drafter.spec.block_size == BLOCK
    assert drafter.spec.layer_types == ["sliding_attention"] and drafter.spec.sliding_window == 2048  # its defaults
    assert "speculators: 0.9.0" in json.loads((out / "dflash_meta.json").read_text())["imported_from"]["train_command"]
