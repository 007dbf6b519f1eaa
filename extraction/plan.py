"""Driver-side extraction planning: store version, provenance, units, and their assignment to devices."""

from __future__ import annotations

import heapq
import importlib.metadata as md
import json
import logging
from dataclasses import replace
from pathlib import Path
from typing import Any

from dflash_pipeline.config import RunConfig
from dflash_pipeline.dataprep.prepare import PrepareResult, find_samples, load_prepared
from dflash_pipeline.errors import StoreError
from dflash_pipeline.extraction.modelfiles import config_hash, weights_fingerprint
from dflash_pipeline.extraction.probe import ProbeReport
from dflash_pipeline.storage import quant
from dflash_pipeline.storage.layout import FORMAT_VERSION, LAYER_CONVENTION
from dflash_pipeline.storage.planning import plan_units
from dflash_pipeline.storage.store import PlanResult, Store, UnitInfo

log = logging.getLogger(__name__)


def store_dtype(cfg: RunConfig, report: ProbeReport) -> str:
    return report.compute_dtype if cfg.extract.store_dtype == "auto" else cfg.extract.store_dtype


def _version(pkg: str) -> str | None:
    try:
        return md.version(pkg)
    except md.PackageNotFoundError:
        return None


def _git_revision() -> str | None:
    """The checkout's commit (with '+dirty' for uncommitted changes) when running from a git checkout."""
    import subprocess
    from pathlib import Path

    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        if sha.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=here, capture_output=True, text=True, timeout=10)
        return sha.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def target_identity(cfg: RunConfig, report: ProbeReport, logical_dtype: str) -> dict[str, Any]:
    """The keys that decide whether stored states belong together: format, target, layers, dtype, precision."""
    return {
        "format_version": FORMAT_VERSION,
        "model_path": report.model_path,
        "model_type": report.model_type,
        "model_config_hash": config_hash(report.model_path),
        "weights_fingerprint": weights_fingerprint(report.model_path),
        "num_layers": report.num_layers,
        "hidden_size": report.hidden_size,
        "layer_types": report.layer_types,
        "layer_ids": report.layer_ids,
        "layer_convention": LAYER_CONVENTION,
        "capture_last": report.capture_last,
        "logical_dtype": logical_dtype,
        **quant.precision_attrs(cfg.extract.store_precision),  # precision (int8: and its layout)
        "compute_dtype": report.compute_dtype,
        # a quantized target: its format and how it ran (only then, so unquantized stores keep their identity)
        **({"target_quantization": report.quantization} if report.quantization else {}),
    }


def provenance(cfg: RunConfig, report: ProbeReport, tokenizer_fp: str, template_fp: str) -> dict[str, Any]:
    return {
        **target_identity(cfg, report, store_dtype(cfg, report)),
        "tokenizer_fingerprint": tokenizer_fp,
        "template_fingerprint": template_fp,
        "libraries": {
            p: _version(p)
            for p in (
                "dflash-pipeline",
                "torch",
                "transformers",
                "zarr",
                "numcodecs",
                "prefect",
                "flash-linear-attention",
                "fla-core",
            )
        },
        # the forward of the run that creates the version, as the probe resolved run_config's 'auto' settings
        "forward": {
            "gdn_forward": report.gdn_forward,
            "conv_kernel": report.conv_kernel,
            "attn_implementation": report.attn_implementation,
        },
        "dflash_pipeline_git": _git_revision(),
        "run_config": cfg.dump(),
    }


BATCHING_RECORD = "batching.json"


def pin_token_budget(store: Store, version: str, report: ProbeReport) -> ProbeReport:
    """The report with the token budget this store version was first extracted with.

    With extract.token_budget=auto the probe sizes batches from free GPU memory, which differs between runs;
    a resumed run that batched differently would store states that are not bit-identical to an uninterrupted
    run's (another batch composition runs other kernels). The first run records its budget in the version;
    every later run of that version reuses it."""
    key = f"{version}/{BATCHING_RECORD}"
    if not store.loc.exists(key):
        store.loc.write_atomic(key, json.dumps({"token_budget": report.token_budget}).encode())
        return report
    try:
        budget = int(json.loads(store.loc.read_bytes(key))["token_budget"])
        if budget < 1:
            raise ValueError(f"token_budget {budget} < 1")
    except (ValueError, TypeError, KeyError) as e:  # (a damage check: NUL bytes appended were a traceback)
        raise StoreError(
            f"{store.loc.url_of(key)} is damaged ({type(e).__name__}: {e}); it records the token budget this "
            f'version was first extracted with: restore it, or write {{"token_budget": N}} with the extract.'
            "token_budget of that run (the probe's log names it), or delete the version and extract it again"
        ) from e
    if budget != report.token_budget:
        log.info(
            "%s was extracted with %d tokens per batch; using that again (this run's probe planned %d)",
            version,
            budget,
            report.token_budget,
        )
    return replace(report, token_budget=budget)


def plan_extraction(
    cfg: RunConfig, report: ProbeReport, prepared: PrepareResult, tokenizer_fp: str, template_fp: str
) -> PlanResult:
    store = Store(cfg.store, cfg.store_options)
    prov = provenance(cfg, report, tokenizer_fp, template_fp)
    version = store.resolve_version(prov, prepared.fingerprint, cfg.extract.new_version, cfg.extract.incremental)
    ds = load_prepared(prepared.path)
    sample_ids, lengths = ds["sample_id"], ds["seq_len"]

    def fetch(rows: list[int]):
        sub = ds.select(rows)
        return sub["input_ids"], sub["loss_mask"]

    opened: dict = {}

    def made_from(wanted: list[str]):  # a unit's rows changed or gone since: the prepared datasets it was made from
        fps = [fp for fp in store.attrs(version).get("dataset_fingerprints", []) if fp != prepared.fingerprint]
        return find_samples(Path(prepared.path).parent.parent, fps[::-1], wanted, opened)  # newest first

    x = cfg.extract
    nightly = x.new_version and x.incremental  # never stops the same way twice: what cannot be rebuilt is dropped
    return plan_units(
        store, version, sample_ids, lengths, fetch, x.unit_tokens, x.chunk_mib, x.shard_mib, x.compression,
        made_from, drop_lost=nightly,
    )  # fmt: skip


def assign_units(units: list[UnitInfo], devices: list[str]) -> dict[str, list[str]]:
    """Balance by tokens (longest-processing-time first): each unit goes to the least-loaded device."""
    heap = [(0, i, d) for i, d in enumerate(devices)]
    out: dict[str, list[str]] = {d: [] for d in devices}
    for u in sorted(units, key=lambda u: (-u.n_tokens, u.name)):
        load, i, d = heapq.heappop(heap)
        out[d].append(u.name)
        heapq.heappush(heap, (load + u.n_tokens, i, d))
    return {d: sorted(us) for d, us in out.items() if us}
