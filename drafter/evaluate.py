"""Acceptance length of a drafter with the real target: greedy speculative decoding on held-out prompts.

Per verification step: the drafter proposes block_size-1 tokens after the last accepted token (the
anchor), from the target's hidden states of every position before the anchor; the target runs once on
[context ; anchor ; drafts]; the longest prefix of drafts equal to the target's greedy choices is
accepted, plus the target's own next token (the bonus). Acceptance length tau = mean tokens produced
per verification step (accepted + bonus, as in the DFlash paper), so 1 <= tau <= block_size.

Correctness over speed: every step re-runs the target over the whole sequence (no KV cache), which is
exact for any architecture (hybrid GDN included). The output is the target's own greedy continuation,
and `lossless_check` compares it against plain greedy decoding.

Slices (`evaluate.slice_by`): fields of the prompt rows; per value of each field, the same figures over that
value's prompts. Every figure pools verification steps: tau = generated tokens / verification steps, so the
overall tau is the step-weighted mean of the slice taus (sum_s steps_s * tau_s / sum_s steps_s), and likewise
each position's rate; it is not the mean over prompts.

Nothing is measured twice (`evaluation_key`): what determines a result is hashed (target config and weights
fingerprint, tokenizer and chat template, the prompt rows used, max_new_tokens, chat_template_kwargs, device
type and dtype, the forward's kernels, torch / transformers versions, this code), plus the drafter: the
export's weights for the trained one, its architecture and seed for the untrained baseline.
- The trained drafter's result is stored with its key in the export's dflash_meta.json (`acceptance`); an
  evaluation with the same key reuses it (`reused: true`) without loading the target.
- The untrained baseline (always ~1: the answer depends on the target and prompts, not on training) is kept
  in `$DFLASH_HOME/baselines/<key digest>.json` (default ~/.cache/dflash-pipeline, where the embedded target is
  built too): it is a property of (target, prompts, settings), not of a run, so every run on that machine
  shares it whatever its output_dir (a fresh `make run`, the nightly deployment, CI jobs). It is also kept in
  dflash_meta.json, the fallback when the cache file is gone.
Both store the steps of every prompt, so changing only `slice_by` recomputes the slices without a forward.

A decoder we did not write (`evaluate.decoder`): 'reference' scores the trained drafter with z-lab's `dflash`
0.1.0 (drafter/reference_decoder.py: its model class loading the export, its greedy decoding), 'both' with ours and
then theirs on the same prompts, the report holding both figures and their ratio (`decoder_agreement`). The key of
such an evaluation names the decoder and the package version; the untrained baseline is always ours.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dflash_pipeline.drafter import reference_decoder
from dflash_pipeline.drafter.acceptance_plot import plot_acceptance
from dflash_pipeline.drafter.config import EvalConfig
from dflash_pipeline.drafter.eval_cache import (
    baseline_cache_dir,
    baseline_key,
    digest,
    evaluation_key,
    read_baseline,
    trained_key,
    write_baseline,
)
from dflash_pipeline.drafter.model import DFlashDrafter
from dflash_pipeline.drafter.prompts import check_slice_fields, load_prompts
from dflash_pipeline.drafter.reference_decoder import reference_generate
from dflash_pipeline.drafter.target_head import head_from_model
from dflash_pipeline.extraction.capture import LayerCapture

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from dflash_pipeline.extraction.probe import ProbeReport

PLOT = "acceptance.png"  # beside the export (the drafter directory), next to loss_curve.png


def aggregate(steps_per_prompt: list[list[int]], block_size: int) -> dict[str, Any]:
    """Pooled figures of some prompts from their tokens produced per verification step: tau = tokens / steps
    (1.0 with no step), and the share of steps that accepted draft position k, k = 1..block_size-1."""
    steps = [x for p in steps_per_prompt for x in p]
    n = len(steps)
    return {
        "num_prompts": len(steps_per_prompt),
        "verify_steps": n,
        "generated_tokens": sum(steps),
        "acceptance_length": sum(steps) / n if n else 1.0,
        "position_accept_rate": [sum(1 for x in steps if x - 1 >= k) / n if n else 0.0 for k in range(1, block_size)],
    }


def slice_value(v: Any) -> str:
    """A slice's name: a string as it is, any other JSON value as JSON (true, 3, null)."""
    return v if isinstance(v, str) else json.dumps(v, sort_keys=True)


def slices(
    rows: list[dict],
    per_prompt: list[dict],
    fields: list[str],
    block_size: int,
    untrained: list[dict] | None = None,
) -> dict[str, list[dict]]:
    """{field: [one entry per value, sorted by value: {value, aggregate figures, untrained_acceptance_length}]}."""
    out: dict[str, list[dict]] = {}
    for f in fields:
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(rows):
            groups.setdefault(slice_value(r[f]), []).append(i)
        entries = []
        for value in sorted(groups):
            idx = groups[value]
            e = {"value": value, **aggregate([per_prompt[i]["produced"] for i in idx], block_size)}
            if untrained is not None:
                base = aggregate([untrained[i]["produced"] for i in idx], block_size)
                e["untrained_acceptance_length"] = base["acceptance_length"]
            entries.append(e)
        out[f] = entries
    return out


@dataclass
class AcceptanceReport:
    acceptance_length: float
    block_size: int
    num_prompts: int
    verify_steps: int
    generated_tokens: int
    position_accept_rate: list[float]  # [k-1]: share of steps whose draft position k was accepted
    # per prompt: id, tokens, steps, acceptance_length, produced (tokens per verification step), the slice values
    per_prompt: list[dict] = field(default_factory=list)
    untrained_acceptance_length: float | None = None  # same spec, freshly initialized: the baseline
    untrained_position_accept_rate: list[float] | None = None
    untrained_per_prompt: list[dict] | None = None  # the baseline's steps, per prompt (the slices' baseline)
    slices: dict[str, list[dict]] = field(default_factory=dict)  # evaluate.slice_by: see `slices`
    reused: bool = False  # the trained drafter's figures are the ones stored in dflash_meta.json (same key)
    baseline_reused: bool | None = None  # the baseline came from the cache (None: no baseline)
    baseline_cache: str | None = None  # the baseline's cache file
    target_forwards: int = 0  # target forwards this evaluation ran for the trained drafter (0 when reused)
    baseline_forwards: int = 0  # ... and for the baseline (0 when reused)
    plot_path: str | None = None
    key_digest: str | None = None  # of the trained drafter's evaluation key (the reuse check)
    baseline_key_digest: str | None = None
    key: dict = field(default_factory=dict)  # what the trained drafter's figures depend on
    elapsed_s: float = 0.0
    decoder: str = "ours"  # evaluate.decoder: which decoder gave the figures above ('both': ours)
    # evaluate.decoder=both: z-lab's reference decoder on the same prompts (drafter/reference_decoder.py)
    reference_acceptance_length: float | None = None
    reference_position_accept_rate: list[float] | None = None
    reference_per_prompt: list[dict] | None = None
    decoder_agreement: float | None = None  # reference_acceptance_length / acceptance_length

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> AcceptanceReport:
        names = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in d.items() if k in names})

    def reuse_line(self) -> str:
        """What this evaluation measured and what it reused, in one line."""
        trained = (
            "reused from dflash_meta.json" if self.reused else f"measured ({self.target_forwards} target forwards)"
        )
        if self.baseline_reused is None:
            base = "not measured (evaluate.baseline=off)"
        elif self.baseline_reused:
            base = f"reused from {self.baseline_cache}"
        else:
            base = f"measured ({self.baseline_forwards} target forwards)"
        by = {"reference": " by z-lab's reference decoder", "both": " by ours and by z-lab's reference decoder"}
        return f"trained drafter {trained}{by.get(self.decoder, '')}; untrained baseline {base}"

    def to_markdown(self, title: str = "Drafter acceptance", plot_uri: str | None = None) -> str:
        rates = " | ".join(f"{r:.2f}" for r in self.position_accept_rate)
        heads = " | ".join(str(k) for k in range(1, len(self.position_accept_rate) + 1))
        decoded = {"reference": " (z-lab's reference decoder, dflash)", "both": " (our decoder)"}.get(self.decoder, "")
        md = (
            f"# {title}\n\n**Acceptance length: {self.acceptance_length:.3f}** tokens per target step{decoded} "
            f"(greedy; block size {self.block_size}; range 1..{self.block_size})\n\n"
            + (
                f"- z-lab's reference decoder (dflash `spec_generate`) on the same prompts: "
                f"{self.reference_acceptance_length:.3f} ({self.decoder_agreement:.4f}x ours)\n"
                if self.reference_acceptance_length is not None
                else ""
            )
            + (
                f"- untrained drafter (baseline): {self.untrained_acceptance_length:.3f}\n"
                if self.untrained_acceptance_length is not None
                else ""
            )
            + f"- prompts: {self.num_prompts}, verification steps: {self.verify_steps}, "
            f"generated tokens: {self.generated_tokens}\n"
            f"- {self.reuse_line()}\n\n"
            f"Acceptance rate by draft position (share of steps that accepted position k):\n\n"
            f"| k | {heads} |\n|---|{'---|' * len(self.position_accept_rate)}\n| rate | {rates} |\n"
        )
        if self.reference_position_accept_rate is not None:
            md += f"| reference decoder | {' | '.join(f'{r:.2f}' for r in self.reference_position_accept_rate)} |\n"
        if self.untrained_position_accept_rate is not None:
            md += f"| untrained | {' | '.join(f'{r:.2f}' for r in self.untrained_position_accept_rate)} |\n"
        for f, entries in self.slices.items():
            md += (
                f"\n## By `{f}`\n\nOverall tau is the verification-step-weighted mean of these.\n\n"
                f"| {f} | prompts | steps | tokens | tau | untrained tau | "
                f"rate by position 1..{self.block_size - 1} |\n"
                "| --- | --- | --- | --- | --- | --- | --- |\n"
            )
            for e in entries:
                base = e.get("untrained_acceptance_length")
                md += (
                    f"| {e['value']} | {e['num_prompts']} | {e['verify_steps']} | {e['generated_tokens']} | "
                    f"{e['acceptance_length']:.3f} | {'-' if base is None else f'{base:.3f}'} | "
                    f"{' '.join(f'{r:.2f}' for r in e['position_accept_rate'])} |\n"
                )
        if self.plot_path:
            md += f"\n![acceptance]({plot_uri or self.plot_path})\n\n`{self.plot_path}`\n"
        return md


@torch.inference_mode()
def speculative_generate(
    target, drafter: DFlashDrafter, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int]
) -> tuple[list[int], list[int]]:
    """Greedy speculative decoding; returns (generated tokens, tokens produced per verification step)."""
    s, dev = drafter.spec, next(drafter.parameters()).device
    head = head_from_model(target)
    capture = LayerCapture(target, s.target_layer_ids)  # the same layer values extraction stored
    seq = torch.tensor([prompt_ids], device=dev)
    with capture.recording(stop=False) as outs:
        out = target(input_ids=seq, use_cache=False)
    feats = capture.features(outs)
    gen = [int(out.logits[0, -1].argmax())]
    produced: list[int] = []
    while len(gen) < max_new_tokens and gen[-1] not in stop_ids:
        seq = torch.tensor([prompt_ids + gen], device=dev)
        ctx_len = seq.shape[1] - 1  # the anchor (last token) has no target hidden state yet
        block = torch.full((1, s.block_size), s.mask_token_id, device=dev)
        block[0, 0] = gen[-1]
        bpos = torch.arange(ctx_len, ctx_len + s.block_size, device=dev)[None]
        masks = drafter.block_masks(torch.tensor([[ctx_len]], device=dev), None, ctx_len)
        h = drafter(
            feats[:, :ctx_len].to(next(drafter.parameters()).dtype),
            head.embed(block).to(feats.dtype),
            torch.arange(ctx_len, device=dev)[None],
            bpos,
            masks,
        )
        drafts = head.logits(h[0, 1:].to(head.lm_head.weight.dtype)).argmax(-1)
        with capture.recording(stop=False) as outs:
            out = target(input_ids=torch.cat([seq, drafts[None]], dim=1), use_cache=False)
        greedy = out.logits[0, ctx_len:].argmax(-1)  # greedy[j] = target's token after block position j
        n_acc = int((drafts == greedy[:-1]).long().cumprod(0).sum())
        new = drafts[:n_acc].tolist() + [int(greedy[n_acc])]
        budget = max_new_tokens - len(gen)
        new = new[:budget]
        for j, t in enumerate(new):  # stop at the first stop token
            if t in stop_ids:
                new = new[: j + 1]
                break
        gen += new
        produced.append(len(new))
        feats = capture.features(outs)[:, : ctx_len + 1 + n_acc]
    return gen, produced


@torch.inference_mode()
def greedy_generate(target, prompt_ids: list[int], max_new_tokens: int, stop_ids: set[int]) -> list[int]:
    """Plain greedy decoding with full recomputation (the reference for the lossless check)."""
    dev = next(target.parameters()).device
    gen: list[int] = []
    while len(gen) < max_new_tokens and (not gen or gen[-1] not in stop_ids):
        logits = target(input_ids=torch.tensor([prompt_ids + gen], device=dev), use_cache=False).logits
        gen.append(int(logits[0, -1].argmax()))
    return gen


def _steps(
    drafter: DFlashDrafter,
    target,
    tokenizer,
    cfg: EvalConfig,
    prompts: list[dict],
    progress: Callable[[int, int], None] | None = None,
    generate: Callable[..., tuple[list[int], list[int]]] = speculative_generate,
) -> list[dict]:
    """Speculative decoding of every prompt: [{id, tokens, steps, acceptance_length, produced}]. `generate`: ours
    (speculative_generate) or the reference decoder's (reference_decoder.reference_generate), with its drafter."""
    eos = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    stop = {tokenizer.eos_token_id} | set([eos] if isinstance(eos, int) else eos or [])
    per_prompt = []
    for n_done, p in enumerate(prompts):
        if progress:
            progress(n_done, len(prompts))
        ids = tokenizer.apply_chat_template(
            p["messages"], add_generation_prompt=True, tokenize=True, return_dict=True, **cfg.chat_template_kwargs
        )["input_ids"]
        gen, produced = generate(target, drafter, list(ids), cfg.max_new_tokens, stop)
        per_prompt.append(
            {
                "id": p.get("id"),
                "tokens": len(gen),
                "steps": len(produced),
                "acceptance_length": sum(produced) / len(produced) if produced else None,
                "produced": produced,
            }
        )
    return per_prompt


def _report(
    per_prompt: list[dict], rows: list[dict], cfg: EvalConfig, block_size: int, untrained: list[dict] | None
) -> AcceptanceReport:
    overall = aggregate([p["produced"] for p in per_prompt], block_size)
    for p, r in zip(per_prompt, rows, strict=True):
        p["slices"] = {f: slice_value(r[f]) for f in cfg.slice_by}
    rep = AcceptanceReport(block_size=block_size, per_prompt=per_prompt, **overall)
    if untrained is not None:
        base = aggregate([p["produced"] for p in untrained], block_size)
        rep.untrained_acceptance_length = base["acceptance_length"]
        rep.untrained_position_accept_rate = base["position_accept_rate"]
        rep.untrained_per_prompt = untrained
    rep.slices = slices(rows, per_prompt, cfg.slice_by, block_size, untrained)
    return rep


def evaluate_acceptance(
    drafter: DFlashDrafter,
    target,
    tokenizer,
    cfg: EvalConfig,
    prompts: list[dict] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> AcceptanceReport:
    """Acceptance length over the prompts (target and drafter already on the same device, eval mode), with the
    slices of evaluate.slice_by; no baseline, nothing cached."""
    prompts = prompts if prompts is not None else load_prompts(cfg)
    check_slice_fields(prompts, cfg.slice_by, "the given prompts")
    per_prompt = _steps(drafter, target, tokenizer, cfg, prompts, progress)
    return _report(per_prompt, prompts, cfg, drafter.spec.block_size, None)


class _ForwardCounter:
    """Counts the target's forwards (a forward hook on the model): the evidence of what was measured."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.n = 0
        self._h = model.register_forward_hook(self._count)

    def _count(self, *_: Any) -> None:
        self.n += 1

    def close(self) -> None:
        self._h.remove()


def evaluate_export(
    export_dir: str, report: ProbeReport, cfg: EvalConfig, baseline: bool = True, seed: int | None = None
) -> AcceptanceReport:
    """Acceptance of the exported drafter (and, with `baseline` and evaluate.baseline not 'off', of an untrained
    drafter of the same architecture), reusing what was measured before with the same key (see the module
    docstring); the result goes into the export's dflash_meta.json and its plot beside the export."""
    from dflash_pipeline.drafter.export import load_drafter, read_meta, spec_of_export, update_meta
    from dflash_pipeline.drafter.runtime import resolve_device
    from dflash_pipeline.extraction.tokenizer import load_tokenizer

    t0 = time.monotonic()
    seed = cfg.baseline_seed if seed is None else seed
    rows = load_prompts(cfg)  # slice fields checked before anything is loaded
    device = str(resolve_device(cfg.device))
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    tok = load_tokenizer(report.tokenizer_path, report.trust_remote_code)
    common = evaluation_key(report, cfg, rows, tok, device, dtype)
    key = trained_key(common, export_dir)
    if cfg.decoder != "ours":  # (a key of decoder 'ours' stays what it was before the setting existed)
        key["decoder"] = reference_decoder.key(cfg.decoder)  # also: the package is there (or a clear error now)
    spec = spec_of_export(export_dir)
    stored = read_meta(export_dir).get("acceptance") or {}

    trained: list[dict] | None = None
    ref_trained: list[dict] | None = None
    if cfg.reuse and stored.get("key") == key and stored.get("per_prompt"):
        if cfg.decoder != "both" or stored.get("reference_per_prompt"):
            trained = [{k: v for k, v in p.items() if k != "slices"} for p in stored["per_prompt"]]
            ref_trained = stored.get("reference_per_prompt") if cfg.decoder == "both" else None
    reused = trained is not None
    untrained: list[dict] | None = None
    bkey = bdigest = cache = None
    want_baseline = baseline and cfg.baseline != "off"
    if want_baseline:
        bkey = baseline_key(common, spec, seed)
        bdigest = digest(bkey)
        cache = baseline_cache_dir() / f"{bdigest[:32]}.json"
        if cfg.baseline == "cached":
            untrained = read_baseline(cache, bkey)
            if untrained is None and stored.get("baseline_key_digest") == bdigest:
                untrained = stored.get("untrained_per_prompt")  # the cache file is gone: the export kept a copy
                if untrained is not None:
                    write_baseline(cache, bkey, untrained, 0.0)
    baseline_reused = None if not want_baseline else untrained is not None

    fwd_trained = fwd_base = 0
    if trained is None or (want_baseline and untrained is None):
        from dflash_pipeline.extraction.loader import load_planned

        target = load_planned(report, device, str(dtype).removeprefix("torch."))  # the extraction's loader
        counter = _ForwardCounter(target)
        try:
            if trained is None:
                if cfg.decoder in ("ours", "both"):
                    drafter = load_drafter(export_dir, device, dtype)
                    trained = _steps(drafter, target, tok, cfg, rows, _progress_log("trained drafter"))
                if cfg.decoder in ("reference", "both"):  # z-lab's model class loading the export as it ships
                    ref = reference_decoder.load_reference(export_dir, device, dtype)
                    what = "trained drafter, z-lab's reference decoder"
                    ref_trained = _steps(ref, target, tok, cfg, rows, _progress_log(what), reference_generate)
                    trained, ref_trained = (trained, ref_trained) if trained is not None else (ref_trained, None)
                fwd_trained, counter.n = counter.n, 0
            if want_baseline and untrained is None:
                tb = time.monotonic()
                torch.manual_seed(seed)
                fresh = DFlashDrafter(spec).to(device=device, dtype=dtype).eval()
                untrained = _steps(fresh, target, tok, cfg, rows, _progress_log("untrained baseline"))
                fwd_base = counter.n
                write_baseline(cache, bkey, untrained, time.monotonic() - tb)
        finally:
            counter.close()
    rep = _report(trained, rows, cfg, spec.block_size, untrained)
    rep.decoder = cfg.decoder
    if ref_trained is not None:
        ref_figures = aggregate([p["produced"] for p in ref_trained], spec.block_size)
        rep.reference_acceptance_length = ref_figures["acceptance_length"]
        rep.reference_position_accept_rate = ref_figures["position_accept_rate"]
        rep.reference_per_prompt = ref_trained
        rep.decoder_agreement = rep.reference_acceptance_length / rep.acceptance_length
        log.info(
            "evaluate: acceptance length %.3f by our decoder, %.3f by z-lab's reference decoder (ratio %.4f)",
            rep.acceptance_length, rep.reference_acceptance_length, rep.decoder_agreement,
        )  # fmt: skip
    rep.reused, rep.baseline_reused = reused, baseline_reused
    rep.baseline_cache = str(cache) if cache else None
    rep.target_forwards, rep.baseline_forwards = fwd_trained, fwd_base
    rep.key, rep.key_digest, rep.baseline_key_digest = key, digest(key), bdigest
    rep.plot_path = str(plot_acceptance(rep, Path(export_dir).parent / PLOT))
    rep.elapsed_s = round(time.monotonic() - t0, 3)
    log.info("evaluate: %s", rep.reuse_line())
    update_meta(export_dir, acceptance=rep.to_dict())
    return rep


def _progress_log(what: str, every_s: float = 10.0) -> Callable[[int, int], None]:
    """A log line per prompt, at most one each `every_s` (and the first), with the rate so far: the UI shows that
    evaluation is alive (it takes minutes on CPU)."""
    t0 = time.monotonic()
    last = [-every_s]

    def progress(done: int, total: int) -> None:
        now = time.monotonic() - t0
        if now - last[0] >= every_s or done == 0:
            last[0] = now
            eta = f", ETA {now / done * (total - done):.0f} s" if done else ""
            log.info("evaluate (%s): prompt %d/%d, %.0f s%s", what, done + 1, total, now, eta)

    return progress
