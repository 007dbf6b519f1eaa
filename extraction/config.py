"""The extraction stages' configuration sections (target, layers, extract, validate): part of the run's configuration
(core/config.py composes RunConfig from them), kept beside the code that reads them."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from dflash_pipeline.base import Section

# token_budget "auto": at most this many (bench/RESULTS.md run 5: on an H200, 32k- and 64k-token batches
# were slower end to end than 16k: fewer, longer batches overlap the GPU with the writer less).
AUTO_TOKEN_BUDGET_MAX = 16384


class TargetConfig(Section):
    model_path: str = Field("embedded", description="'embedded' or a local HF checkpoint directory.")
    tokenizer_path: str | None = Field(None, description="Defaults to model_path.")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="'auto': bfloat16 on GPU, float32 on CPU."
    )
    attn_implementation: str | None = Field(
        None, description="e.g. 'sdpa', 'flash_attention_2'; None = library default."
    )
    trust_remote_code: bool = Field(
        False,
        description="Let transformers run Python code shipped with the checkpoint (models it does not know). "
        "Only for checkpoints you trust; applies to every load of the model and its tokenizer.",
    )
    quantization: Literal["auto", "dequantize"] = Field(
        "auto",
        description="A quantized checkpoint (config.json quantization_config; block-wise FP8): 'auto' runs its FP8 "
        "forward (torch's FP8 GEMM on GPUs of compute capability >= 8.9, emulated with the same states elsewhere); "
        "'dequantize' loads its weights dequantized to target.dtype, whose states differ from the FP8 model's (the "
        "store records which). Ignored for unquantized checkpoints.",
    )


class LayersConfig(Section):
    preset: Literal["dflash", "eagle3", "explicit"] = Field("dflash", description="How to choose layers.")
    num_draft_layers: int = Field(5, ge=1, description="dflash preset: one target layer per draft layer.")
    ids: list[int] | None = Field(None, description="explicit preset: decoder-layer indices (output of layer i).")
    capture_last: bool = Field(
        False,
        description="Also store the last decoder layer's pre-norm output (for distillation from the target's logits).",
    )

    @model_validator(mode="after")
    def _ids_with_explicit(self) -> LayersConfig:
        if self.preset == "explicit" and not self.ids:
            raise ValueError("layers.preset is 'explicit' but layers.ids is empty: give e.g. layers.ids=[1,3,5]")
        if self.preset != "explicit" and self.ids:  # a preset chooses its own layers: the ids would go unused
            raise ValueError(
                f"layers.ids={self.ids} is only read with layers.preset=explicit (now {self.preset!r}, which "
                "chooses its own layers): add layers.preset=explicit to capture these, or drop layers.ids"
            )
        return self


class ExtractConfig(Section):
    devices: str = Field(
        "auto",
        description="'auto' (every visible GPU, else one CPU worker), 'cpu', "
        "or a comma list like 'cuda:0,cuda:1' ('cpu:0,cpu:1' = two CPU workers).",
    )
    isolation: Literal["process", "thread"] = Field(
        "process",
        description="Run each device's worker in its own process (a hung or crashed worker is "
        "killed and retried alone) or in a thread of the flow process.",
    )
    engine: Literal["local", "ray"] = Field(
        "local",
        description="'local': one worker per device of this "
        "host; 'ray': one worker per GPU of a Ray cluster (prefect-ray).",
    )
    ray_address: str | None = Field(
        None, description="Ray cluster to join ('auto' or ray://host:10001); None starts a local Ray instance."
    )
    ray_workers: int = Field(0, ge=0, description="Ray workers; 0 = one per GPU in the cluster.")
    ray_cpus_per_worker: int = Field(1, ge=1, description="CPUs per Ray worker when the cluster has no GPUs.")
    worker_timeout_s: float | None = Field(
        None,
        gt=0,
        description="Kill and retry a worker process that runs longer than this (a hung GPU); None = no limit.",
    )
    gpus_per_replica: int = Field(
        0,
        ge=0,
        description="GPUs one copy of the target spans (its layers split "
        "across them with a transformers device_map). 0 = the probe decides: one "
        "GPU per copy when it fits, else the fewest GPUs that hold one.",
    )
    max_gpu_memory_gib: float | None = Field(
        None,
        gt=0,
        description="Plan with at most this much memory "
        "per GPU (default: its free memory), e.g. to leave room for "
        "other processes.",
    )
    token_budget: Annotated[int, Field(ge=16)] | Literal["auto"] = Field(
        "auto",
        description="Max padded tokens per forward batch. 'auto': sized by the probe from the GPU "
        f"memory left after the weights, at most {AUTO_TOKEN_BUDGET_MAX}.",
    )
    unit_tokens: int = Field(
        1_000_000,
        ge=16,
        description="Tokens per work unit (the unit of assignment "
        "and of completion; a crash redoes at most one store shard of one unit).",
    )
    shard_mib: float = Field(128.0, gt=0, description="Target size of one store shard file (MiB, raw).")
    chunk_mib: float = Field(4.0, gt=0, description="Target size of one compressed chunk inside a shard (MiB).")
    compression: Literal["zstd", "lz4", "none"] = Field("zstd", description="Codec for hidden states.")
    compile: Literal["auto", "off", "norms", "parts", "layers"] = Field(
        "auto",
        description="torch.compile parts of the target for fused kernels: 'norms' (every RMSNorm, gated ones "
        "too), 'parts' (norms and each decoder layer's MLP), 'layers' (each decoder layer whole), 'off'. 'auto' "
        "on a GPU with triton: 'layers' for an all-softmax-attention target, 'parts' for a hybrid (linear "
        "attention); else 'off'. "
        "A compile failure falls back to the eager forward with a warning.",
    )
    conv_kernel: Literal["auto", "fla", "transformers"] = Field(
        "auto",
        description="Causal convolution of a hybrid target's Gated DeltaNet layers: 'fla' (flash-linear-attention's "
        "Triton kernel, ~10% faster end to end on the 27B shape), 'transformers' (its own choice: the causal-conv1d "
        "package if installed, else PyTorch). 'auto': 'fla' on a GPU with flash-linear-attention installed.",
    )
    gdn_forward: Literal["auto", "fused", "transformers"] = Field(
        "auto",
        description="Forward of a hybrid target's Gated DeltaNet layers: 'fused' (ours, on flash-linear-attention's "
        "kernels: the Triton convolution on the projection's own layout, grouped value heads, one fused gated "
        "RMSNorm; same computation as transformers'), 'transformers' (the model class's own forward, where "
        "extract.conv_kernel applies). 'auto': 'fused' for a Qwen3.5/3.6 target on GPUs with "
        "flash-linear-attention >= 0.5 installed, else 'transformers'.",
    )
    store_writers: Literal["auto", "processes", "threads"] = Field(
        "auto",
        description="Where shards are compressed and written: 'processes' (separate writer processes "
        "fed through shared memory in /dev/shm, so they never hold up the GPU's feeder thread), 'threads' (in "
        "the worker process), 'auto' = processes for a GPU worker, threads for a CPU one.",
    )
    store_dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto", description="'auto' = the model's compute dtype."
    )
    store_precision: Literal["full", "fp8", "int8", "int4"] = Field(
        "full",
        description="How hidden states are stored: 'full' (in store_dtype, bit-exact), 'fp8' (e4m3 with one "
        "float32 scale per token row and layer: about half the bytes of bf16), 'int8' (symmetric, a step per group "
        "of 32 channels: 0.52 of bf16, the closest compact precision), 'int4' (the same steps, two values a byte: "
        "0.27 of bf16). "
        "Compact rows are quantized on the GPU and dequantized into store_dtype on read "
        "(docs/STORE.md, 'Compact precisions'); a store version holds one precision.",
    )
    io_retries: int = Field(5, ge=1, description="Attempts for a store write before giving up.")
    task_retries: int = Field(2, ge=0, description="Prefect retries of a crashed worker (it resumes).")
    new_version: bool = Field(
        False, description="If the store holds another model/layer set, start a new store version instead of failing."
    )
    incremental: bool = Field(
        False,
        description="Allow adding new dataset rows to an existing store "
        "version (the nightly run); otherwise another dataset is an error. A published (CURRENT) version is never "
        "changed: the rows go into a new version sharing its units (hard links), published once validated; a drafter "
        "trained on the old version then trains again from step 0 on the new one.",
    )
    keep_versions: int = Field(
        3,
        ge=1,
        description="Store versions kept after a successful validation; older ones are pruned (CURRENT never is).",
    )


class ValidateConfig(Section):
    recompute_samples: int = Field(
        4,
        ge=0,
        description="Samples re-run with a fresh batch-1 forward, plus one of each unit changed since the last "
        "validation.",
    )
    seed: int = 0
    max_zero_row_fraction: float = Field(0.0, ge=0, le=1, description="Allowed share of all-zero token rows.")
