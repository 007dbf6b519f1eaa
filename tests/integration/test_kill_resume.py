"""SIGKILL the extraction (a subprocess) at several points; a rerun completes the store bit-identical to a clean run.
The rerun is a new run on the same store: it runs in this process, as the clean run does (the killed process is
gone; what it left is on disk), which spares a second interpreter start-up per test."""

from __future__ import annotations

import pytest

from dflash_pipeline.storage.reader import HiddenStateDataset
from dflash_pipeline.storage.store import Store
from tests.helpers import KILL_OVERRIDES, assert_same_store, extract_local, run_extract_proc, snapshot


@pytest.mark.parametrize(
    ("kill_at", "resume_budget"),
    [("forward:3", None), ("after_shard_write:3", None), ("during_commit:2", None), ("after_shard_write:2", 700)],
)
def test_killed_extraction_resumes_bit_identical(clean_extraction, tmp_path, kill_at, resume_budget):
    """(With writer processes, a GPU worker's default: tests/test_object_store.py.) A resume whose probe plans
    another batch size (extract.token_budget=auto on a GPU with other free memory) batches as the first run did:
    the version recorded its token budget."""
    clean = clean_extraction
    assert clean.plan.n_units >= 2
    killed = run_extract_proc(tmp_path, KILL_OVERRIDES, kill_at)
    assert killed.returncode == -9, killed.stderr[-2000:]
    store = Store(tmp_path / "store")
    version = store.versions()[0]
    committed_before = sum(store.commit_record(version, u)["committed_tokens"] for u in store.units(version))
    if kill_at == "during_commit:2":  # the temp file of the interrupted commit is still there
        assert list((tmp_path / "store").rglob("*.partial"))

    resumed = extract_local(
        tmp_path, {**KILL_OVERRIDES, **({"extract.token_budget": resume_budget} if resume_budget else {})}
    )
    assert resumed.plan.version == version
    if not kill_at.startswith("forward"):  # shards had been committed: resumed from there, not restarted
        assert committed_before > 0 and resumed.result.forward_passes < clean.result.forward_passes
    assert not list((tmp_path / "store").rglob("*.partial"))  # orphans cleaned

    assert_same_store(snapshot(Store(clean.store), clean.plan.version), snapshot(store, version))
    ids = [s.sample_id for s in HiddenStateDataset(tmp_path / "store", version, unvalidated="warn").samples]
    assert len(ids) == len(set(ids)) == 40  # nothing duplicated, nothing missing


def test_killed_compact_extraction_resumes_bit_identical(model_dir, tmp_path):
    """The same for a compact store (fp8 values + float32 scales, quantized in the worker): killed after a
    shard write, resumed, bit-identical to an uninterrupted extraction, scales included."""
    overrides = {**KILL_OVERRIDES, "extract.store_precision": "fp8"}
    clean = extract_local(tmp_path / "clean", overrides)
    killed = run_extract_proc(tmp_path / "killed", overrides, "after_shard_write:3")
    assert killed.returncode == -9, killed.stderr[-2000:]
    resumed = extract_local(tmp_path / "killed", overrides)
    assert 0 < resumed.result.forward_passes < clean.result.forward_passes
    store = Store(tmp_path / "killed" / "store")
    version = store.versions()[0]
    a, b = snapshot(Store(clean.store), clean.plan.version), snapshot(store, version)
    assert_same_store(a, b)
    assert all("hidden_scale" in u and "last_hidden_scale" in u for u in b.values())
