"""The architecture table, config mapping, checkpoint reading and their typed errors."""
from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvexport.architectures import ARCHITECTURES, config_problems, map_config
from kvexport.checkpoint import load_checkpoint
from kvexport.errors import CheckpointError, UnsupportedArchitectureError, UnsupportedFeatureError, WeightShapeError
from kvexport.zoo import BENCH_125M, TINY_CONFIGS, transformers_config, write_checkpoint


def test_every_registered_family_has_a_tiny_test_config() -> None:
    missing = sorted(set(ARCHITECTURES) - set(TINY_CONFIGS))
    assert not missing, f"families without a tiny test config in kvexport/zoo.py: {missing}"
    for family, raw in TINY_CONFIGS.items():
        assert raw["model_type"] == family
        assert map_config(raw).model_type == family


def test_tests_cover_every_tiny_config() -> None:
    from tests.conftest import FAMILIES

    assert set(FAMILIES) == set(ARCHITECTURES)


def test_made_checkpoints_name_transformers_class(tmp_path: Path) -> None:
    """config.json's `architectures` is what transformers' and the peers' converters pick a class by: each family's
    hf_class must be the one transformers maps its model_type to, and a made checkpoint must carry it."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    assert {t: s.hf_class for t, s in ARCHITECTURES.items()} == {t: MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[t] for t in ARCHITECTURES}
    out = write_checkpoint(TINY_CONFIGS["qwen3"], tmp_path / "q3")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]


def test_family_differences_are_data() -> None:
    cfg = {f: map_config(TINY_CONFIGS[f]) for f in TINY_CONFIGS}
    assert cfg["llama"].rope.type == "llama3" and cfg["llama"].rope.factor == 8.0
    assert cfg["mistral"].sliding_window == 24
    assert cfg["qwen2"].qkv_bias and not cfg["qwen2"].o_bias and cfg["qwen2"].tie_word_embeddings
    g = cfg["gpt2"]
    assert (g.position_kind, g.norm_kind, g.mlp_kind, g.activation) == ("learned", "layer", "plain", "gelu_tanh")
    assert g.tie_word_embeddings and g.intermediate_size == 4 * g.hidden_size
    assert cfg["qwen3"].qk_norm == "head" and cfg["qwen3"].head_dim == 32 != 64 // 4
    assert (cfg["olmo2"].qk_norm, cfg["olmo2"].norm_position) == ("projection", "post")
    gr = cfg["granite"]
    assert (gr.embedding_scale, gr.residual_scale, gr.attention_scale, gr.logit_divisor) == (2.0, 0.5, 0.125, 4.0)
    n = cfg["gpt_neox"]
    assert n.parallel_residual and n.rotary_dim == 8 and n.norm_kind == "layer" and n.qkv_bias and n.mlp_kind == "plain"
    rope = cfg["phi3"].rope
    assert rope.type == "longrope" and len(rope.short_factor) == 8 and rope.original_max_position_embeddings == 128
    assert abs(rope.attention_factor - (1 + math.log(2) / math.log(128)) ** 0.5) < 1e-12  # 256 / 128 positions
    sc = cfg["starcoder2"]
    assert (sc.norm_kind, sc.mlp_kind, sc.activation, sc.sliding_window) == ("layer", "plain", "gelu_tanh", 24)
    g2 = cfg["gemma2"]  # no layer_types in its config.json: transformers' alternation, sliding first
    assert g2.layer_types == ("sliding_attention", "full_attention") * 2
    assert [g2.window_of(i) for i in range(4)] == [16, None, 16, None] and g2.window_of(0) != sc.window_of(0)
    assert (g2.norm_position, g2.activation, g2.embedding_scale, g2.attention_scale) == ("sandwich", "gelu_tanh", 8.0, 24**-0.5)
    assert (g2.attn_logit_softcap, g2.final_logit_softcap, g2.rope_local) == (5.0, 8.0, None)
    g3 = cfg["gemma3_text"]  # 5 sliding : 1 global, the global layer's RoPE scaled, the sliding ones' own base
    assert [g3.window_of(i) for i in range(6)] == [16] * 5 + [None]
    assert (g3.qk_norm, g3.attn_logit_softcap, g3.final_logit_softcap) == ("head", None, None)
    assert (g3.rope.theta, g3.rope.type, g3.rope.factor) == (1e6, "linear", 2.0)
    assert g3.rope_local is not None and (g3.rope_local.theta, g3.rope_local.type) == (1e4, "default")
    assert [g3.rope_of(i) is g3.rope_local for i in range(6)] == [True] * 5 + [False]


def test_every_config_field_differs_from_its_default_in_some_family() -> None:
    """A DecoderConfig field no family sets is a path no parity test compares with transformers."""
    import dataclasses

    from kvexport.config import DecoderConfig

    cfgs = [map_config(raw) for raw in TINY_CONFIGS.values()]
    for f in dataclasses.fields(DecoderConfig):
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            continue  # required: every family sets it
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        assert any(getattr(c, f.name) != default for c in cfgs), f"no family sets DecoderConfig.{f.name}"
    assert {c.rope.type for c in cfgs} >= {"default", "llama3", "longrope"}


def test_bench_125m_matches_benchmarks_md() -> None:
    c = map_config(BENCH_125M)
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads) == (768, 12, 12, 4)
    assert (c.intermediate_size, c.vocab_size, c.max_position_embeddings) == (2048, 32000, 8192)
    assert 120e6 < c.num_parameters() < 130e6


def test_transformers_v4_rope_fields_are_read() -> None:
    raw = {**TINY_CONFIGS["llama"], "rope_theta": 1234.0, "rope_scaling": {"type": "linear", "factor": 2.0}}
    del raw["rope_parameters"]
    rope = map_config(raw).rope
    assert (rope.theta, rope.type, rope.factor) == (1234.0, "linear", 2.0)


def test_gemma_configs_without_keys_take_transformers_defaults() -> None:
    """Absent keys mean transformers' class defaults (softcaps 50/30 for Gemma 2, none for Gemma 3); null turns
    a softcap off; Gemma 3's 4.x RoPE fields (rope_theta, rope_scaling, rope_local_base_freq) read as 5's."""
    pytest.importorskip("transformers")
    keys = ("attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar", "head_dim", "sliding_window")
    bare = {k: v for k, v in TINY_CONFIGS["gemma2"].items() if k not in keys}
    mine = map_config(bare)
    hf = transformers_config(bare)
    assert (mine.attn_logit_softcap, mine.final_logit_softcap) == (hf.attn_logit_softcapping, hf.final_logit_softcapping)
    assert (mine.head_dim, mine.sliding_window, mine.attention_scale) == (hf.head_dim, hf.sliding_window,
                                                                        hf.query_pre_attn_scalar**-0.5)
    assert map_config({**bare, "final_logit_softcapping": None}).final_logit_softcap is None
    g3 = {k: v for k, v in TINY_CONFIGS["gemma3_text"].items() if k != "rope_parameters"}
    v4 = map_config({**g3, "rope_theta": 1e6, "rope_local_base_freq": 1e4,
                     "rope_scaling": {"rope_type": "linear", "factor": 2.0}})
    assert v4 == map_config(TINY_CONFIGS["gemma3_text"])
    hf3 = transformers_config({**g3, "num_hidden_layers": 8})
    assert map_config({**g3, "num_hidden_layers": 8}).layer_types == tuple(hf3.layer_types)


def test_transformers_config_leaves_the_zoo_dicts_as_written() -> None:
    """transformers writes into a config's nested dicts (phi3's longrope rope_parameters gains
    original_max_position_embeddings); the zoo hands it a deep copy, so TINY_CONFIGS stays as written for every
    test after it in the process (a pytest-xdist worker runs several files in one)."""
    pytest.importorskip("transformers")
    before = copy.deepcopy(TINY_CONFIGS["phi3"])
    hf = transformers_config(TINY_CONFIGS["phi3"])
    assert "original_max_position_embeddings" in hf.rope_parameters  # what transformers wrote, into its copy
    assert "original_max_position_embeddings" not in before["rope_parameters"]
    assert TINY_CONFIGS["phi3"] == before


def test_unknown_model_type_names_supported_families() -> None:
    with pytest.raises(UnsupportedArchitectureError) as e:
        map_config({"model_type": "mamba"})
    msg = str(e.value)
    assert "mamba" in msg and all(f in msg for f in ARCHITECTURES) and "architectures.py" in msg


@pytest.mark.parametrize(
    "family,field,value",
    [
        ("llama", "rope_parameters", {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
        ("llama", "hidden_act", "swiglu_fancy"),
        ("qwen2", "use_sliding_window", True),
        ("gpt2", "scale_attn_by_inverse_layer_idx", True),
        ("qwen3", "layer_types", ["full_attention", "sliding_attention"]),
        ("llama", "final_logit_softcapping", 30.0),
        ("starcoder2", "num_experts", 8),
        ("mixtral", "num_experts_per_tok", 5),  # more than its 4 experts
        ("qwen3_moe", "decoder_sparse_step", 0),
        ("gpt_neox", "num_key_value_heads", 2),
        ("phi3", "rope_parameters", {"rope_type": "longrope", "short_factor": [1.0] * 3, "long_factor": [2.0] * 3}),
        ("llama", "rope_parameters", {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                      "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
        ("gemma3_text", "use_bidirectional_attention", True),  # EmbeddingGemma's encoder, not a decoder
        ("gemma3_text", "rope_parameters", {"full_attention": {"rope_type": "yarn", "factor": 8.0},
                                            "sliding_attention": {"rope_type": "default"}}),
        ("gemma2", "layer_types", ["sliding_attention", "chunked_attention", "sliding_attention", "full_attention"]),
        ("gemma2", "attn_logit_softcapping", 0.0),
    ],
)
def test_unsupported_feature_names_the_field(family: str, field: str, value: object) -> None:
    raw = {**TINY_CONFIGS[family], field: value}
    with pytest.raises(UnsupportedFeatureError) as e:
        map_config(raw)
    assert field.split(".")[0] in str(e.value) or "rope_type" in str(e.value)
    assert "supported" in str(e.value)


def test_check_lists_every_problem_at_once() -> None:
    raw = {**TINY_CONFIGS["llama"], "hidden_act": "bogus", "rope_parameters": {"rope_type": "yarn"}}
    _, problems = config_problems(raw)
    assert len(problems) == 2


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_a_missing_field_is_named_without_problems_derived_from_it(family: str) -> None:
    """A required key the config lacks is one problem: the head-count check is not run on its placeholder (it
    used to add `num_attention_heads=1 is not a multiple of ...`), while problems of other fields still show."""
    raw = {k: v for k, v in TINY_CONFIGS[family].items() if k != "num_attention_heads"}
    _, problems = config_problems(raw)
    assert problems == [f"config.json has no `num_attention_heads`, which {raw['model_type']} needs"]
    _, problems = config_problems({**raw, "hidden_act": "bogus"})
    assert len(problems) == 2 and any("hidden_act" in p for p in problems)


def test_missing_weights_file(tmp_path: Path) -> None:
    d = write_checkpoint(TINY_CONFIGS["llama"], tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_checkpoint(d)


def test_pickle_weights_are_refused_with_a_way_out(tmp_path: Path) -> None:
    d = write_checkpoint(TINY_CONFIGS["llama"], tmp_path / "m")
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="safe_serialization"):
        load_checkpoint(d)


def test_missing_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="config.json"):
        load_checkpoint(tmp_path)


def test_wrong_weight_shape_names_the_tensor(tmp_path: Path) -> None:
    d = write_checkpoint(TINY_CONFIGS["llama"], tmp_path / "m")
    t = load_file(str(d / "model.safetensors"))
    t["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(8, 64)
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(WeightShapeError) as e:
        load_checkpoint(d)
    assert "model.layers.1.self_attn.k_proj.weight" in str(e.value) and "num_key_value_heads" in str(e.value)


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    d = write_checkpoint(TINY_CONFIGS["qwen2"], tmp_path / "m")
    t = load_file(str(d / "model.safetensors"))
    del t["model.layers.0.self_attn.q_proj.bias"]
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="q_proj.bias"):
        load_checkpoint(d)


def test_unknown_extra_tensor_is_an_unsupported_feature(tmp_path: Path) -> None:
    d = write_checkpoint(TINY_CONFIGS["llama"], tmp_path / "m")
    t = load_file(str(d / "model.safetensors"))
    t["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(t, str(d / "model.safetensors"))
    with pytest.raises(UnsupportedFeatureError, match="q_norm"):
        load_checkpoint(d)


def test_sharded_bf16_checkpoint_loads_like_the_single_file_one(tmp_path: Path) -> None:
    one = load_checkpoint(write_checkpoint(TINY_CONFIGS["mistral"], tmp_path / "one", seed=3, dtype=torch.bfloat16))
    d = write_checkpoint(TINY_CONFIGS["mistral"], tmp_path / "sharded", seed=3, dtype=torch.bfloat16, shard_bytes=20_000)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    sharded = load_checkpoint(d)
    for (n, a), (_, b) in zip(one.decoder.state_dict().items(), sharded.decoder.state_dict().items()):
        assert a.dtype == torch.float32 and torch.equal(a, b), n


def test_missing_shard_is_named(tmp_path: Path) -> None:
    d = write_checkpoint(TINY_CONFIGS["llama"], tmp_path / "m", shard_bytes=30_000)
    shard = sorted(d.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        load_checkpoint(d)


def test_tied_embeddings_share_one_tensor(tmp_path: Path) -> None:
    d = write_checkpoint(TINY_CONFIGS["gpt2"], tmp_path / "g")
    assert "lm_head.weight" not in load_file(str(d / "model.safetensors"))
    dec = load_checkpoint(d).decoder
    assert dec.lm_head.weight.data_ptr() == dec.embed_tokens.weight.data_ptr()


def test_learned_positions_bound_max_seq(tmp_path: Path) -> None:
    d = write_checkpoint(TINY_CONFIGS["gpt2"], tmp_path / "g")
    with pytest.raises(UnsupportedFeatureError, match="--max-seq 256"):
        load_checkpoint(d, max_seq=1024)


def test_checkpoint_copy_keeps_source_hashes(tmp_path: Path) -> None:
    d = write_checkpoint(TINY_CONFIGS["llama"], tmp_path / "a")
    e = tmp_path / "b"
    shutil.copytree(d, e)
    assert load_checkpoint(d).source_hashes == load_checkpoint(e).source_hashes


def test_qwen3_moe_routed_layers_are_those_transformers_builds() -> None:
    transformers = pytest.importorskip("transformers")
    raw = {**TINY_CONFIGS["qwen3_moe"], "num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [1]}
    cfg = map_config(raw)
    hf = transformers.AutoModelForCausalLM.from_config(transformers_config(raw))
    routed = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    assert [i for i in range(4) if cfg.is_moe_layer(i)] == routed == [3]
