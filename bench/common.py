"""What the benchmarks share: model shapes built from configs with random weights, synthetic prepared
samples, and a store planned for them (without a `datasets` directory). Used by extract_bench.py and
multi_gpu_bench.py."""

from __future__ import annotations

import json
import math
import struct
import time
from pathlib import Path

import numpy as np
import torch

SHAPES = {
    "8b": dict(
        model_type="qwen3",
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1e6,
        tie_word_embeddings=False,
    ),
    "27b": dict(
        model_type="qwen3_5_text",
        vocab_size=248320,
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=64,
        num_attention_heads=24,
        num_key_value_heads=4,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        linear_conv_kernel_dim=4,
        tie_word_embeddings=False,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(64)],
    ),
    "tiny-dense": dict(
        model_type="qwen3",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=False,
    ),
    "tiny-hybrid": dict(
        model_type="qwen3_5_text",
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        tie_word_embeddings=False,
        layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(8)],
    ),
}


def profile_table(prof) -> str:
    """A torch.profiler run as a table, the GPU's time first (kernels by their own time)."""
    sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    return prof.key_averages().table(sort_by=sort, row_limit=45, max_name_column_width=60)


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def make_config(shape: str):
    from transformers import AutoConfig

    spec = dict(SHAPES[shape])
    return AutoConfig.for_model(spec.pop("model_type"), **spec)


def build_model(shape: str, device: str, dtype: torch.dtype):
    """Random weights, initialised directly on the device in `dtype` (no host copy of a 54 GB model)."""
    from transformers import AutoModelForCausalLM

    cfg = make_config(shape)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg)
    finally:
        torch.set_default_dtype(old)
    p0 = next(model.parameters())
    if p0.device.type != torch.device(device).type or p0.dtype != dtype:
        log(f"{shape}: built on {p0.device} in {p0.dtype}; moving")
        model = model.to(device=device, dtype=dtype)
    model.eval()
    model.requires_grad_(False)
    return model


def write_manifest_checkpoint(model, path: Path) -> None:
    """config.json + a sparse model.safetensors: a valid header for every tensor, data left unwritten."""
    path.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(path)
    names = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.float8_e4m3fn: "F8_E4M3"}
    header, off = {"__metadata__": {"format": "pt"}}, 0
    for name, t in model.state_dict().items():
        n = t.numel() * t.element_size()
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + off)


def synthetic_samples(n_tokens: int, vocab: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    lengths, total = [], 0
    while total < n_tokens:
        t = int(np.clip(rng.lognormal(math.log(900), 0.75), 200, 4096))
        lengths.append(t)
        total += t
    ids = [rng.integers(10, vocab - 1, size=t, dtype=np.int32) for t in lengths]
    return [f"s{i:07d}" for i in range(len(lengths))], lengths, ids


def plan_store(root: Path, report, cfg, sample_ids, lengths, ids, dtype_name: str):
    from dflash_pipeline.extraction.plan import target_identity
    from dflash_pipeline.storage.planning import plan_units
    from dflash_pipeline.storage.store import Store

    # The identity keys of extraction/plan.py:provenance (the rest needs a prepared dataset; this bench has
    # in-memory samples instead).
    prov = target_identity(cfg, report, dtype_name)
    store = Store(root)
    version = store.resolve_version(prov, "bench-dataset", new_version=True, incremental=False)
    x = cfg.extract

    def fetch(rows):
        return [ids[i] for i in rows], [np.ones(lengths[i], np.uint8) for i in rows]

    plan = plan_units(
        store, version, sample_ids, lengths, fetch, x.unit_tokens, x.chunk_mib, x.shard_mib, x.compression
    )
    return store, version, [u.name for u in plan.pending_units]


def publish_store(root: Path, version: str, cfg, sample_ids, lengths, ids) -> None:
    """Validate a bench store's version and make it CURRENT, as run_pipeline does after extraction
    (stages.validate records the report in validation.json; CURRENT moves only when it passed): training reads
    only a validated version. The synthetic samples (plan_store's, every token supervised), saved beside the store
    as a prepared dataset, stand in for prepare's; no recompute check (it would load the target beside the GPU
    memory the bench measures; the states are the extraction's own forward)."""
    import datasets

    from dflash_pipeline.dataprep.prepare import PrepareResult
    from dflash_pipeline.extraction.validate import raise_if_failed, validate_store
    from dflash_pipeline.storage.layout import VALIDATION
    from dflash_pipeline.storage.store import Store

    path = Path(root).parent / f"{Path(root).name}-prepared"
    rows = {"sample_id": sample_ids, "input_ids": [x.tolist() for x in ids], "loss_mask": [[1] * n for n in lengths]}
    datasets.Dataset.from_dict(rows).save_to_disk(str(path))
    n, tokens = len(sample_ids), sum(lengths)
    prepared = PrepareResult("bench", str(path), "synthetic", n, n, tokens, tokens, 1)
    store = Store(root)
    t0 = time.perf_counter()
    report = validate_store(store, version, prepared, cfg.validate_.model_copy(update={"recompute_samples": 0}))
    store.loc.write_atomic(f"{version}/{VALIDATION}", json.dumps(report.to_dict(), indent=1).encode())
    raise_if_failed(report)
    store.set_current(version)
    log(f"store {root}: validated and published {version} in {time.perf_counter() - t0:.0f} s")


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def bench_probe(cfg):
    """The pipeline's probe on a bench checkpoint. Bench checkpoints have no tokenizer; the embedded target's
    stands in (the samples are synthetic ids, so it only supplies the pad id and passes the tokenizer check)."""
    from dflash_pipeline.embedded import resolve_model
    from dflash_pipeline.extraction.probe import probe

    return probe(cfg.target, cfg.layers, cfg.extract, cfg.target.model_path, resolve_model("embedded"))


def saved_target(shape: str, device: str, dtype_name: str, work: Path, overrides: dict):
    """A random-weight target of `shape` saved under work/model (so worker processes and the training's head
    loader read it from disk), the pipeline config for it with `overrides`, and the probe's report:
    (cfg, report, vocab_size)."""
    from dflash_pipeline.config import load_config

    t = time.monotonic()
    model = build_model(shape, device, getattr(torch, dtype_name))
    vocab = model.config.vocab_size
    model.save_pretrained(work / "model")
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    log(f"target built and saved in {time.monotonic() - t:.1f} s")
    base = {"output_dir": str(work), "target.model_path": str(work / "model"), "target.dtype": dtype_name}
    cfg = load_config(None, {**base, **overrides})
    return cfg, bench_probe(cfg), vocab


def worker_spec(store_root, version: str, units: list[str], report, cfg, dtype_name: str, device: str, writers=None):
    """The WorkerSpec the pipeline would hand this device."""
    from dflash_pipeline.extraction.spec import WorkerSpec

    return WorkerSpec(
        store_root=str(store_root),
        version=version,
        units=list(units),
        report=report,
        extract=cfg.extract,
        store_dtype=dtype_name,
        device=device,
        threads=1,
        writers=writers,
    )
