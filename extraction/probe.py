"""Compatibility probe: what the installed libraries and the target model can do, measured not assumed.

This is the one place that looks at library versions; everything downstream reads the ProbeReport
(e.g. the loader takes `dtype_kwarg` from it).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import platform
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash_pipeline.errors import CompatError, ConfigError
from dflash_pipeline.extraction import quantized
from dflash_pipeline.extraction.config import AUTO_TOKEN_BUDGET_MAX, ExtractConfig, LayersConfig, TargetConfig
from dflash_pipeline.extraction.kernels import conv_kernel_choice, fla_version, gdn_forward_choice
from dflash_pipeline.extraction.layers import select_layer_ids
from dflash_pipeline.extraction.modelfiles import read_model_config, weights_bytes
from dflash_pipeline.extraction.placement import plan_replicas, replica_devices
from dflash_pipeline.handoff import Handoff
from dflash_pipeline.progress import short
from dflash_pipeline.storage.commit import write_atomic

log = logging.getLogger(__name__)
GDN_PADDING_FIXED = "5.15.0"  # first transformers release where padded batches through GDN layers are right
GIB = 2**30
# Storage libraries this release is tested with (CI: zarr 3.1.x on Python 3.11, the newest 3.x on 3.12). The
# store's shard writer reads zarr's codec objects, whose shapes changed between 3.1 and 3.2 (BytesCodec.endian:
# an enum, then a str); outside this range it is untested and refused.
TESTED_STORAGE = {"zarr": ("3.1.6", "4"), "numcodecs": ("0.16", "1")}  # = pyproject.toml


@dataclass
class DeviceInfo:
    name: str
    kind: str
    total_gib: float
    free_gib: float


@dataclass
class ProbeReport(Handoff):
    """What the installed libraries and the target can do, and how to load the target: every process that
    loads the model or its tokenizer (extraction workers, validation, training, evaluation, regeneration)
    loads it from this record, so no stage can pick another path, dtype keyword or trust_remote_code."""

    KIND = "probe-report"
    VERSION = 3

    python: str
    torch_version: str
    transformers_version: str
    dtype_kwarg: str
    kernels: dict[str, bool]
    attn_implementations: list[str]
    model_path: str  # absolute, resolved once in the parent (dflash_pipeline.specs.resolve_target)
    tokenizer_path: str  # absolute; the model's directory unless target.tokenizer_path is set
    trust_remote_code: bool
    attn_implementation: str | None
    pad_id: int  # the tokenizer's pad token, else its EOS, else 0
    architecture: str
    model_type: str
    num_layers: int
    hidden_size: int
    layer_types: list[str]
    layer_ids: list[int]
    layer_preset: str
    capture_last: bool
    compute_dtype: str
    devices: list[DeviceInfo]
    weights_gib: float
    working_gib: float
    placement: str
    warnings: list[str] = field(default_factory=list)
    # One entry per worker: a device, or GPUs joined by '+' that share one split replica (target/placement.py).
    replicas: list[str] = field(default_factory=list)
    token_budget: int = AUTO_TOKEN_BUDGET_MAX  # padded tokens per forward batch (extract.token_budget, resolved)
    conv_kernel: str = "transformers"  # extract.conv_kernel resolved (extraction/kernels.py)
    gdn_forward: str = "transformers"  # extract.gdn_forward resolved (extraction/kernels.py)
    max_gpu_memory_gib: float | None = None  # extract.max_gpu_memory_gib: the per-GPU cap the plan used
    # A quantized checkpoint (extraction/quantized.py): its quantization_config normalized, plus `forward`, how the
    # run executes it ("fp8": its own FP8 forward; "dequantized": weights dequantized at load). None: unquantized.
    quantization: dict | None = None

    @property
    def hybrid(self) -> bool:
        return "linear_attention" in self.layer_types

    def _quantization_line(self) -> str:
        q = self.quantization
        if not q:
            return "none"
        how = q["forward"] + (f" ({q['fp8_matmul']})" if q.get("fp8_matmul") else "")
        return f"{q['method']} (blocks {q['weight_block_size']}, activations {q['activation_scheme']}) / {how}"

    def to_markdown(self) -> str:
        kinds = ", ".join(f"{k}: {'yes' if v else 'no'}" for k, v in self.kernels.items())
        types = [f"{i}:{'GDN' if t == 'linear_attention' else 'full'}" for i, t in enumerate(self.layer_types)]
        captured = ", ".join(
            f"{i} ({'GDN' if self.layer_types[i] == 'linear_attention' else 'full'})" for i in self.layer_ids
        )
        devs = "\n".join(f"| {d.name} | {d.kind} | {d.total_gib:.1f} | {d.free_gib:.1f} |" for d in self.devices)
        warn = "\n".join(f"- {w}" for w in self.warnings) or "- none"
        return f"""# Compatibility probe

| item | value |
| --- | --- |
| python / torch / transformers | {self.python} / {self.torch_version} / {self.transformers_version} |
| dtype keyword (probed) | `{self.dtype_kwarg}` |
| kernels importable | {kinds} |
| attention implementations | {", ".join(self.attn_implementations)} |
| model | `{self.model_path}` ({self.architecture}, {self.model_type}) |
| layers / hidden | {self.num_layers} / {self.hidden_size} |
| layer types | {" ".join(types)} |
| captured layers ({self.layer_preset}) | {captured}{" + last pre-norm" if self.capture_last else ""} |
| compute dtype | {self.compute_dtype} |
| placement | {self.placement} |
| weights / working memory per replica | {self.weights_gib:.2f} GiB / {self.working_gib:.2f} GiB |
| tokens per forward batch | {self.token_budget} |
| Gated DeltaNet forward / causal convolution | {self.gdn_forward} / {self.conv_kernel} |
| checkpoint quantization / forward | {self._quantization_line()} |

## Devices
| device | kind | total GiB | free GiB |
| --- | --- | --- | --- |
{devs}

## Warnings
{warn}
"""


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


_DTYPE_KWARG: str | None = None


def probe_dtype_kwarg() -> str:
    """Load a micro checkpoint with `dtype=` and then `torch_dtype=`; the first that takes effect without a
    deprecation message wins. (Both travel through **kwargs, so a signature check cannot tell.)"""
    global _DTYPE_KWARG
    if _DTYPE_KWARG:
        return _DTYPE_KWARG
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    class _Grab(logging.Handler):
        def __init__(self):
            super().__init__()
            self.messages: list[str] = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    cfg = LlamaConfig(
        vocab_size=16,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
    )
    accepted_with_warning = None
    with tempfile.TemporaryDirectory() as d:
        LlamaForCausalLM(cfg).save_pretrained(d)
        hf_logger = hf_logging.get_logger("transformers")
        for kw in ("dtype", "torch_dtype"):
            grab = _Grab()
            hf_logger.addHandler(grab)
            try:
                m = AutoModelForCausalLM.from_pretrained(d, **{kw: torch.float16})
            except TypeError:
                continue
            finally:
                hf_logger.removeHandler(grab)
            if next(m.parameters()).dtype != torch.float16:
                continue
            if any("deprecat" in s.lower() for s in grab.messages):
                accepted_with_warning = accepted_with_warning or kw
                continue
            _DTYPE_KWARG = kw
            return kw
    if accepted_with_warning:
        _DTYPE_KWARG = accepted_with_warning
        return accepted_with_warning
    raise CompatError(
        "this transformers accepts neither dtype= nor torch_dtype= in from_pretrained; install transformers>=5.15"
    )


def check_storage_libraries() -> dict[str, str]:
    """The installed zarr / numcodecs versions; a CompatError naming them when outside the tested range."""
    import importlib.metadata as md

    found = {}
    for pkg, (low, high) in TESTED_STORAGE.items():
        v = found[pkg] = md.version(pkg)
        if not _version_tuple(low) <= _version_tuple(v) < _version_tuple(high):
            raise CompatError(
                f"{pkg} {v} is installed; dflash-pipeline is tested with {pkg}>={low},<{high} (its store writer "
                f"reads {pkg}'s codec objects). Install a tested version: pip install '{pkg}>={low},<{high}'"
            )
    return found


def _importable(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def resolve_devices(spec: str) -> list[str]:
    n = torch.cuda.device_count()
    if spec == "auto":
        return [f"cuda:{i}" for i in range(n)] or ["cpu"]
    out = []
    for d in (x.strip() for x in spec.split(",") if x.strip()):
        if d == "cpu" or (d.startswith("cpu:") and d[4:].isdigit()):
            out.append(d)
        elif d.startswith("cuda:") and d[5:].isdigit():
            if int(d[5:]) >= n:
                raise ConfigError(
                    f"extract.devices asks for {d}, but only {n} GPU(s) are visible "
                    f"(CUDA_VISIBLE_DEVICES and the driver decide); valid: "
                    f"{', '.join(f'cuda:{i}' for i in range(n)) or 'cpu'}"
                )
            out.append(d)
        else:
            raise ConfigError(f"extract.devices entry {d!r} is not 'cpu', 'cpu:N' or 'cuda:N'")
    if len(set(out)) != len(out):
        raise ConfigError(f"extract.devices lists a device twice: {spec!r}")
    return out or ["cpu"]


def _device_info(name: str) -> DeviceInfo:
    if name.startswith("cpu"):
        import os

        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        avail = os.sysconf("SC_AVPHYS_PAGES") * size
        return DeviceInfo(name, platform.processor() or "cpu", pages * size / GIB, avail / GIB)
    free, total = torch.cuda.mem_get_info(torch.device(name))
    return DeviceInfo(name, torch.cuda.get_device_name(torch.device(name)), total / GIB, free / GIB)


def auto_token_budget(usable: dict[str, float], weights: float, per_token: float) -> int:
    """extract.token_budget='auto': the batch whose working set takes at most 80% of the memory the
    smallest GPU has left after a whole replica's weights, in steps of 1024, between 2048 and
    AUTO_TOKEN_BUDGET_MAX (larger batches were slower: bench/RESULTS.md). CPU: AUTO_TOKEN_BUDGET_MAX.
    A target too large for one GPU gets 8192 (its split replicas keep that much working memory per GPU)."""
    gpus = [v for d, v in usable.items() if d.startswith("cuda")]
    if not gpus:
        return AUTO_TOKEN_BUDGET_MAX
    spare = min(gpus) - weights
    if spare < 2048 * per_token:
        return 8192
    return int(min(AUTO_TOKEN_BUDGET_MAX, 0.8 * spare / per_token)) // 1024 * 1024


def compute_dtype(cfg: TargetConfig, devices: list[str]) -> str:
    if cfg.dtype != "auto":
        return cfg.dtype
    return "bfloat16" if all(d.startswith("cuda") for d in devices) else "float32"


# What the probe and every later stage read from the target's config.json (its language model's part): a config
# without them ended in `KeyError: 'num_hidden_layers'` twice, a traceback in the task and one in the flow.
REQUIRED_CONFIG = {
    "num_hidden_layers": "its number of layers",
    "hidden_size": "its hidden size",
    "num_attention_heads": "its attention heads",
    "vocab_size": "its vocabulary size",
}


def text_config(mc: dict, model_path: str) -> dict:
    """The language model's part of a checkpoint's config.json (multimodal checkpoints, qwen3_5, nest it under
    `text_config`), holding every REQUIRED_CONFIG key as a positive integer; else a CompatError naming the file,
    what is missing and the fix."""
    cfg = Path(model_path) / "config.json"
    nested = isinstance(mc, dict) and isinstance(mc.get("text_config"), dict) and bool(mc["text_config"])
    text = mc["text_config"] if nested else mc
    if not isinstance(text, dict):
        raise CompatError(
            f"{cfg} is not a JSON object: not a HF checkpoint's config; re-download the checkpoint (or give the "
            "directory of one as target.model_path)"
        )
    bad = [k for k in REQUIRED_CONFIG if type(text.get(k)) is not int or text[k] <= 0]
    if bad:
        where = " (in its text_config)" if nested else ""
        said = ", ".join(f"{k}: {short(text[k])}" for k in bad if k in text)
        raise CompatError(
            f"{cfg} does not give {', '.join(bad)}{where} as positive integers "
            f"({'; '.join(REQUIRED_CONFIG[k] for k in bad)}{f'; it has {said}' if said else ''}): not a causal "
            "language model's config, or a damaged one: re-download the checkpoint (its config.json comes with "
            "the weights), or give the directory of a complete checkpoint as target.model_path"
        )
    return text


def probe(
    target: TargetConfig, layers: LayersConfig, extract: ExtractConfig, model_path: str, tokenizer_path: str
) -> ProbeReport:
    """`model_path` and `tokenizer_path`: absolute local directories (dflash_pipeline.specs.resolve_target)."""
    import transformers

    from dflash_pipeline.extraction.tokenizer import load_tokenizer, pad_token_id

    mc = read_model_config(model_path)
    field = "target.tokenizer_path" if target.tokenizer_path else "target.model_path"
    tok = load_tokenizer(tokenizer_path, target.trust_remote_code, field)
    text = text_config(mc, model_path)
    num_layers, hidden = text["num_hidden_layers"], text["hidden_size"]
    layer_types = list(text.get("layer_types") or ["full_attention"] * num_layers)
    ids = select_layer_ids(layers, num_layers)
    warnings: list[str] = []
    hybrid = "linear_attention" in layer_types
    check_storage_libraries()
    if hybrid and _version_tuple(transformers.__version__) < _version_tuple(GDN_PADDING_FIXED):
        raise CompatError(
            f"{model_path} has Gated DeltaNet (linear_attention) layers and transformers "
            f"{transformers.__version__} computes padded batches through them wrongly (silently). "
            f"Install transformers>={GDN_PADDING_FIXED}: pip install 'transformers>={GDN_PADDING_FIXED}'"
        )
    kernels = {
        name: _importable(mod)
        for name, mod in (
            ("flash-linear-attention", "fla"),
            ("causal-conv1d", "causal_conv1d"),
            ("flash-attn", "flash_attn"),
            ("accelerate", "accelerate"),
        )
    }
    gpu_run = any(d.startswith("cuda") for d in resolve_devices(extract.devices))
    if hybrid and not kernels["flash-linear-attention"] and gpu_run:  # a CPU run has no GPU kernel to miss
        warnings.append(
            "flash-linear-attention is not installed: GDN layers use the PyTorch fallback "
            "(correct, ~35% slower on GPU). pip install flash-linear-attention"
        )
    attn = ["eager", "sdpa"] + (["flash_attention_2"] if kernels["flash-attn"] else [])
    devices = resolve_devices(extract.devices)
    on_gpus = all(d.startswith("cuda") for d in devices)
    quant, quant_warnings = quantized.resolve(
        quantized.checkpoint_quantization(mc, model_path), target.quantization, devices, model_path
    )
    warnings += quant_warnings
    dtype = compute_dtype(target, devices)
    bpe = torch.finfo(getattr(torch, dtype)).bits // 8
    w_bytes = weights_bytes(model_path, bpe, fp8_stays=bool(quant) and quant["forward"] == "fp8")
    inter = int(text.get("intermediate_size", 4 * hidden))
    # Peak working set of one forward per token: the MLP's three intermediate activations and a few
    # hidden-size buffers, plus the captured layers; 1.3x for allocator slack.
    per_token = (3 * inter + 8 * hidden + len(ids) * hidden) * bpe * 1.3
    infos = [_device_info(d) for d in devices]
    cap = extract.max_gpu_memory_gib if extract.max_gpu_memory_gib is not None else float("inf")
    usable = {d.name: (min(d.free_gib, cap) if d.name.startswith("cuda") else d.free_gib) * GIB for d in infos}
    budget = extract.token_budget
    if budget == "auto":
        budget = auto_token_budget(usable, w_bytes, per_token)
    working = budget * per_token
    replicas, placed = plan_replicas(
        usable, w_bytes, working, extract.gpus_per_replica, kernels["accelerate"], model_path
    )
    warnings += placed
    split = any("+" in r for r in replicas)
    placement = (
        f"{len(replicas)} replica(s), each split across {len(replica_devices(replicas[0]))} GPUs by "
        f"layers: {'; '.join(replicas)}"
        if split
        else f"one replica per device on {len(replicas)} device(s): {', '.join(replicas)}"
    )
    return ProbeReport(
        python=platform.python_version(),
        torch_version=torch.__version__,
        transformers_version=transformers.__version__,
        dtype_kwarg=probe_dtype_kwarg(),
        kernels=kernels,
        attn_implementations=attn,
        model_path=model_path,
        tokenizer_path=tokenizer_path,
        trust_remote_code=target.trust_remote_code,
        attn_implementation=target.attn_implementation,
        pad_id=pad_token_id(tok),
        architecture=(mc.get("architectures") or ["?"])[0],
        model_type=mc.get("model_type", "?"),
        num_layers=num_layers,
        hidden_size=hidden,
        layer_types=layer_types,
        layer_ids=ids,
        layer_preset=layers.preset,
        capture_last=layers.capture_last,
        compute_dtype=dtype,
        devices=infos,
        weights_gib=w_bytes / GIB,
        working_gib=working / GIB,
        placement=placement,
        warnings=warnings,
        replicas=replicas,
        token_budget=budget,
        conv_kernel=conv_kernel_choice(extract.conv_kernel, hybrid, kernels["flash-linear-attention"], on_gpus),
        gdn_forward=gdn_forward_choice(extract.gdn_forward, hybrid, mc.get("model_type", "?"), fla_version(), on_gpus),
        max_gpu_memory_gib=extract.max_gpu_memory_gib,
        quantization=quant,
    )


def save_report(report: ProbeReport, path: Path) -> None:
    # for people; processes get to_json(). Atomic: runs sharing an output_dir write it at once.
    write_atomic(Path(path), json.dumps(report.to_dict(), indent=2).encode())
