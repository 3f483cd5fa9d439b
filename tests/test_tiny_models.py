"""The tiny models load with the real libraries' own loaders."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from orpheus_serve import token_format as P
from scripts.make_tiny_models import main as make_tiny_models


def test_transformers_loads_tiny_orpheus(tiny_orpheus: Path) -> None:
    from transformers import AutoTokenizer, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_orpheus)
    cfg = model.config
    assert cfg.vocab_size == P.VOCAB_SIZE
    assert cfg.num_key_value_heads < cfg.num_attention_heads  # GQA
    assert cfg.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    raw = json.loads((tiny_orpheus / "config.json").read_text())
    assert raw["rope_scaling"]["rope_type"] == "llama3"

    tok = AutoTokenizer.from_pretrained(tiny_orpheus)
    assert tok.bos_token_id == P.BOS
    assert tok.convert_ids_to_tokens(P.END_OF_SPEECH) == "<custom_token_2>"
    ids = tok("tara: hello")["input_ids"]
    assert ids[0] == P.BOS
    with torch.no_grad():
        logits = model(torch.tensor([P.build_prompt_ids(tok, "tara", "hello")])).logits
    assert logits.shape[-1] == P.VOCAB_SIZE and torch.isfinite(logits).all()


def test_tokenizers_loads_tiny_tokenizer(tiny_orpheus: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_orpheus / "tokenizer.json"))
    assert tok.token_to_id("<|begin_of_text|>") == P.BOS
    assert tok.token_to_id("<|eot_id|>") == P.END_OF_TEXT
    assert tok.token_to_id("<custom_token_1>") == P.START_OF_SPEECH
    assert tok.encode("zoe: Hi!").ids[0] == P.BOS


def test_snac_loads_tiny_snac(tiny_snac: Path) -> None:
    from snac import SNAC

    model = SNAC.from_pretrained(str(tiny_snac))
    cfg = json.loads((tiny_snac / "config.json").read_text())
    assert cfg["sampling_rate"] == 24000 and cfg["decoder_rates"] == [8, 8, 4, 2] and cfg["attn_window_size"] is None
    n_params = sum(p.numel() for p in model.parameters())
    assert 19e6 < n_params < 21e6
    c0, c1, c2 = (torch.from_numpy(c)[None] for c in P.frames_to_snac_codes(torch.randint(0, 4096, (3, 7)).numpy()))
    with torch.inference_mode():
        audio = model.decode([c0, c1, c2])
    assert audio.shape == (1, 1, 3 * P.SAMPLES_PER_FRAME)


def test_make_tiny_models_is_deterministic(tmp_path: Path, tiny_orpheus: Path) -> None:
    assert make_tiny_models(["--out", str(tmp_path), "--seed", "0", "--skip-snac"]) == 0
    a = (tmp_path / "tiny-orpheus" / "model.safetensors").read_bytes()
    assert a == (tiny_orpheus / "model.safetensors").read_bytes()
    assert (tmp_path / "tiny-orpheus" / "tokenizer.json").read_bytes() == (tiny_orpheus / "tokenizer.json").read_bytes()


def test_tensorrt_preset_has_a_head_size_the_attention_plugin_takes() -> None:
    from orpheus_serve.weights.tiny import llama_config
    from tests.test_trtllm_gpu import TRT_PRESET

    config = llama_config(TRT_PRESET)
    assert 32 <= config["head_dim"] <= 256 and config["head_dim"] % 8 == 0
    assert config["head_dim"] * config["num_attention_heads"] == config["hidden_size"]


def test_3b_preset_is_the_orpheus_3b_shape() -> None:
    from orpheus_serve.weights.tiny import llama_config

    config = llama_config("3b")
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (28, 3072, 8192)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (24, 8, 128)
    assert config["vocab_size"] == 156940 and config["tie_word_embeddings"] is True
    assert config["rope_theta"] == 500000.0
    assert config["rope_scaling"] == {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                      "original_max_position_embeddings": 8192, "rope_type": "llama3"}
