"""Every record that crosses a process boundary round-trips exactly, and a record that does not match the
reading code (another version, an unknown or a missing field) is refused with the field's name."""

from __future__ import annotations

import json

import pytest

from dflash_pipeline.drafter.config import TrainConfig
from dflash_pipeline.drafter.train import TrainJob
from dflash_pipeline.extraction.config import ExtractConfig
from dflash_pipeline.extraction.probe import DeviceInfo, ProbeReport
from dflash_pipeline.extraction.spec import WorkerSpec
from dflash_pipeline.handoff import HandoffError


def report() -> ProbeReport:
    return ProbeReport(
        python="3.11.7",
        torch_version="2.13.0",
        transformers_version="5.24.0",
        dtype_kwarg="dtype",
        kernels={"flash-linear-attention": False},
        attn_implementations=["eager", "sdpa"],
        model_path="/models/m",
        tokenizer_path="/models/tok",
        trust_remote_code=True,
        attn_implementation="sdpa",
        pad_id=7,
        architecture="Qwen3_5ForCausalLM",
        model_type="qwen3_5_text",
        num_layers=8,
        hidden_size=64,
        layer_types=["linear_attention"] * 6 + ["full_attention"] * 2,
        layer_ids=[1, 3, 5],
        layer_preset="explicit",
        capture_last=True,
        compute_dtype="float32",
        devices=[DeviceInfo(name="cpu", kind="cpu", total_gib=24.0, free_gib=20.0)],
        weights_gib=0.01,
        working_gib=0.5,
        placement="one replica per device on 1 device(s): cpu",
        replicas=["cpu"],
    )


def handoffs():
    spec = WorkerSpec(
        store_root="/runs/x/store",
        store_options={"endpoint_url": "http://127.0.0.1:9"},
        version="v0001",
        units=["u00000", "u00001"],
        report=report(),
        extract=ExtractConfig(devices="cpu", token_budget=300),
        store_dtype="bfloat16",
        device="cuda:0+cuda:1",
        label="cuda:2+cuda:3",
        threads=None,
    )
    job = TrainJob(train=TrainConfig(max_steps=5), store="s3://b/p", report=report(), output_dir="/o", version="v2")
    return [report(), spec, job]


@pytest.mark.parametrize("record", handoffs(), ids=lambda r: type(r).__name__)
def test_every_handoff_round_trips(record):
    again = type(record).from_json(record.to_json())
    assert again == record and type(again.__dict__.get("report", again)) is ProbeReport


@pytest.mark.parametrize("record", handoffs(), ids=lambda r: type(r).__name__)
def test_unknown_missing_and_versioned_fields_are_refused_by_name(record):
    doc = json.loads(record.to_json())
    first = next(iter(doc["fields"]))
    unknown = {**doc, "fields": {**doc["fields"], "added_on_one_side": 1}}
    with pytest.raises(HandoffError, match="unknown field added_on_one_side"):
        type(record).from_json(json.dumps(unknown))
    missing = {**doc, "fields": {k: v for k, v in doc["fields"].items() if k != first}}
    with pytest.raises(HandoffError, match=f"missing field {first}"):
        type(record).from_json(json.dumps(missing))
    with pytest.raises(HandoffError, match="version 99"):
        type(record).from_json(json.dumps({**doc, "version": 99}))
    with pytest.raises(HandoffError, match=f"expected a {record.KIND} record"):
        type(record).from_json(json.dumps({**doc, "kind": "something-else"}))


def test_a_nested_record_is_checked_too():
    doc = json.loads(handoffs()[1].to_json())
    del doc["fields"]["report"]["pad_id"]
    with pytest.raises(HandoffError, match=r"extract-worker\.report: ProbeReport .*missing field pad_id"):
        WorkerSpec.from_json(json.dumps(doc))
