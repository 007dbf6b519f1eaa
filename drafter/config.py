"""Configuration of the drafter stages: training, acceptance evaluation and response regeneration.

Every field has a default that suits the embedded default run; the values from docs/ARCHITECTURE.md
("Field facts": block 16, gamma 7, lr 6e-4, 4% warmup, ~512 anchors per sequence) are the defaults for real
targets.
Sections subclass the pipeline's `Section`, so unknown fields are errors that name the field.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from dflash_pipeline.base import Section


class TrainConfig(Section):
    num_draft_layers: int | None = Field(
        None, ge=1, description="Draft decoder layers; None = one per captured target layer (the DFlash default, 5)."
    )
    block_size: int = Field(
        16,
        ge=2,
        le=64,
        description="Tokens per draft block: the anchor + block_size-1 mask tokens predicted in one forward.",
    )
    sliding_window: int | None = Field(None, ge=1, description="Window (tokens) of sliding-attention layers.")
    sliding_layers: list[int] | None = Field(
        None, description="Draft layer indices that use the sliding window; None with a window set = all layers."
    )
    mask_token: str | int = Field(
        "<|mask|>",
        description="Token (or token id) of the masked block positions; "
        "an id may lie past the tokenizer's vocabulary but inside the embedding.",
    )
    lr: float = Field(6e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_ratio: float = Field(0.04, ge=0, lt=1, description="Share of steps with linear warmup.")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="Cosine decay floor, as a share of lr.")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Gradient clipping; None = off.")
    epochs: float = Field(6.0, gt=0)
    max_steps: int | None = Field(None, ge=1, description="Cap on optimizer steps (overrides epochs if lower).")
    batch_size: int = Field(1, ge=1, description="Sequences per micro-batch per process.")
    grad_accum: int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    pack: bool = Field(
        False,
        description="Lay a micro-batch's batch_size samples one after another in one sequence instead of padding "
        "them to the longest: a block attends to its own sample only, positions restart in each sample, and the "
        "anchors and loss are the padded batch's; no padding is computed and the GEMMs grow with batch_size. For "
        "flex attention (CUDA), which skips the other samples' tiles; sdpa's dense mask makes it slower.",
    )
    anchors_per_sample: int = Field(
        512,
        ge=1,
        description="Blocks per sequence, clipped to the number of "
        "valid anchors (positions whose next token is supervised).",
    )
    gamma: float | None = Field(
        7.0, gt=0, description="Loss weight exp(-(k-1)/gamma) for block position k; None = uniform."
    )
    distill: bool = Field(
        False,
        description="Train on the target's distribution (KL to the logits computed "
        "from the stored last hidden state) instead of the data tokens; needs "
        "layers.capture_last=true in the store.",
    )
    position_weight: Literal["decay", "dpace"] = Field(
        "decay",
        description="Loss weight of block position k: 'decay' = exp(-(k-1)/gamma) (DFlash's recipe); 'dpace' = "
        "D-PACE (speculators' default): the summed chance, from the draft's own detached confidence, that the "
        "block's tokens up to each later position are all accepted (drafter/levers.py). Cross-entropy only.",
    )
    dpace_alpha: float = Field(
        0.5, gt=0, le=1, description="D-PACE's smoothing: confidence (1 - alpha) q + alpha per position."
    )
    optimizer: Literal["adamw", "muon"] = Field(
        "adamw",
        description="'adamw' for every weight; 'muon' = torch.optim.Muon for the 2-D weight matrices (update RMS "
        "matched to AdamW's) and AdamW for the rest (norms).",
    )
    muon_lr: float | None = Field(None, gt=0, description="Learning rate of Muon's matrices; None = train.lr.")
    muon_weight_decay: float = Field(0.1, ge=0, description="Weight decay of Muon's matrices.")
    checkpoint_every: int = Field(200, ge=1, description="Optimizer steps between checkpoints.")
    keep_checkpoints: int = Field(2, ge=1, description="Most recent checkpoints kept on disk.")
    log_every: int = Field(1, ge=1, description="Steps between loss records / progress callbacks.")
    seed: int = 0
    device: str = Field(
        "auto",
        description="'auto' (cuda when available, else cpu), 'cpu' or 'cuda[:N]'. "
        "Under torchrun each process uses cuda:LOCAL_RANK.",
    )
    num_workers: int = Field(2, ge=0, description="DataLoader worker processes (0 = read in the main process).")
    attention: Literal["auto", "sdpa", "flex"] = Field(
        "auto", description="'flex' builds block-sparse masks (CUDA); 'auto' = flex on CUDA when available, else sdpa."
    )
    attention_groups: int = Field(
        1,
        ge=1,
        description="Flex attention only: a row's draft blocks in this many groups, each computed with its own copy "
        "of the context keys. Flex attention's backward loops over every query tile that sees a context key tile in "
        "one program, so with ~512 blocks that loop, not the work, sets its time; groups split it (same result up to "
        "the order of a sum). 1 = off.",
    )
    compile: Literal["auto", "off", "pointwise"] = Field(
        "auto",
        description="torch.compile of the draft layers' element-wise parts (norms, rotary, MLP gate), with dynamic "
        "shapes: 'auto' = pointwise on CUDA, off on CPU (compiling costs more than it saves in short CPU runs).",
    )
    precision: Literal["auto", "fp32", "autocast", "bf16"] = Field(
        "auto",
        description="How the drafter computes: 'fp32' = float32 throughout; 'autocast' = float32 weights under "
        "torch.autocast(bfloat16) (casts every weight and the norms' float32 outputs in every forward); 'bf16' = "
        "float32 master weights in the optimizer and checkpoints, a bfloat16 copy of them that the forward and "
        "backward run on, refreshed once per optimizer step; 'auto' = bf16 on CUDA, fp32 on CPU.",
    )
    output_dir: str | None = Field(
        None,
        description="Checkpoints, export, plot and metrics; None = given by "
        "the caller (the pipeline uses <run output_dir>/drafter).",
    )

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        if self.sliding_layers is not None and self.sliding_window is None:
            raise ValueError(f"train.sliding_layers={self.sliding_layers} needs train.sliding_window (e.g. 2048)")
        if self.sliding_layers and min(self.sliding_layers) < 0:
            raise ValueError(f"train.sliding_layers={self.sliding_layers} holds a negative layer index")
        if self.position_weight == "dpace" and self.distill:
            raise ValueError(
                "train.position_weight=dpace weighs positions by their cross-entropy and train.distill=true trains "
                "on KL instead: set one of them back (train.position_weight=decay or train.distill=false)"
            )
        return self


class EvalConfig(Section):
    prompts: str = Field("embedded", description="'embedded' or a JSONL of {'id', 'messages'} ending with a user turn.")
    num_prompts: int | None = Field(16, ge=1, description="First N prompts; None = all.")
    max_new_tokens: int = Field(64, ge=1)
    temperature: float = Field(0.0, description="Only greedy (0) is measured: acceptance is exact-match.")
    device: str = Field("auto", description="'auto', 'cpu' or 'cuda[:N]'.")
    chat_template_kwargs: dict = Field(
        {},
        description="Passed to apply_chat_template, e.g. "
        "{'enable_thinking': false}; must match how the drafter's data was rendered.",
    )
    slice_by: list[str] = Field(
        [],
        description="Fields of the prompt rows to report acceptance by, each on its own (e.g. ['source'], or "
        "['domain'] on the embedded prompts); every row must have them. Per slice: tau, per-position rates, baseline.",
    )
    baseline: Literal["cached", "always", "off"] = Field(
        "cached",
        description="The untrained drafter's acceptance (the baseline): 'cached' = measured once per target, prompts "
        "and settings and kept in $DFLASH_HOME/baselines (default ~/.cache/dflash-pipeline); 'always' = measured "
        "on every evaluation; 'off' = not measured.",
    )
    baseline_seed: int = Field(0, description="Seed of the untrained drafter's initialization (part of the cache key).")
    reuse: bool = Field(
        True,
        description="Reuse the acceptance stored in the export's dflash_meta.json when the export, the prompts and "
        "these settings are unchanged (a rerun of a finished run evaluates nothing); false = always measure.",
    )
    decoder: Literal["ours", "reference", "both"] = Field(
        "ours",
        description="Which speculative decoder scores the trained drafter: 'ours' (this package's, recomputing the "
        "target each step), 'reference' (z-lab's own `dflash` 0.1.0 `spec_generate`, loading the export as it ships, "
        "greedy, same prompts and block size; needs `pip install --no-deps dflash==0.1.0`), or 'both' (the report "
        "gives both figures and their ratio). The untrained baseline is always scored by ours (docs/INTEROP.md).",
    )

    @model_validator(mode="after")
    def _greedy(self) -> EvalConfig:
        if self.temperature != 0:
            raise ValueError(
                f"evaluate.temperature={self.temperature}: only greedy verification (0) is "
                "implemented; acceptance length is defined here for exact-match verification"
            )
        return self


class RegenerateConfig(Section):
    """The regenerate stage (drafter/regenerate.py): the dataset's assistant turns rewritten by the target, either
    in this process with transformers (`backend: transformers`, the embedded default and small runs) or by a
    serving engine (vLLM, SGLang, `transformers serve`) through its OpenAI-compatible API (`backend: openai`)."""

    enabled: bool = Field(False, description="Regenerate assistant turns with the target before extraction.")
    backend: Literal["transformers", "openai"] = Field(
        "transformers",
        description="'transformers': batched generate in this process; 'openai': requests to an OpenAI-compatible "
        "server (vLLM, SGLang) at base_url that serves the target.",
    )
    # ---- sampling (both backends) ----
    temperature: float = Field(0.0, ge=0, description="0 = greedy; ~0.7 also works well.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling (with temperature > 0).")
    top_k: int | None = Field(
        None, ge=1, description="Top-k sampling; None = not set (not sent to the server: not every server takes it)."
    )
    max_new_tokens: int = Field(
        512, ge=1, description="Per assistant turn (the request's max_tokens); longer ones are cut, see on_truncated."
    )
    seed: int | None = Field(
        0,
        description="Sampling seed. The server gets seed + a per-conversation/turn offset (reproducible whatever the "
        "order); None = no seed sent.",
    )
    turns: Literal["all", "last"] = Field(
        "all",
        description="'all': every assistant turn, each given the regenerated history; 'last': only the final one.",
    )
    chat_template_kwargs: dict = Field(
        {}, description="Chat template arguments for generation (sent to the server too): {'enable_thinking': false}."
    )
    on_truncated: Literal["keep", "drop", "quarantine"] = Field(
        "quarantine",
        description="A conversation with a reply cut by max_new_tokens (finish_reason=length): 'keep' it (marked "
        "in the output), 'drop' it (only its id is recorded, in <output>.rejected.jsonl), or 'quarantine' it (the "
        "whole conversation goes to <output>.rejected.jsonl, not to training). With drop/quarantine the openai backend "
        "does not request the turns after a cut one.",
    )
    reasoning_form: Literal["auto", "field", "inline"] = Field(
        "auto",
        description="Where a reply's reasoning is stored: 'field' = the message's reasoning_content, 'inline' = "
        "'<think>\\n...\\n</think>\\n\\n' before the content; 'auto' = field when the target's chat template reads "
        "reasoning_content, else inline (the form the prepare stage renders).",
    )
    # ---- transformers backend ----
    batch_size: int = Field(16, ge=1, description="transformers backend: conversations generated together.")
    device: str = Field("auto", description="transformers backend: device to generate on ('auto', 'cpu', 'cuda:0').")
    # ---- openai backend ----
    base_url: str = Field(
        "http://127.0.0.1:8000/v1",
        description="openai backend: the server's OpenAI API root (vLLM and SGLang: http://HOST:PORT/v1).",
    )
    model: str | None = Field(
        None,
        description="openai backend: the served model name (vLLM --served-model-name); None = the only model the "
        "server lists.",
    )
    api_key_env: str = Field(
        "OPENAI_API_KEY",
        description="openai backend: environment variable holding the API key (sent as a Bearer token, never logged "
        "or written); unset or empty = no key.",
    )
    extra_body: dict = Field(
        {},
        description="openai backend: extra request fields passed through as they are, e.g. {'repetition_penalty': "
        "1.05, 'min_p': 0.0, 'skip_special_tokens': false}.",
    )
    concurrency: int = Field(
        64, ge=1, description="openai backend: conversations in flight (one request each) - the server batches them."
    )
    request_timeout_s: float = Field(
        1800.0, gt=0, description="openai backend: seconds one request may take (long thinking replies)."
    )
    max_retries: int = Field(
        8,
        ge=0,
        description="openai backend: retries of a request after a timeout, connection error, 429 or 5xx "
        "(exponential backoff with jitter, Retry-After honoured); other 4xx are never retried.",
    )
    retry_max_wait_s: float = Field(60.0, gt=0, description="openai backend: longest wait between two retries.")
    server_wait_s: float = Field(
        60.0,
        ge=0,
        description="openai backend: how long to wait at start for the server to answer (one still loading) "
        "before failing with an error that names base_url.",
    )

    @model_validator(mode="after")
    def _check_extra_body(self) -> RegenerateConfig:
        reserved = {"model", "messages", "stream", "n"} & set(self.extra_body)
        if reserved:
            raise ValueError(
                f"regenerate.extra_body sets {sorted(reserved)}, which the stage sets itself (model: regenerate.model; "
                "one non-streamed reply per request): remove them"
            )
        return self
