import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

import dflash_callbacks.model.io as io_module  # every safetensors file is opened through io.open_safetensors
from dflash_callbacks import TargetHead
from dflash_callbacks.model.target_head import head_fingerprint, head_shapes

from fixtures_cache import save_random_target


def tiny_target(tied: bool) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, tie_word_embeddings=tied,
    )
    return Qwen3ForCausalLM(config).eval()


class KeyLog(list):
    def __init__(self):
        super().__init__()
        self.rows: set[str] = set()


@pytest.fixture
def read_keys(monkeypatch):
    """Every tensor name whose data TargetHead reads whole, in order (the real safe_open runs
    underneath); `read_keys.rows` the names read only in part, through get_slice."""
    keys = KeyLog()
    real_safe_open = io_module.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self.inner = real_safe_open(*args, **kwargs)

        def __enter__(self):
            self.handle = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.handle.keys()

        def get_tensor(self, key):
            keys.append(key)
            return self.handle.get_tensor(key)

        def get_slice(self, key):
            keys.rows.add(key)
            return self.handle.get_slice(key)

    monkeypatch.setattr(io_module, "safe_open", Recording)
    return keys


@pytest.mark.parametrize("layout", ["single", "sharded", "tied"])
def test_reads_exactly_embedding_and_lm_head(tmp_path, layout, read_keys):
    model = tiny_target(tied=layout == "tied")
    model.save_pretrained(tmp_path, max_shard_size="20KB" if layout == "sharded" else "5GB")
    index = tmp_path / "model.safetensors.index.json"
    if layout == "sharded":
        weight_map = json.loads(index.read_text())["weight_map"]
        assert len(set(weight_map.values())) >= 3
        needed = {weight_map["model.embed_tokens.weight"], weight_map["lm_head.weight"]}
        for shard in set(weight_map.values()) - needed:
            (tmp_path / shard).unlink()  # shards holding neither tensor are not needed at all
    head = TargetHead.from_pretrained(tmp_path)
    assert torch.equal(head.embed_tokens.weight, model.get_input_embeddings().weight)
    assert torch.equal(head.lm_head.weight, model.lm_head.weight)
    assert head.vocab_size == 96 and head.hidden_size == 32
    expected = ["model.embed_tokens.weight"] + ([] if layout == "tied" else ["lm_head.weight"])
    assert read_keys == expected and read_keys.rows == set(expected)  # rows: the head's fingerprint
    assert head.fingerprint == head_fingerprint(tmp_path)


def test_the_head_fingerprint_tells_same_shaped_targets_apart_from_a_few_rows(tmp_path, read_keys):
    """Two real targets of the same shapes, other weights (another seed: a re-trained target),
    and one that differs from the first only in its lm_head: three fingerprints. A copy of
    the first elsewhere, or its sharded save, has the first's. Only rows are read."""
    a = save_random_target(tmp_path / "a", seed=0)
    b = save_random_target(tmp_path / "b", seed=1)
    sharded = save_random_target(tmp_path / "a-sharded", seed=0, max_shard_size="100KB")
    shutil.copytree(a, tmp_path / "a-copy")
    weights = load_file(str(a / "model.safetensors"))
    weights["lm_head.weight"] = weights["lm_head.weight"] * 1.01
    shutil.copytree(a, tmp_path / "a-new-head")
    save_file(weights, str(tmp_path / "a-new-head" / "model.safetensors"))
    assert head_shapes(a) == head_shapes(b)
    fingerprint = head_fingerprint(a)
    assert len(fingerprint) == 16 and fingerprint == head_fingerprint(tmp_path / "a-copy") == head_fingerprint(sharded)
    assert len({fingerprint, head_fingerprint(b), head_fingerprint(tmp_path / "a-new-head")}) == 3
    assert read_keys == [] and read_keys.rows == {"model.embed_tokens.weight", "lm_head.weight"}  # no whole tensor


def test_multimodal_key_variant_and_dtype(tmp_path):
    model = tiny_target(tied=False)
    state = {
        "model.language_model.embed_tokens.weight": model.model.embed_tokens.weight.detach(),
        "lm_head.weight": model.lm_head.weight.detach(),
        "model.visual.patch.weight": torch.zeros(4, 4),
    }
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"tie_word_embeddings": False}}))
    head = TargetHead.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert head.embed_tokens.weight.dtype == torch.bfloat16
    assert torch.equal(head.embed_tokens.weight, model.model.embed_tokens.weight.detach().to(torch.bfloat16))


def test_missing_lm_head_without_tying_is_an_error(tmp_path):
    model = tiny_target(tied=False)
    save_file({"model.embed_tokens.weight": model.model.embed_tokens.weight.detach()}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    with pytest.raises(ValueError, match="no LM head .* tie_word_embeddings: true"):
        TargetHead.from_pretrained(tmp_path)


def test_missing_folder_and_missing_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        TargetHead.from_pretrained(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors weights"):
        TargetHead.from_pretrained(tmp_path)


def test_a_damaged_target_folder_is_an_error_naming_the_file(tmp_path):
    """A config.json that is not JSON or holds text_config: null, an index that names the wrong shard,
    a head that is not a matrix or is quantized: one ValueError naming the file, for the preflight to list."""
    embed, lm_head = torch.randn(16, 8), torch.randn(16, 8)

    def target(name, tensors, config=None, index=None):
        folder = tmp_path / name
        folder.mkdir()
        for file, state in tensors.items():
            save_file(state, str(folder / file))
        if config is not None:
            (folder / "config.json").write_text(config)
        if index is not None:
            (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
        return folder

    one = {"model.safetensors": {"model.embed_tokens.weight": embed, "lm_head.weight": lm_head}}
    cases = [
        (target("not_json", one, config="{oops"), "config.json is not valid JSON"),
        (target("wrong_shard", {"a.safetensors": {"model.embed_tokens.weight": embed},
                                "b.safetensors": {"lm_head.weight": lm_head}},
                index={"model.embed_tokens.weight": "a.safetensors", "lm_head.weight": "a.safetensors"}),
         "model.safetensors.index.json says a.safetensors holds 'lm_head.weight', but that file does not"),
        (target("vector", {"model.safetensors": {"model.embed_tokens.weight": embed[0], "lm_head.weight": lm_head}}),
         r"'model.embed_tokens.weight' in .*model.safetensors has shape \[8\]; a matrix"),
        (target("int8", {"model.safetensors": {"model.embed_tokens.weight": embed, "lm_head.weight": lm_head.to(torch.int8)}}),
         "'lm_head.weight' in .*model.safetensors is I8; the embedding and LM head must be one of"),
    ]
    for folder, match in cases:
        for read in (TargetHead.from_pretrained, head_shapes, head_fingerprint):
            with pytest.raises(ValueError, match=match):
                read(folder)
    tied = target("null_text_config", {"model.safetensors": {"model.embed_tokens.weight": embed}},
                  config=json.dumps({"text_config": None}))
    with pytest.raises(ValueError, match="no LM head"):  # was an AttributeError, past the preflight
        head_shapes(tied)
