"""The pipeline's configuration: one validated object per stage, loaded from YAML + `key=value` overrides. The
sections live beside the code that reads them (dataprep/, extraction/, drafter/config.py); the planner's and
retention's are here, with RunConfig, which composes them.

Every field has a default, so an empty config runs the embedded default end to end. Errors name the
field and the bad value (pydantic's messages, reformatted in `load_config`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dflash_pipeline.base import Section
from dflash_pipeline.dataprep.config import DataConfig
from dflash_pipeline.drafter.config import EvalConfig, RegenerateConfig, TrainConfig
from dflash_pipeline.errors import ConfigError
from dflash_pipeline.extraction.config import ExtractConfig, LayersConfig, TargetConfig, ValidateConfig

STAGES = ["regenerate", "prepare", "probe", "extract", "validate", "train", "evaluate"]
# store_options keys that hold credentials (s3fs / botocore names): refused, see RunConfig._no_secrets.
SECRET_OPTION_KEYS = {
    "key",
    "secret",
    "token",
    "password",
    "access_key",
    "secret_key",
    "session_token",
    "aws_access_key_id",
    "aws_secret_access_key",
    "aws_session_token",
}


class PlanConfig(Section):
    """The pre-flight plan (`dflash-pipeline plan`, and `run` before extraction): core/planner.py."""

    disk_check: bool = Field(
        True,
        description="Refuse to start extraction when the planned store does not fit the free space of its disk. "
        "false: start anyway (a full disk then stops the extraction with an error; a rerun resumes).",
    )
    disk_quota_gib: float | None = Field(
        None,
        gt=0,
        description="Space the store may take on its disk (GiB), e.g. a quota the filesystem's free space does "
        "not show; null = the free space of the store's filesystem.",
    )
    gpu: str = Field(
        "auto",
        description="GPU type the GPU-hours are estimated for ('H200', 'H100', 'A100', ...); 'auto' = the "
        "first visible GPU.",
    )
    gpus: int = Field(
        0,
        ge=0,
        description="GPUs the plan's GPU cost is for (extraction: one worker per GPU; training: data-parallel "
        "torchrun); their scaling is the measured multi-GPU efficiency where a bench recorded one, else linear and "
        "said to be assumed. 0 = the GPU workers extract.devices gives here (1 when there is no GPU).",
    )
    calibration: Literal["auto", "forward", "synthetic"] = Field(
        "auto",
        description="Rows the bytes per token are measured on: 'forward' = the target's own hidden states "
        "(extraction on the CPU), 'synthetic' = Gaussian rows with log-normal channel scales; 'auto' = forward "
        "for targets up to 2 GiB of weights.",
    )
    calibration_tokens: int = Field(
        4096, ge=1, description="Tokens of randomly picked prepared samples written to measure bytes per token."
    )
    write_test_mib: int = Field(
        0,
        ge=0,
        description="MiB written to the store's directory (O_DIRECT where supported, else fsync'd; then removed) to "
        "measure the disk's sustained write bandwidth, which the plan compares with the bytes per second each "
        "store precision would produce: which ones keep extraction GPU-bound, how long each takes, which to use. "
        "A few GB (e.g. 4096) measure a fresh cloud disk; 0 = skip (local stores only).",
    )


class RetentionConfig(Section):
    """What happens to a store version's hidden states once training no longer needs them (storage/retention.py,
    drafter/retention.py; docs/STORE.md, "Retention"). Off by default: nothing is deleted. Whatever the mode, data
    are never deleted while another process reads them (reader leases), and what was deleted is recorded in the
    version's retention.json, so readers, `dflash-pipeline verify` and validation name it (who, when, why) and a
    rerun of extract re-extracts it."""

    mode: Literal["keep", "after_export", "consumed"] = Field(
        "keep",
        description="'keep': never delete. 'after_export': once the train stage has exported a drafter trained from "
        "a store version, delete that version's hidden states (its records stay). 'consumed': delete each unit as "
        "soon as a saved training checkpoint covers the last time the training reads it (a resume never needs it); "
        "with the default shuffled order that is during the last epoch. Local stores only.",
    )
    poll_s: float = Field(
        2.0, gt=0, description="consumed: how often the train stage looks for a new checkpoint (seconds)."
    )


class RunConfig(Section):
    output_dir: str = Field("runs/default", description="Everything a run writes goes under here.")
    store_path: str | None = Field(
        None,
        description="Defaults to <output_dir>/store. A local path, or "
        "s3://bucket/prefix for S3-compatible object storage (AWS S3, MinIO, ...; "
        "needs the [s3] extra).",
    )
    store_options: dict[str, Any] = Field(
        {},
        description="Non-secret fsspec/s3fs options of an s3:// store, "
        "e.g. {endpoint_url: 'http://minio:9000'} (also AWS_ENDPOINT_URL). "
        "Credentials come only from the AWS chain: AWS_ACCESS_KEY_ID / "
        "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or an instance role.",
    )
    data: DataConfig = DataConfig()
    target: TargetConfig = TargetConfig()
    layers: LayersConfig = LayersConfig()
    extract: ExtractConfig = ExtractConfig()
    plan: PlanConfig = PlanConfig()
    validate_: ValidateConfig = Field(ValidateConfig(), alias="validate")
    regenerate: RegenerateConfig = RegenerateConfig()
    train: TrainConfig = TrainConfig()
    evaluate: EvalConfig = EvalConfig()
    retention: RetentionConfig = RetentionConfig()
    stages: list[Literal["regenerate", "prepare", "probe", "extract", "validate", "train", "evaluate"]] = Field(
        ["prepare", "probe", "extract", "validate", "train", "evaluate"],
        description="Stages to run, in pipeline order ('regenerate' rewrites the assistant turns with the "
        "target before preparation; also switched on by regenerate.enabled).",
    )

    model_config = ConfigDict(extra="forbid", populate_by_name=True, validate_assignment=True)

    @field_validator("stages")
    @classmethod
    def _known_order(cls, v: list[str]) -> list[str]:
        return sorted(set(v), key=STAGES.index)

    @field_validator("store_options")
    @classmethod
    def _no_secrets(cls, v: dict[str, Any]) -> dict[str, Any]:
        # The run config is saved in the store's provenance attributes: a secret here would be published.
        def walk(d: dict, where: str) -> None:
            for k, x in d.items():
                if str(k).lower() in SECRET_OPTION_KEYS:
                    raise ValueError(
                        f"{where}{k} would put a credential into the run config, which is saved in "
                        "the store's provenance; give credentials through the AWS chain instead: "
                        "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (/ AWS_SESSION_TOKEN) in the "
                        "environment, AWS_PROFILE with ~/.aws/credentials, or an instance role"
                    )
                if isinstance(x, dict):
                    walk(x, f"{where}{k}.")

        walk(v, "store_options.")
        return v

    @model_validator(mode="after")
    def _options_need_object_storage(self) -> RunConfig:
        if self.store_options and "://" not in self.store:
            raise ValueError(
                f"store_options only apply to an s3:// store_path; the store is the local path {self.store}"
            )
        return self

    @model_validator(mode="after")
    def _retention_needs_leases(self) -> RunConfig:
        if self.retention.mode != "keep" and "://" in self.store:
            raise ValueError(
                f"retention.mode={self.retention.mode} needs a local store_path: it never deletes what a reader "
                "reads, which it knows from reader leases (flock locks), and object storage has none. "
                f"{self.store} keeps its data (retention.mode=keep); delete old versions with extract.keep_versions"
            )
        return self

    @property
    def regenerated_path(self) -> Path:
        """Where the regenerate stage writes the target's own replies (the run then prepares those)."""
        return Path(self.output_dir) / "regenerated" / "conversations.jsonl"

    @property
    def drafter_dir(self) -> Path:
        return Path(self.train.output_dir) if self.train.output_dir else Path(self.output_dir) / "drafter"

    @property
    def store(self) -> str:
        """The store's location: a local path, or a URL (s3://bucket/prefix) kept as written."""
        if self.store_path and "://" in self.store_path:
            return self.store_path
        return str(Path(self.store_path) if self.store_path else Path(self.output_dir) / "store")

    def dump(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)

    def hash(self) -> str:
        return hashlib.sha256(json.dumps(self.dump(), sort_keys=True).encode()).hexdigest()[:16]


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {dotted}: '{k}' is not a section")
    node[keys[-1]] = value


def parse_override(item: str) -> tuple[str, Any]:
    """`key.sub=value`; the value is parsed as YAML (so 3, true, [1,2] and null work)."""
    if "=" not in item:
        raise ConfigError(f"override '{item}' is not of the form key=value (e.g. data.max_samples=50)")
    key, raw = item.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def load_config(path: str | Path | None = None, overrides: list[str] | dict[str, Any] | None = None) -> RunConfig:
    """Load YAML (optional), apply dotted overrides, validate. Raises ConfigError naming field and value."""
    tree: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            where = f" (relative to {Path.cwd()})" if not p.is_absolute() else ""  # a deployment's: DFLASH_WORKDIR
            raise ConfigError(f"config file {p}{where} does not exist")
        try:
            tree = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {p} is not valid YAML: {e}") from e
        if not isinstance(tree, dict):
            raise ConfigError(f"config file {p} must hold a mapping at the top level")
    items = list(overrides.items() if isinstance(overrides, dict) else map(parse_override, overrides or []))
    origin = "overrides" if isinstance(overrides, dict) else "--set"
    for key, value in items:
        _set_dotted(tree, key, value)
    where = {key: origin for key, _ in items}
    return validate_tree(tree, where, default_origin=f"in {path}" if path is not None else "")


def _section_at(loc: tuple) -> tuple[type[BaseModel] | None, list[str]]:
    """The config section a pydantic error location points into, and the dotted names of the fields walked."""
    model: type[BaseModel] | None = RunConfig
    names: list[str] = []
    for part in loc:
        fields = {f.alias or n: f for n, f in model.model_fields.items()} if model else {}
        if part not in fields:
            break
        names.append(str(part))
        sub = fields[part].annotation
        model = sub if isinstance(sub, type) and issubclass(sub, BaseModel) else None
    return model, names


def _all_keys(model: type[BaseModel] = RunConfig, prefix: str = "") -> list[str]:
    out = []
    for n, f in model.model_fields.items():
        key = prefix + (f.alias or n)
        out.append(key)
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
            out += _all_keys(f.annotation, key + ".")
    return out


def did_you_mean(dotted: str) -> str:
    """' did you mean <closest key>?' for an unknown dotted key, or '' when nothing is close."""
    import difflib

    parts = dotted.split(".")
    model, names = _section_at(tuple(parts[:-1]))
    if model is not None and len(names) == len(parts) - 1:  # the section exists: the closest key in it
        keys = [f.alias or n for n, f in model.model_fields.items()]
        close = difflib.get_close_matches(parts[-1], keys, n=1, cutoff=0.6)
        if close:
            return f" did you mean {'.'.join([*names, close[0]])}?"
    every = _all_keys()
    same_name = [k for k in every if k.rsplit(".", 1)[-1] == parts[-1]]  # the right key in another section
    close = same_name[:1] or difflib.get_close_matches(dotted, every, n=1, cutoff=0.6)
    return f" did you mean {close[0]}?" if close else ""


# The settings that name a file or directory, and what to give instead of an empty value (an empty path is the
# current directory to every function that opens it: `--set output_dir=` ran the whole pipeline into it).
PATH_SETTINGS = {
    "output_dir": "a directory (e.g. --set output_dir=runs/mine)",
    "store_path": "a directory or an s3:// URL, or null for <output_dir>/store",
    "data.source": "a data file or directory, a hub dataset name, or 'embedded'",
    "target.model_path": "a local checkpoint directory, or 'embedded'",
    "target.tokenizer_path": "a tokenizer directory, or null for the model's",
    "train.output_dir": "a directory, or null for <output_dir>/drafter",
    "evaluate.prompts": "a JSONL file of prompt rows, or 'embedded'",
}


def _no_empty_paths(cfg: RunConfig) -> RunConfig:
    for dotted, give in PATH_SETTINGS.items():
        value: Any = cfg
        for part in dotted.split("."):
            value = getattr(value, part)
        if isinstance(value, str) and not value.strip():
            raise ConfigError(f"{dotted} is empty ({value!r}): give {give}")
    return cfg


def validate_tree(tree: dict[str, Any], where: dict[str, str] | None = None, default_origin: str = "") -> RunConfig:
    """Validate a config tree; every problem on one line. `where` maps dotted override keys to where they came
    from ('--set', 'overrides'); other keys come from `default_origin` ('in <config file>')."""
    try:
        return _no_empty_paths(RunConfig.model_validate(tree))
    except ValidationError as e:
        problems: dict[str, list[str]] = {}
        shown_value: dict[str, str] = {}
        for err in e.errors():
            _, names = _section_at(err["loc"])
            if err["type"] == "extra_forbidden":
                dotted = ".".join(str(x) for x in err["loc"])
                given = [k for k in where or {} if k == dotted or k.startswith(dotted + ".")]  # --set dat.source=
                dotted = given[0] if given else dotted
                origin = f" ({where[dotted]})" if given else f" ({default_origin})" if default_origin else ""
                hint = did_you_mean(dotted) or " no such setting (every setting: dflash-pipeline show-config)"
                problems[dotted] = [f"unknown key{origin};{hint}"]
                continue
            field = ".".join(names) or ".".join(str(x) for x in err["loc"]) or "<root>"
            problems.setdefault(field, []).append(err["msg"])
            value = err.get("input")
            if not isinstance(value, dict):
                shown_value[field] = f" (got {value!r})"
        lines = [f"{f}: {' or '.join(dict.fromkeys(m))}{shown_value.get(f, '')}" for f, m in problems.items()]
        raise ConfigError("invalid configuration: " + "; ".join(lines)) from None


def defaults_yaml(cfg: RunConfig | None = None) -> str:
    """The full default configuration as commented YAML (configs/default.yaml is generated from this); with `cfg`,
    that configuration (every field, documented), as `show-config --config FILE --set ...` prints it."""
    lines = (
        [
            "# dflash-pipeline configuration: every field with its default.",
            "# Generated by `dflash-pipeline show-config`; override with --set key=value or your own file.",
        ]
        if cfg is None
        else ["# dflash-pipeline configuration: every field as the given --config and --set make it."]
    )

    def emit(model: type[BaseModel], values: dict, indent: int) -> None:
        pad = "  " * indent
        for name, field in model.model_fields.items():
            key = field.alias or name
            value = values[key]
            if field.description:
                lines.append(f"{pad}# {field.description}")
            sub = field.annotation
            if isinstance(sub, type) and issubclass(sub, BaseModel):
                lines.append(f"{pad}{key}:")
                emit(sub, value, indent + 1)
            else:
                dumped = yaml.safe_dump(value, default_flow_style=True).strip()
                dumped = dumped.removesuffix("\n...").removesuffix("...").strip()
                lines.append(f"{pad}{key}: {dumped}")

    emit(RunConfig, (cfg or RunConfig()).dump(), 0)
    return "\n".join(lines) + "\n"
