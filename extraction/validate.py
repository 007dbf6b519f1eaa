"""Validate a store version against the prepared dataset and against a fresh forward of the target.

Checks: completeness (every prepared sample exactly once, every unit committed), metadata (shapes,
dtypes), stored input_ids equal the prepared ones, every value finite, no all-zero or constant token
rows, per-layer statistics within sane bounds, readable chunks (CRC32C), and N samples recomputed at
batch size 1 through HF's own `output_hidden_states` (independent of our hooks), by the forward extraction
ran (the caller loads it with extract.compile applied). Data is scanned one shard at a time, so memory
stays bounded by one shard.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from dflash_pipeline.config import ValidateConfig
from dflash_pipeline.dataprep.prepare import PrepareResult, load_prepared
from dflash_pipeline.errors import ValidationFailed
from dflash_pipeline.extraction.loader import forward_or_eager
from dflash_pipeline.storage.layout import DTYPES, from_storage
from dflash_pipeline.storage.store import Store

log = logging.getLogger(__name__)
# Relative L2 error allowed between stored and recomputed states (batched vs batch-1 kernels differ).
TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 3e-2}


@dataclass
class ValidationReport:
    version: str
    n_samples: int = 0
    n_tokens: int = 0
    checks: list[dict] = field(default_factory=list)
    layer_stats: list[dict] = field(default_factory=list)
    recomputed: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c["ok"] for c in self.checks)

    @property
    def failures(self) -> list[str]:
        return [f"{c['check']}: {c['detail']}" for c in self.checks if not c["ok"]]

    def add(self, check: str, ok: bool, detail: str) -> None:
        self.checks.append({"check": check, "ok": ok, "detail": detail})
        if not ok:
            log.error("validation check %s failed: %s", check, detail)

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}

    def to_markdown(self) -> str:
        rows = "\n".join(f"| {c['check']} | {'PASS' if c['ok'] else '**FAIL**'} | {c['detail']} |" for c in self.checks)
        stats = "\n".join(
            f"| {s['layer_id']} | {s['mean_norm']:.4g} | {s['std']:.4g} | {s['min']:.4g} | {s['max']:.4g} |"
            for s in self.layer_stats
        )
        rec = "\n".join(
            f"| {r['sample_id']} | {r['tokens']} | {r['max_rel_err']:.3g} | {r['tolerance']:.0e} |"
            for r in self.recomputed
        )
        return f"""# Store validation: {"PASS" if self.ok else "FAIL"} ({self.version})

{self.n_samples} samples, {self.n_tokens} tokens.

| check | result | detail |
| --- | --- | --- |
{rows}

## Per-layer statistics
| layer id | mean token norm | std | min | max |
| --- | --- | --- | --- | --- |
{stats}

## Recomputed at batch size 1
| sample | tokens | max relative error | tolerance |
| --- | --- | --- | --- |
{rec}
"""


def _scan_unit(g, attrs, logical, k_ids, acc, report, unit, zero_budget):
    """Stream one unit shard by shard; accumulate stats; return the first offending (kind, token, layer)."""
    hidden = g["hidden"]
    shard = attrs["shard_tokens"]
    first_bad = None
    for s0 in range(0, hidden.shape[0], shard):
        try:
            block = from_storage(hidden[s0 : s0 + shard], logical).float()  # [n, K, H]
        except Exception as e:  # noqa: BLE001 - any decode error is reported with its place
            report.add(
                "readable",
                False,
                f"unit {unit} shard {s0 // shard} (tokens {s0}..) cannot be decoded: {type(e).__name__}: {e}",
            )
            return None
        finite = torch.isfinite(block)
        if not finite.all():
            t, j = (~finite).any(-1).nonzero()[0].tolist()
            first_bad = first_bad or ("non-finite values", s0 + t, k_ids[j])
            block = torch.nan_to_num(block, nan=0.0, posinf=0.0, neginf=0.0)
        zero = (block == 0).all(-1)  # [n, K]
        const = (block.amax(-1) == block.amin(-1)) & ~zero
        acc["zero"] += zero.sum(0)
        if const.any():
            t, j = const.nonzero()[0].tolist()
            first_bad = first_bad or ("a constant token row", s0 + t, k_ids[j])
        if zero.any() and acc["zero"].sum() > zero_budget:
            t, j = zero.nonzero()[0].tolist()
            first_bad = first_bad or ("an all-zero token row", s0 + t, k_ids[j])
        norms = block.norm(dim=-1)  # [n, K]
        acc["norm_sum"] += norms.double().sum(0)
        acc["sum"] += block.double().sum((0, 2))
        acc["sq"] += (block.double() ** 2).sum((0, 2))
        acc["min"] = torch.minimum(acc["min"], block.amin((0, 2)).double())
        acc["max"] = torch.maximum(acc["max"], block.amax((0, 2)).double())
        acc["n"] += block.shape[0]
    return first_bad


def _sample_at(samples, token):
    for sid, start, length in samples:
        if start <= token < start + length:
            return sid
    return "?"


def validate_store(
    store: Store | str, version: str, prepared: PrepareResult, cfg: ValidateConfig, model=None, device: str = "cpu"
) -> ValidationReport:
    """Run every check; `model` (the target, loaded by the caller) enables the recompute check.
    `store`: a Store (local or s3://), or the path of a local one."""
    store = store if isinstance(store, Store) else Store(store)
    attrs = store.attrs(version)
    logical, k_ids, hidden_size = attrs["logical_dtype"], attrs["layer_ids"], attrs["hidden_size"]
    report = ValidationReport(version=version)
    ds = load_prepared(prepared.path)
    prepared_ids = dict(zip(ds["sample_id"], range(len(ds))))

    # --- completeness ------------------------------------------------------------------------------
    where: dict[str, tuple[str, int, int]] = {}
    counts: Counter[str] = Counter()
    incomplete = []
    total_tokens = 0
    units = store.units(version)
    for u in units:
        rec = store.commit_record(version, u)
        if not rec.get("complete"):
            incomplete.append(f"{u} ({rec['committed_tokens']} tokens committed)")
        for sid, start, length in store.unit_attrs(version, u)["samples"]:
            counts[sid] += 1
            where[sid] = (u, start, length)
            total_tokens += length
    missing = [s for s in prepared_ids if s not in counts]
    dupes = [s for s, c in counts.items() if c > 1]
    report.add(
        "units committed",
        not incomplete,
        f"{len(units)} units" + (f"; incomplete: {incomplete[:5]}" if incomplete else ""),
    )
    report.add(
        "every prepared sample present",
        not missing,
        f"{len(prepared_ids)} prepared" + (f"; missing {len(missing)}, e.g. {missing[:3]}" if missing else ""),
    )
    report.add("no sample stored twice", not dupes, f"duplicates: {dupes[:3]}" if dupes else "none")

    # --- metadata, input ids, values ---------------------------------------------------------------
    stored_dtype = DTYPES[logical][0]
    meta_errors, id_errors = [], []
    acc = {
        "zero": torch.zeros(len(k_ids), dtype=torch.long),
        "norm_sum": torch.zeros(len(k_ids), dtype=torch.float64),
        "sum": torch.zeros(len(k_ids), dtype=torch.float64),
        "sq": torch.zeros(len(k_ids), dtype=torch.float64),
        "min": torch.full((len(k_ids),), math.inf, dtype=torch.float64),
        "max": torch.full((len(k_ids),), -math.inf, dtype=torch.float64),
        "n": 0,
    }
    value_problem = None
    t0 = time.monotonic()
    for ui, u in enumerate(units, start=1):
        g = store.open_unit(version, u)
        ua = dict(g.attrs)
        n_tok = ua["n_tokens"]
        exp = (n_tok, len(k_ids), hidden_size)
        if g["hidden"].shape != exp or g["hidden"].dtype != stored_dtype:
            meta_errors.append(f"{u}/hidden is {g['hidden'].shape} {g['hidden'].dtype}, expected {exp} {stored_dtype}")
            continue
        ids = g["input_ids"][:]
        for sid, start, length in ua["samples"]:
            if sid in prepared_ids:
                want = np.asarray(ds[prepared_ids[sid]]["input_ids"], dtype=np.int32)
                if not np.array_equal(ids[start : start + length], want):
                    id_errors.append(f"sample {sid} in {u}")
        bad = _scan_unit(
            g, ua, logical, k_ids, acc, report, u, cfg.max_zero_row_fraction * max(acc["n"] + n_tok, 1) * len(k_ids)
        )
        if bad and value_problem is None:
            kind, tok, layer = bad
            value_problem = f"{kind} in sample {_sample_at(ua['samples'], tok)} (unit {u}, token {tok}), layer {layer}"
        report.n_tokens += n_tok
        report.n_samples += len(ua["samples"])
        rate = report.n_tokens / max(time.monotonic() - t0, 1e-9)
        log.info(
            "validated unit %s (%d/%d): %d/%d tokens, %.0f tokens/s, ETA %.0f s",
            u,
            ui,
            len(units),
            report.n_tokens,
            total_tokens,
            rate,
            (total_tokens - report.n_tokens) / max(rate, 1e-9),
        )
    report.add(
        "shapes and dtypes match metadata",
        not meta_errors,
        "; ".join(meta_errors[:3]) or f"[T, {len(k_ids)}, {hidden_size}] {logical}",
    )
    report.add("input_ids equal the prepared ones", not id_errors, "; ".join(id_errors[:3]) or "all equal")
    report.add("values finite, no zero/constant rows", value_problem is None, value_problem or "clean")
    n = max(acc["n"], 1)
    for j, lid in enumerate(k_ids):
        mean = acc["sum"][j].item() / (n * hidden_size)
        var = max(acc["sq"][j].item() / (n * hidden_size) - mean * mean, 0.0)
        report.layer_stats.append(
            {
                "layer_id": lid,
                "mean_norm": acc["norm_sum"][j].item() / n,
                "std": math.sqrt(var),
                "min": acc["min"][j].item(),
                "max": acc["max"][j].item(),
            }
        )
    insane = [s for s in report.layer_stats if not (1e-3 < s["std"] < 1e5)]
    report.add(
        "per-layer statistics sane",
        not insane,
        "; ".join(f"layer {s['layer_id']} std {s['std']:.3g} outside (1e-3, 1e5)" for s in insane)
        or "std within (1e-3, 1e5)",
    )

    # --- recompute ---------------------------------------------------------------------------------
    if model is not None and cfg.recompute_samples and where:
        _recompute(store, version, attrs, where, cfg, model, device, report)
    return report


@torch.inference_mode()
def _recompute(store, version, attrs, where, cfg, model, device, report) -> None:
    logical, k_ids = attrs["logical_dtype"], attrs["layer_ids"]
    tol = TOLERANCE[logical]
    picks = random.Random(cfg.seed).sample(sorted(where), min(cfg.recompute_samples, len(where)))
    worst = None
    for sid in picks:
        u, start, length = where[sid]
        g = store.open_unit(version, u)
        ids = torch.from_numpy(g["input_ids"][start : start + length].astype(np.int64))[None].to(device)
        stored = from_storage(g["hidden"][start : start + length], logical).float()
        out = forward_or_eager(model, lambda ids=ids: model(input_ids=ids, output_hidden_states=True, use_cache=False))
        errs = []
        for j, lid in enumerate(k_ids):
            ref = out.hidden_states[lid + 1][0].float().cpu()
            errs.append(((stored[:, j] - ref).norm() / ref.norm().clamp_min(1e-12)).item())
        if "last_hidden" in g:  # stored pre-norm; HF's last entry is post-norm
            last = from_storage(g["last_hidden"][start : start + length], logical).to(device)
            normed = model.model.norm(last.to(out.hidden_states[-1].dtype))[None].float().cpu()
            ref = out.hidden_states[-1].float().cpu()
            errs.append(((normed - ref).norm() / ref.norm().clamp_min(1e-12)).item())
        m = max(errs)
        report.recomputed.append({"sample_id": sid, "tokens": length, "max_rel_err": m, "tolerance": tol})
        if m > tol and worst is None:
            j = int(np.argmax(errs))
            layer = k_ids[j] if j < len(k_ids) else "last (pre-norm)"
            worst = f"sample {sid} layer {layer}: relative error {m:.3g} > {tol:.0e}"
    report.add(f"{len(picks)} samples equal a fresh batch-1 forward", worst is None, worst or f"within {tol:.0e}")


def raise_if_failed(report: ValidationReport) -> None:
    if not report.ok:
        raise ValidationFailed(f"store {report.version} failed validation: " + " | ".join(report.failures))
