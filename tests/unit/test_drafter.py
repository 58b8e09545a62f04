import json
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_callbacks import DFlashDrafter, DrafterConfig, load_drafter, save_drafter
from dflash_callbacks.model.attention import resolve_attention
from dflash_callbacks.model.config import UNIMPLEMENTED, build_target_layer_ids

from fsdp1 import FullyShardedDataParallel


def test_reproduces_reference_forward(zlab_tiny):
    drafter = load_drafter(zlab_tiny)
    io = load_file(str(zlab_tiny / "reference_io.safetensors"))
    with torch.no_grad():
        out = drafter(io["target_hidden"], io["noise_embedding"], io["position_ids"])
    assert out.shape == io["expected"].shape
    torch.testing.assert_close(out, io["expected"], atol=1e-5, rtol=0)


def test_norm_weights_are_loaded(zlab_tiny):
    # The fixture perturbs norm weights, so a loader that drops them would differ.
    drafter = load_drafter(zlab_tiny)
    stored = load_file(str(zlab_tiny / "model.safetensors"))
    assert not torch.allclose(stored["norm.weight"], torch.ones_like(stored["norm.weight"]))
    torch.testing.assert_close(drafter.norm.weight.detach(), stored["norm.weight"], atol=0, rtol=0)


def tiny_config(**overrides) -> DrafterConfig:
    raw = dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, block_size=4, mask_token_id=99, target_layer_ids=[0, 2],
        vocab_size=100, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=512,
    )
    raw.update(overrides)
    return DrafterConfig(**raw)


def block_mask(anchors, block, ctx_len):
    """[Q, C+Q] boolean: block i sees context [0, a_i) and itself."""
    q = len(anchors) * block
    mask = torch.zeros(q, ctx_len + q, dtype=torch.bool)
    for i, a in enumerate(anchors):
        rows = slice(i * block, (i + 1) * block)
        mask[rows, :a] = True
        mask[rows, ctx_len + i * block: ctx_len + (i + 1) * block] = True
    return mask


@pytest.mark.parametrize("layer_types,window", [(None, None), (["sliding_attention", "full_attention"], 5)])
@pytest.mark.parametrize("mask_kind", ["bool", "additive"])
def test_one_forward_over_two_blocks_equals_two_forwards(layer_types, window, mask_kind):
    torch.manual_seed(0)
    cfg = tiny_config(layer_types=layer_types or [], sliding_window=window)
    drafter = DFlashDrafter(cfg).eval()
    T, B = 20, cfg.block_size
    ctx = torch.randn(1, T, cfg.num_target_features)
    anchors = [9, 14]
    noise = [torch.randn(1, B, cfg.hidden_size) for _ in anchors]
    with torch.no_grad():
        separate = [
            drafter(ctx[:, :a], n, torch.arange(a + B)[None]) for a, n in zip(anchors, noise)
        ]
        positions = torch.cat([torch.arange(T)] + [torch.arange(a, a + B) for a in anchors])[None]
        mask = block_mask(anchors, B, T)
        if mask_kind == "additive":
            mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
        together = drafter(ctx, torch.cat(noise, dim=1), positions, attention_mask=mask)
    torch.testing.assert_close(together, torch.cat(separate, dim=1), atol=1e-5, rtol=1e-5)


def test_sliding_window_hides_far_context():
    torch.manual_seed(0)
    cfg = tiny_config(layer_types=["sliding_attention"] * 2, sliding_window=4)
    drafter = DFlashDrafter(cfg).eval()
    ctx = torch.randn(1, 12, cfg.num_target_features)
    noise = torch.randn(1, 4, cfg.hidden_size)
    pos = torch.arange(16)[None]
    changed = ctx.clone()
    changed[:, :5] = torch.randn(1, 5, cfg.num_target_features)  # positions <= 12 - 4 - ... out of every window
    with torch.no_grad():
        a, b = drafter(ctx, noise, pos), drafter(changed, noise, pos)
    torch.testing.assert_close(a, b)
    changed[:, 11] += 1.0  # inside the window of the first block query
    with torch.no_grad():
        assert not torch.allclose(drafter(changed, noise, pos), a)


def test_no_mask_equals_all_visible_mask():
    torch.manual_seed(1)
    cfg = tiny_config()
    drafter = DFlashDrafter(cfg).eval()
    ctx, noise = torch.randn(2, 7, cfg.num_target_features), torch.randn(2, 4, cfg.hidden_size)
    pos = torch.arange(11)[None]
    with torch.no_grad():
        torch.testing.assert_close(
            drafter(ctx, noise, pos), drafter(ctx, noise, pos, attention_mask=torch.ones(4, 11, dtype=torch.bool))
        )


def test_bf16_keeps_fp32_rope_and_stays_close(zlab_tiny):
    io = load_file(str(zlab_tiny / "reference_io.safetensors"))
    drafter = load_drafter(zlab_tiny, dtype=torch.bfloat16)
    assert drafter.fc.weight.dtype == torch.bfloat16
    assert drafter.rotary_emb.inv_freq.dtype == torch.float32
    with torch.no_grad():
        out = drafter(*(io[k].to(torch.bfloat16) if k != "position_ids" else io[k]
                        for k in ("target_hidden", "noise_embedding", "position_ids")))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), io["expected"], atol=0.1, rtol=0.05)


def test_config_placements_are_equivalent(zlab_tiny):
    raw = json.loads((zlab_tiny / "config.json").read_text())
    base = DrafterConfig.from_dict(raw)
    moved = json.loads(json.dumps(raw))
    moved["dflash_config"]["block_size"] = moved.pop("block_size")
    moved["mask_token_id"] = moved["dflash_config"].pop("mask_token_id")
    moved["target_layer_ids"] = moved["dflash_config"].pop("target_layer_ids")
    moved["rope_theta"] = moved.pop("rope_parameters")["rope_theta"]
    other = DrafterConfig.from_dict(moved)
    for name in ("block_size", "mask_token_id", "target_layer_ids", "rope_parameters"):
        assert getattr(other, name) == getattr(base, name), name
    assert DrafterConfig.from_dict(base.to_dict()) == base
    out = base.to_dict()
    assert out["block_size"] == 8 and out["dflash_config"]["mask_token_id"] == 299


def test_target_layer_ids_derived_like_published_code(zlab_tiny):
    raw = json.loads((zlab_tiny / "config.json").read_text())
    del raw["dflash_config"]["target_layer_ids"]
    raw["num_target_layers"], raw["num_hidden_layers"] = 36, 5
    raw["layer_types"] = ["full_attention"] * 5
    assert DrafterConfig.from_dict(raw).target_layer_ids == [1, 9, 17, 25, 33]
    assert build_target_layer_ids(10, 1) == [5]
    del raw["num_target_layers"]
    with pytest.raises(ValueError, match="neither target_layer_ids nor num_target_layers"):
        DrafterConfig.from_dict(raw)


def copy_fixture(zlab_tiny, tmp_path):
    folder = tmp_path / "drafter"
    folder.mkdir()
    shutil.copy(zlab_tiny / "config.json", folder)
    shutil.copy(zlab_tiny / "model.safetensors", folder)
    return folder


def test_missing_config_names_the_folder(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="no config.json in .*config.json and \\*.safetensors"):
        load_drafter(tmp_path)


def test_missing_and_misshaped_tensors_are_named(zlab_tiny, tmp_path):
    folder = copy_fixture(zlab_tiny, tmp_path)
    state = load_file(str(folder / "model.safetensors"))
    del state["layers.1.mlp.up_proj.weight"]
    state["fc.weight"] = state["fc.weight"][:, :128].contiguous()
    state["mtp_head.weight"] = torch.zeros(3, 3)
    state["lm_head.weight"] = torch.zeros(3, 3)  # a stored copy of the target's head, of the wrong shape
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ValueError) as err:
        load_drafter(folder)
    msg = str(err.value)
    assert "missing tensor 'layers.1.mlp.up_proj.weight' (expected shape [96, 64])" in msg
    assert "tensor 'fc.weight' has shape [64, 128]; expected [64, 192]" in msg
    assert "unexpected tensor 'mtp_head.weight' (shape [3, 3])" in msg
    assert "tensor 'lm_head.weight' has shape [3, 3]; expected [300, 64]" in msg
    assert str(folder) in msg


def test_unknown_layer_type_lists_legal_values(zlab_tiny, tmp_path):
    folder = copy_fixture(zlab_tiny, tmp_path)
    raw = json.loads((folder / "config.json").read_text())
    raw["layer_types"][1] = "linear_attention"
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"layer_types\[1\] is 'linear_attention'; expected one of \['full_attention', 'sliding_attention'\]"):
        load_drafter(folder)


def test_save_then_load_round_trip_and_state_dict_source(zlab_tiny, tmp_path):
    drafter = load_drafter(zlab_tiny)
    io = load_file(str(zlab_tiny / "reference_io.safetensors"))
    out = save_drafter(tmp_path / "snap", drafter.config, drafter.state_dict(), extra_files={"snapshot.json": {"step": 3}})
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "snapshot.json"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left behind
    args = (io["target_hidden"], io["noise_embedding"], io["position_ids"])
    with torch.no_grad():
        for again in (load_drafter(out), load_drafter(drafter.state_dict(), config=drafter.config)):
            torch.testing.assert_close(again(*args), io["expected"], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="needs its DrafterConfig"):
        load_drafter(drafter.state_dict())


CHANGING = {  # a value of each field published DFlash code reads that changes what the drafter computes
    "input_embedding_scale": 8.0, "output_multiplier": 0.2, "final_logit_softcapping": 20.0, "logit_scale": 0.5,
    "shift_label": True, "sample_from_anchor": True, "is_neox_style": False,
    "rope_is_neox_style": False, "attention_sink_bias": True, "add_swa_attention_sink_bias": True, "use_swa": True,
    "swa_window_size": 2048, "use_aux_hidden_state": False,
}


@pytest.mark.parametrize("where", ["dflash_config", "top"])
@pytest.mark.parametrize("key", list(CHANGING))
def test_a_setting_of_the_published_code_this_drafter_lacks_is_refused(zlab_tiny, tmp_path, where, key):
    """Published configs may set these (SpecForge's Domino and DSpark configs: projector_type,
    shift_label; speculators: sample_from_anchor; vLLM and SGLang: the rest); scored without
    them, the numbers would be another model's. Their neutral values load."""
    assert set(CHANGING) == set(UNIMPLEMENTED)
    folder = copy_fixture(zlab_tiny, tmp_path)
    raw = json.loads((folder / "config.json").read_text())
    (raw["dflash_config"] if where == "dflash_config" else raw)[key] = CHANGING[key]
    (folder / "config.json").write_text(json.dumps(raw))
    effect = re.escape(UNIMPLEMENTED[key][0])
    with pytest.raises(ValueError, match=f"{re.escape(str(folder / 'config.json'))}: field '{key}' is "
                                         f"{re.escape(repr(CHANGING[key]))}: it {effect}, which this drafter does not"):
        load_drafter(folder)
    for neutral in UNIMPLEMENTED[key][1]:
        (raw["dflash_config"] if where == "dflash_config" else raw)[key] = neutral
        assert DrafterConfig.from_dict(raw).to_dict()["layer_types"] == ["full_attention"] * 3


@pytest.mark.parametrize("where", ["dflash_config", "top"])
def test_a_projector_type_no_family_reads_is_refused_naming_the_families(zlab_tiny, where):
    """SpecForge's projector_type names the head: 'dflash' (or none) is DFlash's; another value that no
    family reads is refused in one line naming the field and the families known."""
    raw = json.loads((zlab_tiny / "config.json").read_text())
    (raw["dflash_config"] if where == "dflash_config" else raw)["projector_type"] = "dflash"
    assert DrafterConfig.from_dict(raw).family == "dflash"
    (raw["dflash_config"] if where == "dflash_config" else raw)["projector_type"] = "medusa"
    with pytest.raises(ValueError, match=r"field 'projector_type' is 'medusa': no drafter family .*dflash \(DFlash\), "
                                         r"dflash2 \(DFlash 2\)"):
        DrafterConfig.from_dict(raw)


def test_a_target_wider_than_the_drafter_is_refused(zlab_tiny):
    raw = json.loads((zlab_tiny / "config.json").read_text())
    raw["target_hidden_size"] = 128
    with pytest.raises(ValueError, match="field 'target_hidden_size' is 128: a target 128 wide feeds the fc projection"):
        DrafterConfig.from_dict(raw)
    raw["target_hidden_size"] = raw["hidden_size"]
    DrafterConfig.from_dict(raw)


def test_is_causal_and_dflash_config_causal_make_every_layer_causal_as_vllm_reads_them(zlab_tiny):
    raw = json.loads((zlab_tiny / "config.json").read_text())
    raw.update(layer_types=["sliding_attention", "full_attention", "full_attention"], sliding_window=5,
               use_sliding_window=True)
    assert [a.causal for a in resolve_attention(DrafterConfig.from_dict(raw))] == [True, False, False]
    raw["dflash_config"]["causal"] = True
    assert [a.causal for a in resolve_attention(DrafterConfig.from_dict(raw))] == [True, True, True]
    raw["is_causal"] = False  # read first
    config = DrafterConfig.from_dict(raw)
    assert config.causal is False and [a.causal for a in resolve_attention(config)] == [False] * 3
    assert DrafterConfig.from_dict(config.to_dict()) == config
    assert [str(a) for a in resolve_attention(config, "causal")] == ["causal, window 5 from the query", "bidirectional",
                                                                    "bidirectional"]
    raw["is_causal"] = "yes"
    with pytest.raises(ValueError, match="field 'is_causal' must be true, false or null; got 'yes'"):
        DrafterConfig.from_dict(raw)


def test_sliding_layers_follow_use_sliding_window_as_transformers_does(zlab_tiny):
    raw = json.loads((zlab_tiny / "config.json").read_text())
    raw.update(use_sliding_window=False, sliding_window=4, layer_types=["sliding_attention"] * 3)
    with pytest.raises(ValueError, match="use_sliding_window is false but layer_types lists sliding_attention"):
        DrafterConfig.from_dict(raw)
    raw["layer_types"] = ["full_attention"] * 3  # a window with use_sliding_window false is no window
    assert DrafterConfig.from_dict(raw).sliding_window is None
    del raw["layer_types"]  # derived from max_window_layers, as transformers' Qwen3Config does
    raw.update(use_sliding_window=True, max_window_layers=1)
    config = DrafterConfig.from_dict(raw)
    assert config.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    assert config.sliding_window == 4 and DrafterConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize("key, value, match", [
    ("rms_norm_eps", None, "'rms_norm_eps' must be a number between 0 and 1; got None"),
    ("hidden_act", None, "'hidden_act' must be an activation name"),
    ("attention_bias", "false", "'attention_bias' must be true or false; got 'false'"),
    ("rope_parameters", {"rope_type": "default", "rope_theta": "1e4"}, "'rope_theta' .* must be a positive number; got '1e4'"),
    ("num_target_layers", "6", "'num_target_layers' must be a positive integer or null; got '6'"),
    ("num_target_layers", 4, r"target_layer_ids \[1, 2, 4\] names a layer the target lacks: num_target_layers is 4"),
])
def test_a_config_field_of_the_wrong_type_is_refused_naming_file_and_field(zlab_tiny, tmp_path, key, value, match):
    folder = copy_fixture(zlab_tiny, tmp_path)
    raw = json.loads((folder / "config.json").read_text())
    raw[key] = value
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=f"drafter config {folder / 'config.json'}: .*{match}"):
        load_drafter(folder)


def test_forwarding_wrappers_are_looked_through_and_collective_ones_refused_wherever_they_sit():
    """DDP (a real one, over a 1-process gloo group) and torch.compile only forward to the drafter: the
    drafter is found through them. FSDP1 (around the drafter, around the model holding it, or inside it
    around a layer) and DeepSpeed ZeRO-3's partitioned parameters make `state_dict()` a collective over
    unsharded weights: refused before training, naming where, so that no snapshot hangs rank 0."""
    import os

    import torch.distributed as dist

    from dflash_callbacks.engine.drafters import refuse_collective_wrappers, resolve_drafter, unwrap

    drafter = DFlashDrafter(tiny_config())
    model = torch.nn.Module()
    model.drafter = drafter
    assert unwrap(torch.compile(drafter)) is drafter
    assert resolve_drafter(torch.compile(model), "drafter", "Owner") is drafter
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29000 + os.getpid() % 900))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        assert resolve_drafter(ddp, "drafter", "Owner") is drafter
        assert unwrap(torch.nn.parallel.DistributedDataParallel(drafter)) is drafter
        refuse_collective_wrappers(drafter, ddp, "Owner")  # nothing to refuse
    finally:
        dist.destroy_process_group()

    with pytest.raises(ValueError, match=r"the drafter is wrapped in FullyShardedDataParallel, which is not supported: "
                                         r"FSDP1 .*use FSDP2 \(`fully_shard`\)"):
        unwrap(FullyShardedDataParallel(drafter))
    wrapped = torch.nn.Module()
    wrapped.inner = FullyShardedDataParallel(model)
    found = resolve_drafter(wrapped, "inner.drafter", "Owner")  # FSDP1 forwards .drafter to the model it wraps
    with pytest.raises(ValueError, match=r"^Owner: the drafter sits inside the model's inner, a "
                                         r"FullyShardedDataParallel, which is not supported: FSDP1"):
        refuse_collective_wrappers(found, wrapped, "Owner")
    with pytest.raises(ValueError, match=r"the drafter sits inside the model, a FullyShardedDataParallel"):
        refuse_collective_wrappers(drafter, FullyShardedDataParallel(model), "Owner")
    layered = DFlashDrafter(tiny_config())
    layered.layers[1] = FullyShardedDataParallel(layered.layers[1])
    with pytest.raises(ValueError, match=r"the drafter's layers.1 is a FullyShardedDataParallel"):
        refuse_collective_wrappers(layered)
    zero3 = DFlashDrafter(tiny_config())
    zero3.fc.weight.ds_id = 7  # what DeepSpeed ZeRO-3 marks each partitioned parameter with
    with pytest.raises(ValueError, match=r"partitioned by DeepSpeed ZeRO-3 \(fc.weight, ...\).*watch --checkpoints"):
        refuse_collective_wrappers(zero3)
