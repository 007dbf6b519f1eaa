"""FP8 targets (extraction/quantized.py, extraction/fp8_linear.py): a block-wise FP8 checkpoint in the published
format, made here from the embedded target, is probed, loaded and extracted with its own FP8 forward (emulated on
CPU: the same quantized operands multiplied in float32; torch's block-scaled GEMM on an H100/H200 is checked
against this emulation on the GPU itself, not here), or dequantized with target.quantization=dequantize; the store
records the quantization and validation recomputes with the same forward.

"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dflash_pipeline.errors import CompatError
from dflash_pipeline.extraction import fp8_linear, quantized
from dflash_pipeline.extraction.config import ExtractConfig, LayersConfig, TargetConfig
from dflash_pipeline.extraction.loader import load_planned
from dflash_pipeline.extraction.probe import probe
from dflash_pipeline.storage.store import Store
from tests.helpers import extract_local

BLOCK = (32, 32)  # the embedded target's widths (64, 192) take 32-wide blocks; published checkpoints use 128


@pytest.fixture(scope="module")
def fp8_dir(model_dir, tmp_path_factory):
    return str(quantized.quantize_fp8_checkpoint(model_dir, tmp_path_factory.mktemp("fp8") / "target", BLOCK))


def test_checkpoint_is_in_the_published_format(model_dir, fp8_dir):
    """e4m3 weights with a float32 weight_scale_inv per block (block absmax / 448), the quantization_config
    transformers reads, and the weights no block divides (GDN's 4-row in_proj_a/b) kept and listed."""
    src, got = load_file(f"{model_dir}/model.safetensors"), load_file(f"{fp8_dir}/model.safetensors")
    name = "model.layers.3.mlp.down_proj.weight"  # [64, 192]
    assert got[name].dtype == torch.float8_e4m3fn and got[name].shape == (64, 192)
    scale = got["model.layers.3.mlp.down_proj.weight_scale_inv"]
    assert scale.dtype == torch.float32 and scale.shape == (2, 6)
    w, deq = src[name].float(), quantized.dequantize_fp8(got[name], scale, list(BLOCK))
    # e4m3: 3 mantissa bits (relative error <= 2^-4), subnormals below 2^-6 of the block's scale step
    bound = w.abs() * 2**-4 + scale.repeat_interleave(32, 0).repeat_interleave(32, 1) * 2**-9
    assert (deq - w).abs().le(bound).all() and not torch.equal(deq, w)
    kept = "model.layers.0.linear_attn.in_proj_a.weight"  # [4, 64]: no 32-row block
    assert torch.equal(got[kept], src[kept])
    q = json.loads(open(f"{fp8_dir}/config.json").read())["quantization_config"]
    assert q["quant_method"] == "fp8" and q["weight_block_size"] == list(BLOCK)
    assert {"model.layers.0.linear_attn.in_proj_a", "lm_head"} <= set(q["modules_to_not_convert"])


def test_fp8_forward_runs_emulated_where_no_fp8_gemm_exists(fp8_dir):
    """transformers would load it dequantized with one log line; the probe keeps the FP8 forward (the stored e4m3
    weights, inputs quantized per token and 128 channels), emulated on CPU, and says so."""
    r = probe(TargetConfig(), LayersConfig(), ExtractConfig(devices="cpu"), fp8_dir, fp8_dir)
    assert r.quantization["forward"] == "fp8" and r.quantization["fp8_matmul"] == "emulated"
    assert any("FP8 forward runs emulated" in w for w in r.warnings)
    assert "/ fp8 (emulated)" in r.to_markdown()
    from dflash_pipeline.progress import said_probe

    assert said_probe(r).endswith("float32 on cpu, FP8 forward (emulated)")
    deq = probe(TargetConfig(quantization="dequantize"), LayersConfig(), ExtractConfig(devices="cpu"), fp8_dir, fp8_dir)
    assert said_probe(deq).endswith("float32 on cpu, FP8 checkpoint dequantized")
    model = load_planned(r, "cpu")
    layers = [m for m in model.modules() if isinstance(m, fp8_linear.BlockFP8Linear)]
    assert len(layers) == 50 and all(m.weight.dtype == torch.float8_e4m3fn for m in layers)
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def _reference_linear(x: torch.Tensor, wq: torch.Tensor, ws: torch.Tensor, block: int) -> torch.Tensor:
    """The format's FP8 linear written out element by element: each token's 128-channel groups scaled by their
    absmax / 448 and rounded to e4m3, times the weight's e4m3 values x their block scale, summed in float64."""
    m, k = x.shape
    xd = torch.empty(m, k, dtype=torch.float64)
    for i in range(m):
        for g0 in range(0, k, 128):
            grp = x[i, g0 : g0 + 128].double()
            s = float(grp.abs().max()) / 448.0
            xd[i, g0 : g0 + 128] = (grp / s).float().to(torch.float8_e4m3fn).double() * s
    wd = torch.empty(wq.shape, dtype=torch.float64)
    for r in range(wq.shape[0]):
        for c in range(wq.shape[1]):
            wd[r, c] = float(wq[r, c].float()) * float(ws[r // block, c // block])
    return xd @ wd.T


def test_fp8_linear_is_the_formats_arithmetic():
    """BlockFP8Linear (the emulated path, the reference of the GPU kernel) against the format written out by
    hand: equal within float32 accumulation (the quantized operands are bit-identical)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 256, generator=gen) * torch.linspace(0.1, 30, 256)  # groups of very different ranges
    w = torch.randn(64, 256, generator=gen) * 0.05
    wq, ws = quantized.quantize_fp8_weight(w, (32, 32))
    got = fp8_linear.BlockFP8Linear(wq, ws, [32, 32], None)(x)
    ref = _reference_linear(x, wq, ws, 32)
    assert float((got.double() - ref).norm() / ref.norm()) < 1e-6
    plain = x @ w.T  # and FP8 is not the bf16 model: a few percent away
    assert 1e-3 < float((got - plain).norm() / plain.norm()) < 0.1


def test_sibling_projections_quantize_their_input_once_bit_equal(fp8_dir, monkeypatch):
    """q/k/v, gate/up and a Gated DeltaNet's two input projections read one tensor: it is quantized once, and the
    forward is bit-equal to quantizing at every linear (the cache holds no stale input: nothing in place)."""
    r = probe(TargetConfig(), LayersConfig(), ExtractConfig(devices="cpu"), fp8_dir, fp8_dir)
    model = load_planned(r, "cpu")
    ids = torch.randint(0, model.config.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    calls = []
    real = fp8_linear._quantize
    monkeypatch.setattr(fp8_linear, "_quantize", lambda x: calls.append(x.shape) or real(x))
    with torch.inference_mode():
        cached = model(input_ids=ids, use_cache=False).logits
        n_cached = len(calls)
        monkeypatch.setattr(fp8_linear, "_quantize_input", lambda x: fp8_linear._quantize(x.reshape(-1, x.shape[-1])))
        every = model(input_ids=ids, use_cache=False).logits
    assert torch.equal(cached, every)
    assert len(calls) - n_cached == 50 and n_cached == 32  # per layer 1 (GDN) or 2 (q/k/v), and 1 (gate/up) shared


def test_dequantized_load_is_the_reference_dequantization(fp8_dir, model_dir):
    """With target.quantization=dequantize the probe records the quantization and how it runs, and every loaded
    linear weight is exactly weight x scale per block (the unquantized ones exactly the checkpoint's)."""
    r = probe(TargetConfig(quantization="dequantize"), LayersConfig(), ExtractConfig(devices="cpu"), fp8_dir, fp8_dir)
    assert r.quantization == {
        "field": "quantization_config",
        "method": "fp8",
        "weight_block_size": list(BLOCK),
        "activation_scheme": "dynamic",
        "scale_fmt": "float",
        "modules_to_not_convert": r.quantization["modules_to_not_convert"],
        "forward": "dequantized",
    }
    assert "fp8 (blocks [32, 32], activations dynamic) / dequantized" in r.to_markdown()
    model = load_planned(r, "cpu")
    state = load_file(f"{fp8_dir}/model.safetensors")
    params = dict(model.named_parameters())
    checked = 0
    for name, t in state.items():
        if name.endswith("weight_scale_inv"):
            continue
        if t.dtype == torch.float8_e4m3fn:
            ref = quantized.dequantize_fp8(t, state[name.removesuffix("weight") + "weight_scale_inv"], list(BLOCK))
            checked += 1
        else:
            ref = t.float()
        assert torch.equal(params[name].detach(), ref), name
    assert checked == 8 * 3 + 6 * 3 + 2 * 4  # 8 MLPs; 6 GDN layers' in_proj_qkv, in_proj_z, out_proj; 2 q/k/v/o


def test_unquantized_checkpoint_is_unchanged(model_dir):
    r = probe(TargetConfig(), LayersConfig(), ExtractConfig(devices="cpu"), model_dir, model_dir)
    assert r.quantization is None and "| checkpoint quantization / forward | none |" in r.to_markdown()


def test_unsupported_quantization_is_refused(fp8_dir, tmp_path):
    cfg = json.loads(open(f"{fp8_dir}/config.json").read())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4}
    with pytest.raises(CompatError, match=r"config.json: quantization_config.quant_method='awq' is not supported"):
        quantized.checkpoint_quantization(cfg, str(tmp_path))


def test_store_records_the_quantization_and_validates(fp8_dir, tmp_path):
    """Extraction from the dequantized weights: validation recomputes with the same load (PASS: the stored states
    equal a fresh forward), and the version's attributes say which checkpoint format ran and how."""
    done = extract_local(
        tmp_path / "run",
        {"target.model_path": fp8_dir, "target.quantization": "dequantize", "data.max_samples": 8},
        validate=True,
    )
    assert done.validation.ok
    st = Store(done.cfg.store)
    q = st.attrs(st.current())["target_quantization"]
    assert q["method"] == "fp8" and q["forward"] == "dequantized" and q["weight_block_size"] == list(BLOCK)


def test_target_head_reads_an_fp8_lm_head_dequantized(fp8_dir, tmp_path):
    """The drafter reuses the target's lm_head: in a checkpoint that quantized it too, training reads it
    dequantized (weight x scale per block), never the raw e4m3 bytes as numbers."""
    import shutil

    from safetensors.torch import save_file

    from dflash_pipeline.drafter.target_head import load_target_head

    d = tmp_path / "fp8-head"
    shutil.copytree(fp8_dir, d)
    state = load_file(f"{d}/model.safetensors")
    w = state["lm_head.weight"]
    state["lm_head.weight"], scale = quantized.quantize_fp8_weight(w, BLOCK)
    save_file(state, f"{d}/model.safetensors", metadata={"format": "pt"})
    # its scale in another shard file, as a sharded checkpoint may put it
    save_file({"lm_head.weight_scale_inv": scale}, f"{d}/model-scales.safetensors", metadata={"format": "pt"})
    state["lm_head.weight_scale_inv"] = scale
    r = probe(TargetConfig(quantization="dequantize"), LayersConfig(), ExtractConfig(devices="cpu"), str(d), str(d))
    head = load_target_head(r, need_norm=False)
    ref = quantized.dequantize_fp8(state["lm_head.weight"], state["lm_head.weight_scale_inv"], list(BLOCK))
    assert torch.equal(head.lm_head.weight, ref) and (ref - w.float()).abs().max() < 0.1 * w.abs().max()


def test_another_forward_of_the_same_checkpoint_is_another_version(fp8_dir, tmp_path):
    """The FP8 forward and the dequantized one store different states: a version holds one of them only."""
    from dflash_pipeline.storage.identity import same_identity

    done = extract_local(
        tmp_path / "run", {"target.model_path": fp8_dir, "target.quantization": "dequantize", "data.max_samples": 4}
    )
    st = Store(done.cfg.store)
    attrs = st.attrs(st.versions()[-1])
    assert same_identity(attrs, dict(attrs))
    fp8 = {**attrs, "target_quantization": {**attrs["target_quantization"], "forward": "fp8"}}
    unquantized = {k: v for k, v in attrs.items() if k != "target_quantization"}
    assert not same_identity(attrs, fp8) and not same_identity(attrs, unquantized)


def test_fp8_checkpoint_without_accelerate_names_the_install(fp8_dir, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else real(name, *a))
    with pytest.raises(CompatError, match=r"with accelerate installed: pip install 'dflash-pipeline\[fp8\]'"):
        probe(TargetConfig(quantization="dequantize"), LayersConfig(), ExtractConfig(devices="cpu"), fp8_dir, fp8_dir)


def test_memory_plan_counts_fp8_weights_at_one_byte_only_when_they_stay_fp8(fp8_dir, model_dir):
    from dflash_pipeline.extraction.modelfiles import weights_bytes

    state = load_file(f"{fp8_dir}/model.safetensors")
    fp8_values = sum(t.numel() for t in state.values() if t.dtype == torch.float8_e4m3fn)
    assert fp8_values > 0
    assert weights_bytes(fp8_dir, 2) == 2 * sum(t.numel() for t in state.values())
    assert weights_bytes(fp8_dir, 2, fp8_stays=True) == weights_bytes(fp8_dir, 2) - fp8_values
    assert weights_bytes(model_dir, 2, fp8_stays=True) == weights_bytes(model_dir, 2)  # nothing FP8 there


def test_quantization_in_text_config_and_unsupported_formats(fp8_dir):
    """A multimodal checkpoint may carry it in text_config; errors name that field. What the FP8 forward does not
    compute exactly is refused: UE8M0 (power-of-two byte) scales, static input scales, per-tensor weight scales."""
    cfg = json.loads(open(f"{fp8_dir}/config.json").read())
    q = cfg.pop("quantization_config")
    nested = {"model_type": "qwen3_5", "text_config": {**cfg, "quantization_config": q}}
    assert quantized.checkpoint_quantization(nested, "m")["field"] == "text_config.quantization_config"
    nested["text_config"]["quantization_config"] = {**q, "scale_fmt": "ue8m0"}
    with pytest.raises(CompatError, match=r"text_config.quantization_config.scale_fmt='ue8m0' is not supported"):
        quantized.checkpoint_quantization(nested, "m")
    nested["text_config"]["quantization_config"] = {**q, "activation_scheme": "static"}  # per-tensor input scales
    with pytest.raises(CompatError, match=r"activation_scheme='static' is not supported"):
        quantized.checkpoint_quantization(nested, "m")
    nested["text_config"]["quantization_config"] = {**q, "weight_block_size": None}  # per-tensor weight scales
    with pytest.raises(CompatError, match=r"weight_block_size=None: only block-wise FP8"):
        quantized.checkpoint_quantization(nested, "m")


def test_loaded_model_runs_in_one_dtype(fp8_dir):
    """transformers 5.17 leaves a multimodal FP8 checkpoint's unquantized tensors in their stored dtype: the load
    gives every floating tensor the compute dtype, so the forward does not fail on mixed dtypes."""
    r = probe(TargetConfig(quantization="dequantize"), LayersConfig(), ExtractConfig(devices="cpu"), fp8_dir, fp8_dir)
    model = load_planned(r, "cpu")
    model.model.norm.weight.data = model.model.norm.weight.data.bfloat16()  # what 5.17 leaves behind
    model.model.layers[3].mlp.up_proj.weight.data = model.model.layers[3].mlp.up_proj.weight.data.bfloat16()
    quantized.finish_loaded(model, r.quantization, torch.float32, fp8_dir)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False)


def test_fp8_store_validates_against_the_same_fp8_forward(fp8_dir, tmp_path):
    """The default (FP8 forward, emulated on CPU): validation's fresh forward is the same FP8 forward (PASS), the
    store says so, and its states are not the dequantized model's."""
    from dflash_pipeline.storage.reader import HiddenStateDataset

    over = {"target.model_path": fp8_dir, "data.max_samples": 4, "layers.preset": "explicit", "layers.ids": [5]}
    fp8 = extract_local(tmp_path / "fp8", over, validate=True)
    deq = extract_local(tmp_path / "deq", {**over, "target.quantization": "dequantize"}, validate=True)
    assert fp8.validation.ok and deq.validation.ok
    st = Store(fp8.cfg.store)
    q = st.attrs(st.current())["target_quantization"]
    assert (q["forward"], q["fp8_matmul"]) == ("fp8", "emulated")
    a, b = HiddenStateDataset(fp8.cfg.store)[0]["hidden"], HiddenStateDataset(deq.cfg.store)[0]["hidden"]
    rel = float((a - b).norm() / b.norm())
    assert 0.005 < rel < 0.1, rel  # 0.026 measured: activation quantization through 5 layers


def test_in_memory_quantization_equals_the_checkpoints(model_dir, fp8_dir):
    """fp8_linear.quantize_model (the benchmarks' random-weight FP8 targets) gives exactly the layers a checkpoint
    written by quantize_fp8_checkpoint loads into."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert fp8_linear.quantize_model(model, BLOCK) == 50
    r = probe(TargetConfig(), LayersConfig(), ExtractConfig(devices="cpu"), fp8_dir, fp8_dir)
    loaded = dict(load_planned(r, "cpu").named_modules())
    for name, m in model.named_modules():
        if isinstance(m, fp8_linear.BlockFP8Linear):
            other = loaded[name]
            assert isinstance(other, fp8_linear.BlockFP8Linear), name
            assert torch.equal(m.weight.view(torch.uint8), other.weight.view(torch.uint8))
            assert torch.equal(m.weight_scale_inv, other.weight_scale_inv)


def test_sharded_checkpoint_with_scales_apart_from_their_weights(fp8_dir, tmp_path):
    """Published checkpoints come in shards, and a weight's scale need not sit in the weight's shard: the FP8
    forward finds both wherever the index puts them."""
    import shutil

    from safetensors.torch import save_file

    d = tmp_path / "sharded"
    shutil.copytree(fp8_dir, d)
    state = load_file(f"{d}/model.safetensors")
    (d / "model.safetensors").unlink()
    shards = {
        "model-00001-of-00002.safetensors": {k: v for k, v in state.items() if not k.endswith("weight_scale_inv")},
        "model-00002-of-00002.safetensors": {k: v for k, v in state.items() if k.endswith("weight_scale_inv")},
    }
    for name, part in shards.items():
        save_file(part, d / name, metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: name for name, part in shards.items() for k in part}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    r = probe(TargetConfig(), LayersConfig(), ExtractConfig(devices="cpu"), str(d), str(d))
    layers = {n: m for n, m in load_planned(r, "cpu").named_modules() if isinstance(m, fp8_linear.BlockFP8Linear)}
    assert len(layers) == 50
    m = layers["model.layers.3.mlp.down_proj"]
    assert torch.equal(m.weight_scale_inv, state["model.layers.3.mlp.down_proj.weight_scale_inv"])


def test_switching_the_forward_is_refused_naming_the_difference(fp8_dir, tmp_path):
    """The same checkpoint, dequantized, then with its FP8 forward into the same store: refused until a new
    version is asked for, and the message names the one entry that differs, not the whole record."""
    from dflash_pipeline.errors import StoreError

    over = {"target.model_path": fp8_dir, "data.max_samples": 4, "layers.preset": "explicit", "layers.ids": [5]}
    extract_local(tmp_path / "run", {**over, "target.quantization": "dequantize"})
    with pytest.raises(StoreError) as e:
        extract_local(tmp_path / "run", over)
    msg = str(e.value)
    assert "target_quantization.forward: store has 'dequantized', this run has 'fp8'" in msg
    assert "modules_to_not_convert" not in msg and "extract.new_version=true" in msg


def test_fp8_layers_keep_float32_scales_in_a_bfloat16_model(fp8_dir):
    """The compute dtype reaches every other tensor, never the FP8 weights or their float32 block scales (nor the
    GEMM's padded copy of them)."""
    r = probe(TargetConfig(dtype="bfloat16"), LayersConfig(), ExtractConfig(devices="cpu"), fp8_dir, fp8_dir)
    model = load_planned(r, "cpu")
    layer = model.model.layers[3].mlp.down_proj
    assert isinstance(layer, fp8_linear.BlockFP8Linear) and layer.weight.dtype == torch.float8_e4m3fn
    assert layer.weight_scale_inv.dtype == layer.weight_scale_mm.dtype == torch.float32
    assert layer.weight_scale_mm.shape == (2, 8) and "weight_scale_mm" not in layer.state_dict()  # 6 -> 8 columns
    assert model.model.norm.weight.dtype == torch.bfloat16
    assert model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=False).logits.dtype == torch.bfloat16
