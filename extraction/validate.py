"""Validate a store version against the prepared dataset and against a fresh forward of the target.

Checks, each problem one line of the report (damaged data never raises out of here):
- integrity first, the checks of `dflash-pipeline verify` (storage/verify.py): every committed file present
  with its size and digest, the attributes equal to their records, every planned unit committed; units that
  fail are reported and not scanned further;
- completeness: every prepared sample exactly once;
- every stored array: hidden and last_hidden (shapes, dtypes, readable chunks, every value finite, no
  all-zero or constant token rows, per-layer statistics within sane bounds), input_ids and loss_mask equal
  to the prepared ones, the sample index (verify checks it covers the unit exactly);
- N samples recomputed at batch size 1 by the forward extraction ran (the caller loads it with
  extract.compile applied): captured layers against HF's own `output_hidden_states[id + 1]` (independent of
  our hooks), except the last decoder layer, whose HF entry is after the final norm: it and last_hidden are
  compared with the last layer's own output, taken by a forward hook (pre-norm, as stored).
Data is scanned one shard at a time, so memory stays bounded by one shard.
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

from dflash_pipeline.dataprep.prepare import PrepareResult, load_prepared
from dflash_pipeline.errors import ValidationFailed
from dflash_pipeline.extraction.config import ValidateConfig
from dflash_pipeline.extraction.loader import decoder_layers, forward_or_eager
from dflash_pipeline.storage import quant
from dflash_pipeline.storage.layout import ARRAYS, VALIDATION
from dflash_pipeline.storage.reader import read_rows
from dflash_pipeline.storage.store import Store
from dflash_pipeline.storage.validated import validated_state
from dflash_pipeline.storage.verify import layout_problems, verify_version

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
    # what the checks saw (storage.validated.validated_state): readers accept the version only while it is unchanged
    state: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(c["ok"] for c in self.checks)

    @property
    def failures(self) -> list[str]:
        return [f"{c['check']}: {c['detail']}" for c in self.checks if not c["ok"]]

    @property
    def integrity_ok(self) -> bool:
        return all(c["ok"] for c in self.checks if c["check"] == "integrity")

    def add(self, check: str, ok: bool, detail: str, *, states: bool = False, units: list[str] | None = None) -> None:
        """`states`: a check of the stored states' values (a failure with intact bytes means they are not to be
        trusted), `units`: the units a failed one found them in, when it can say (a nightly run discards those)."""
        entry = {"check": check, "ok": ok, "detail": detail}
        self.checks.append(entry | ({"states": True} if states else {}) | ({"units": units} if units else {}))
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
            f"| {r['sample_id']} | {r['tokens']} | {r['max_rel_err']:.3g} | {r['tolerance']:.3g} |"
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


def _new_acc(n: int) -> dict:
    return {
        "zero": torch.zeros(n, dtype=torch.long),
        "norm_sum": torch.zeros(n, dtype=torch.float64),
        "sum": torch.zeros(n, dtype=torch.float64),
        "sq": torch.zeros(n, dtype=torch.float64),
        "min": torch.full((n,), math.inf, dtype=torch.float64),
        "max": torch.full((n,), -math.inf, dtype=torch.float64),
        "n": 0,
    }


def _scan_array(g, name, shard, logical, precision, labels, acc, report, unit, zero_budget):
    """Stream one array ([T, K, H], or [T, H] as K = 1) of unit group `g` shard by shard, as a reader gets it
    (dequantized in a compact precision); accumulate stats; return the first offending (kind, token, label),
    or None. A shard that cannot be decoded is a report line."""
    first_bad = None
    for s0 in range(0, g[name].shape[0], shard):
        try:
            block = read_rows(g, name, slice(s0, s0 + shard), logical, precision).float()
        except Exception as e:  # noqa: BLE001 - any decode error is reported with its place
            report.add(
                "readable",
                False,
                f"unit {unit} array {name} shard {s0 // shard} (tokens {s0}..) cannot be decoded: "
                f"{type(e).__name__}: {e}",
            )
            return None
        if block.dim() == 2:
            block = block[:, None]
        finite = torch.isfinite(block)
        if not finite.all():
            t, j = (~finite).any(-1).nonzero()[0].tolist()
            first_bad = first_bad or ("non-finite values", s0 + t, labels[j])
            block = torch.nan_to_num(block, nan=0.0, posinf=0.0, neginf=0.0)
        zero = (block == 0).all(-1)  # [n, K]
        const = (block.amax(-1) == block.amin(-1)) & ~zero
        acc["zero"] += zero.sum(0)
        if const.any():
            t, j = const.nonzero()[0].tolist()
            first_bad = first_bad or ("a constant token row", s0 + t, labels[j])
        if zero.any() and acc["zero"].sum() > zero_budget:
            t, j = zero.nonzero()[0].tolist()
            first_bad = first_bad or ("an all-zero token row", s0 + t, labels[j])
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


def _check_integrity(store: Store, version: str, report: ValidationReport) -> set[str]:
    """The checks of `dflash-pipeline verify`, one report line per problem; returns the units with problems."""
    vr = verify_version(store, version, digests=True)
    for p in vr.problems:
        report.add("integrity", False, p.line())
    if vr.ok:
        report.add("integrity", True, vr.summary())
    else:
        log.error("store %s: %s", version, vr.summary())
    return {p.unit for p in vr.problems if p.unit != "-"}


def validate_store(
    store: Store | str, version: str, prepared: PrepareResult, cfg: ValidateConfig, model=None, device: str = "cpu"
) -> ValidationReport:
    """Run every check; `model` (the target, loaded by the caller) enables the recompute check.
    `store`: a Store (local or s3://), or the path of a local one. Never raises on damaged data: every
    problem is a line of the report (raise_if_failed turns a failed report into ValidationFailed)."""
    store = store if isinstance(store, Store) else Store(store)
    report = ValidationReport(version=version)
    try:
        report.state = validated_state(store, version)  # before the checks: what they vouch for
    except (ValueError, OSError) as e:  # an unreadable record: integrity reports it; nothing is vouched for
        report.state = {"-": f"unreadable: {type(e).__name__}"}
    changed = _changed_since_last_validation(store, version, report.state)
    bad_units = _check_integrity(store, version, report)
    try:
        attrs = store.attrs(version)
        logical, k_ids, hidden_size = attrs["logical_dtype"], list(attrs["layer_ids"]), attrs["hidden_size"]
        precision = quant.scheme(attrs)
    except Exception as e:  # noqa: BLE001 - damaged version attributes: nothing else can be checked
        report.add("version attributes readable", False, f"{type(e).__name__}: {e}")
        return report
    capture_last = bool(attrs.get("capture_last"))
    ds = load_prepared(prepared.path)
    prepared_ids = dict(zip(ds["sample_id"], range(len(ds))))

    # --- completeness ------------------------------------------------------------------------------
    where: dict[str, tuple[str, int, int]] = {}
    counts: Counter[str] = Counter()
    unit_attrs: dict[str, dict] = {}
    total_tokens = 0
    units = store.units(version)
    for u in units:
        try:
            ua = store.unit_attrs(version, u)
            samples = [(str(sid), int(start), int(length)) for sid, start, length in ua["samples"]]
        except Exception as e:  # noqa: BLE001 - verify reported it too; completeness is judged without it
            report.add("sample index readable", False, f"unit {u}: {type(e).__name__}: {e}")
            bad_units.add(u)
            continue
        unit_attrs[u] = {**ua, "samples": samples}
        for sid, start, length in samples:
            counts[sid] += 1
            where[sid] = (u, start, length)
            total_tokens += length
    missing = [s for s in prepared_ids if s not in counts]
    dupes = [s for s, c in counts.items() if c > 1]
    report.add(
        "every prepared sample present",
        not missing,
        f"{len(prepared_ids)} prepared" + (f"; missing {len(missing)}, e.g. {missing[:3]}" if missing else ""),
    )
    report.add("no sample stored twice", not dupes, f"duplicates: {dupes[:3]}" if dupes else "none")

    # --- every array of every unit that passed the integrity checks -----------------------------------
    labels = k_ids + (["last (pre-norm)"] if capture_last else [])
    acc = _new_acc(len(k_ids))
    acc_last = _new_acc(1)
    meta_errors, id_errors, mask_errors = [], [], []
    value_problem, value_units = None, []
    t0 = time.monotonic()
    for ui, u in enumerate(units, start=1):
        if u in bad_units or u not in unit_attrs:
            continue
        ua = unit_attrs[u]
        try:
            bad = _check_unit_arrays(
                store,
                version,
                u,
                ua,
                attrs,
                logical,
                precision,
                k_ids,
                capture_last,
                ds,
                prepared_ids,
                acc,
                acc_last,
                cfg,
                report,
                meta_errors,
                id_errors,
                mask_errors,
            )
        except Exception as e:  # noqa: BLE001 - whatever is wrong with the unit is a line, not a crash
            report.add("readable", False, f"unit {u}: {type(e).__name__}: {e}")
            continue
        if bad:
            value_units.append(u)
        if bad and value_problem is None:
            kind, tok, layer = bad
            value_problem = f"{kind} in sample {_sample_at(ua['samples'], tok)} (unit {u}, token {tok}), layer {layer}"
        report.n_tokens += ua["n_tokens"]
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
    report.add("loss_mask equals the prepared one", not mask_errors, "; ".join(mask_errors[:3]) or "all equal")
    report.add(
        "values finite, no zero/constant rows",
        value_problem is None,
        (value_problem + (f" (units with such rows: {', '.join(value_units)})" if len(value_units) > 1 else ""))
        if value_problem
        else "clean",
        states=True,
        units=value_units,
    )
    for j, lid in enumerate(labels):
        a, jj = (acc, j) if j < len(k_ids) else (acc_last, 0)
        n = max(a["n"], 1)
        mean = a["sum"][jj].item() / (n * hidden_size)
        var = max(a["sq"][jj].item() / (n * hidden_size) - mean * mean, 0.0)
        report.layer_stats.append(
            {
                "layer_id": lid,
                "mean_norm": a["norm_sum"][jj].item() / n,
                "std": math.sqrt(var),
                "min": a["min"][jj].item(),
                "max": a["max"][jj].item(),
            }
        )
    insane = [s for s in report.layer_stats if not (1e-3 < s["std"] < 1e5)]
    report.add(
        "per-layer statistics sane",
        not insane,
        "; ".join(f"layer {s['layer_id']} std {s['std']:.3g} outside (1e-3, 1e5)" for s in insane)
        or "std within (1e-3, 1e5)",
        states=True,
    )

    # --- recompute ---------------------------------------------------------------------------------
    healthy = {sid: w for sid, w in where.items() if w[0] not in bad_units}
    if model is not None and cfg.recompute_samples and healthy:
        try:
            _recompute(store, version, attrs, healthy, cfg, model, device, report, changed)
        except Exception as e:  # noqa: BLE001 - e.g. a chunk that cannot be decoded
            report.add("recompute", False, f"{type(e).__name__}: {e}", states=True)
    return report


def _check_unit_arrays(
    store, version, u, ua, attrs, logical, precision, k_ids, capture_last, ds, prepared_ids,
    acc, acc_last, cfg, report, meta_errors, id_errors, mask_errors,
):  # fmt: skip
    g = store.open_unit(version, u)
    n_tok = ua["n_tokens"]
    arrays = {name: g[name] for name in ARRAYS if name in g}
    meta_errors += [f"{u}/{p.array}: {p.what}" for p in layout_problems(u, arrays, attrs, n_tok)]
    if meta_errors:
        return None
    ids, mask = g["input_ids"][:], g["loss_mask"][:]
    for sid, start, length in ua["samples"]:
        if sid in prepared_ids:
            row = ds[prepared_ids[sid]]
            if not np.array_equal(ids[start : start + length], np.asarray(row["input_ids"], dtype=np.int32)):
                id_errors.append(f"sample {sid} in {u}")
            if not np.array_equal(mask[start : start + length], np.asarray(row["loss_mask"], dtype=np.uint8)):
                mask_errors.append(f"sample {sid} in {u}")
    budget = cfg.max_zero_row_fraction * max(acc["n"] + n_tok, 1) * len(k_ids)
    shard = ua["shard_tokens"]
    bad = _scan_array(g, "hidden", shard, logical, precision, k_ids, acc, report, u, budget)
    if capture_last:
        budget_last = cfg.max_zero_row_fraction * max(acc_last["n"] + n_tok, 1)
        last_bad = _scan_array(
            g, "last_hidden", shard, logical, precision, ["last (pre-norm)"], acc_last, report, u, budget_last
        )
        bad = bad or last_bad
    return bad


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def _quant_bound(precision: str, scale: torch.Tensor | None, ref: torch.Tensor) -> float:
    """The largest relative L2 error quantization can add to rows `ref` stored with these scales (0 for full
    precision): storage/quant.py, docs/STORE.md "Compact precisions"."""
    if scale is None:
        return 0.0
    return quant.error_bound(precision, scale, ref) / ref.norm().clamp_min(1e-12).item()


def _changed_since_last_validation(store: Store, version: str, state: dict[str, str]) -> set[str]:
    """The units whose commit record differs from the one the version's last validation report vouched for (none
    when there is no earlier report: a first validation covers units the run itself just extracted)."""
    try:
        before = (store.loc.read_json(f"{version}/{VALIDATION}") or {}).get("state")
    except (ValueError, OSError, AttributeError):  # unreadable or not an object: integrity and the reader say so
        return set()
    if not isinstance(before, dict):
        return set()
    return {u for u, d in state.items() if u != "-" and before.get(u) != d}


@torch.inference_mode()
def _recompute(store, version, attrs, where, cfg, model, device, report, changed=frozenset()) -> None:
    """cfg.recompute_samples samples (seeded), and one of each unit in `changed` that those miss: a unit replaced
    since the last validation (a repair's re-extraction, or a directory copied in from another store, whose own
    records are consistent) is recomputed before the version is vouched for again, not only scanned."""
    logical, k_ids = attrs["logical_dtype"], attrs["layer_ids"]
    precision = quant.scheme(attrs)
    tol = TOLERANCE[logical]
    rng = random.Random(cfg.seed)
    picks = rng.sample(sorted(where), min(cfg.recompute_samples, len(where)))
    covered = {where[sid][0] for sid in picks}
    for u in sorted(set(changed) - covered):
        in_unit = sorted(sid for sid, w in where.items() if w[0] == u)
        if in_unit:
            picks.append(rng.choice(in_unit))
    layers = decoder_layers(model)
    last_id = len(layers) - 1
    captured: dict[str, torch.Tensor] = {}

    def hook(_module, _args, output):  # the last decoder layer's own output: before the final norm
        captured["last"] = output[0] if isinstance(output, tuple) else output

    handle = layers[last_id].register_forward_hook(hook)
    worst = None
    try:
        for sid in picks:
            u, start, length = where[sid]
            g = store.open_unit(version, u)
            ids = torch.from_numpy(g["input_ids"][start : start + length].astype(np.int64))[None].to(device)
            sl = slice(start, start + length)
            stored = read_rows(g, "hidden", sl, logical, precision).float()
            scales = {a: torch.from_numpy(g[a][sl]) for a in quant.SCALE_OF.values() if a in g}
            captured.clear()
            out = forward_or_eager(
                model, lambda ids=ids: model(input_ids=ids, output_hidden_states=True, use_cache=False)
            )
            last_ref = captured["last"][0].float().cpu()
            errs, tols, names = [], [], []
            for j, lid in enumerate(k_ids):
                ref = last_ref if lid == last_id else out.hidden_states[lid + 1][0].float().cpu()
                scale = scales["hidden_scale"][:, j] if scales else None
                errs.append(_rel_err(stored[:, j], ref))
                tols.append(tol + _quant_bound(precision, scale, ref))
                names.append(f"{lid}" + (" (last, pre-norm)" if lid == last_id else ""))
            if "last_hidden" in g:
                last = read_rows(g, "last_hidden", sl, logical, precision).float()
                errs.append(_rel_err(last, last_ref))
                tols.append(tol + _quant_bound(precision, scales.get("last_hidden_scale"), last_ref))
                names.append("last_hidden (pre-norm)")
            j = int(np.argmax([e / t for e, t in zip(errs, tols)]))
            report.recomputed.append(
                {"sample_id": sid, "tokens": length, "max_rel_err": max(errs), "tolerance": tols[j]}
            )
            if errs[j] > tols[j] and worst is None:
                worst = (
                    f"sample {sid} (unit {u}) layer {names[j]}: relative error {errs[j]:.3g} > {tols[j]:.3g}: the "
                    f"stored states differ from the target's forward (another target or forward than the one that "
                    f"wrote them, or data changed in place: delete the unit's directory {u} and rerun extract to "
                    "recompute it)"
                )
    finally:
        handle.remove()
    within = f"within {tol:.0e}" + ("" if precision == "full" else f" + the {precision} quantization bound")
    report.add(f"{len(picks)} samples equal a fresh batch-1 forward", worst is None, worst or within, states=True)


def raise_if_failed(report: ValidationReport) -> None:
    if not report.ok:
        failures = report.failures
        more = f" | ... and {len(failures) - 10} more (validation.json has them all)" if len(failures) > 10 else ""
        fix = ""
        if not report.integrity_ok:
            fix = (
                ". The store is damaged or unfinished: rerun extract on it, which rebuilds units that fail the "
                "cheap checks; run `dflash-pipeline verify <store> --repair` first when a digest differs"
            )
        raise ValidationFailed(f"store {report.version} failed validation: " + " | ".join(failures[:10]) + more + fix)
