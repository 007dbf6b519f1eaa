"""The drafter export is servable as documented: readable by others (umask respected), and
`AutoModel.from_pretrained(export, trust_remote_code=True)` gives a DFlashDraftModel (the modeling file shipped
in the export) that computes what the training code's drafter computes."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch

from dflash_pipeline.drafter.export import export_drafter
from dflash_pipeline.drafter.model import FULL, SLIDING, DFlashDrafter
from tests.integration.test_drafter_model import _randomize, _spec


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


@pytest.mark.parametrize(("types", "window"), [(None, None), ([FULL, SLIDING], 4)])
def test_export_loads_with_automodel_and_matches(tmp_path, umask_022, types, window):
    from transformers import AutoModel

    model = DFlashDrafter(_spec(types, window)).eval()
    _randomize(model)
    out = export_drafter(model, tmp_path / "export", {"note": "test"}, dtype=torch.float32)

    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    for f in out.iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, f
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"}
    assert (out / "modeling_dflash.py").exists()

    loaded = AutoModel.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32).eval()
    assert type(loaded).__name__ == "DFlashDraftModel"
    assert type(loaded).__module__.endswith("modeling_dflash")  # the export's own file, not this package
    g = torch.Generator().manual_seed(3)
    s_len, bs = 9, 6
    ctx = torch.randn(1, s_len, 3 * 32, generator=g)
    emb = torch.randn(1, bs, 32, generator=g)
    anchors = torch.tensor([[s_len]])  # one block right after the whole context
    pos = torch.arange(s_len + bs)[None]
    with torch.no_grad():
        want = model(ctx, emb, pos[:, :s_len], pos[:, s_len:], model.block_masks(anchors, None, s_len))
        got = loaded(target_hidden=ctx, noise_embedding=emb, position_ids=pos)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_checkpoint_directory_has_a_plain_directorys_mode(tmp_path, umask_022):
    """Written under a temporary name (mkdtemp: 0700) and renamed: a fresh-user check found checkpoints private to
    their owner, where a plain mkdir gives 0777 less the umask."""
    from dflash_pipeline.drafter.checkpoint import save_checkpoint

    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    path = save_checkpoint(tmp_path, 1, model, opt, sched, {}, keep=2)
    assert stat.S_IMODE(path.stat().st_mode) == 0o755
