"""llama.py against transformers' LlamaForCausalLM on the same checkpoints (fp32, CPU).

Covers prefill in chunks and decode steps in a batch of slots at different positions, on the
tiny Orpheus checkpoint (Llama-3 rope scaling, GQA, tied embeddings) and on variants written
here: the `rope_parameters` config form with strong scaling, an untied output, a sharded
checkpoint, plain RoPE with full multi-head attention.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from orpheus_serve.engines.llama import LlamaConfig, RopeConfig, load_transformer, rope_inv_freq
from orpheus_serve.scheduler.step import EngineError
from orpheus_serve.weights.tiny import llama_config, llama_weights

TOLERANCE = 1e-4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def reference_logits(folder: Path, sequences: list[torch.Tensor]) -> list[torch.Tensor]:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(seq.unsqueeze(0)).logits[0] for seq in sequences]


def engine_logits(folder: Path, sequences: list[torch.Tensor], prompt_lens: list[int], chunk: int,
                  slots: list[int]) -> list[torch.Tensor]:
    """Prefill each sequence's prompt in chunks into its slot, then decode the rest one token per
    step with every sequence in one batch, each at its own position. Logits of every position."""
    model = load_transformer(folder, dtype=torch.float32, device="cpu")
    model.setup_caches(num_slots=max(slots) + 1, max_seq_len=max(len(s) for s in sequences) + 8)
    out: list[list[torch.Tensor]] = [[] for _ in sequences]
    with torch.inference_mode():
        # Leave stale keys/values in every slot first: masking must hide them.
        for slot in slots:
            model.prefill(torch.randint(0, 1000, (len(sequences[0]) + 4,)), slot, 0)
        for i, (seq, n, slot) in enumerate(zip(sequences, prompt_lens, slots, strict=True)):
            for start in range(0, n, chunk):
                out[i].append(model.logits(model.prefill(seq[start : min(n, start + chunk)], slot, start)))
        for step in range(max(len(s) - n for s, n in zip(sequences, prompt_lens, strict=True))):
            rows = [i for i, (s, n) in enumerate(zip(sequences, prompt_lens, strict=True)) if n + step < len(s)]
            positions = torch.tensor([prompt_lens[i] + step for i in rows])
            tokens = torch.stack([sequences[i][prompt_lens[i] + step] for i in rows])
            slot_ids = torch.tensor([slots[i] for i in rows])
            logits = model.logits(model.decode(tokens, slot_ids, positions, int(positions.max()) + 1))
            for row, i in enumerate(rows):
                out[i].append(logits[row : row + 1])
    return [torch.cat(parts) for parts in out]


def assert_engine_matches_reference(folder: Path) -> None:
    gen = torch.Generator().manual_seed(1)
    lengths, prompt_lens = [150, 90, 120], [100, 23, 61]
    sequences = [torch.randint(0, 156940, (n,), generator=gen) for n in lengths]
    ours = engine_logits(folder, sequences, prompt_lens, chunk=40, slots=[2, 0, 3])
    ref = reference_logits(folder, sequences)
    for mine, theirs in zip(ours, ref, strict=True):
        assert mine.shape == theirs.shape
        diff = (mine - theirs).abs().max().item()
        assert diff < TOLERANCE, f"max abs logit diff {diff:.2e}"


def test_tiny_orpheus_matches_transformers(tiny_orpheus: Path) -> None:
    cfg = LlamaConfig.from_folder(tiny_orpheus)
    assert cfg.rope.rope_type == "llama3" and cfg.n_kv_heads < cfg.n_heads and cfg.tie_word_embeddings
    assert_engine_matches_reference(tiny_orpheus)


def write_variant(out: Path, *, rope_form: str, tied: bool, sharded: bool, n_kv_heads: int) -> Path:
    cfg = llama_config("tiny")
    cfg["num_key_value_heads"] = n_kv_heads
    cfg["tie_word_embeddings"] = tied
    weights = llama_weights(cfg, seed=3)
    if not tied:
        weights["lm_head.weight"] = torch.randn(cfg["vocab_size"], cfg["hidden_size"],
                                                generator=torch.Generator().manual_seed(4)) * 0.2
    scaling = cfg.pop("rope_scaling")
    theta = cfg.pop("rope_theta")
    if rope_form == "rope_parameters":
        # Strong scaling at short range so the Llama-3 blend shows up within a few hundred positions.
        scaling |= {"original_max_position_embeddings": 64, "factor": 8.0}
        cfg["rope_parameters"] = {"rope_theta": theta, **scaling}
    elif rope_form == "plain":
        cfg["rope_theta"] = 10000.0
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(cfg))
    if sharded:
        names = sorted(weights)
        shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
                  "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
        for file, keys in shards.items():
            save_file({k: weights[k] for k in keys}, str(out / file), metadata={"format": "pt"})
        index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index))
    else:
        save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_rope_parameters_untied_sharded_matches_transformers(tmp_path: Path) -> None:
    folder = write_variant(tmp_path / "variant", rope_form="rope_parameters", tied=False, sharded=True, n_kv_heads=1)
    cfg = LlamaConfig.from_folder(folder)
    assert cfg.rope.rope_type == "llama3" and cfg.rope.original_max_position_embeddings == 64
    assert not cfg.tie_word_embeddings
    assert_engine_matches_reference(folder)


def test_plain_rope_multi_head_matches_transformers(tmp_path: Path) -> None:
    folder = write_variant(tmp_path / "plain", rope_form="plain", tied=True, sharded=False, n_kv_heads=4)
    cfg = LlamaConfig.from_folder(folder)
    assert cfg.rope.rope_type == "default" and cfg.n_kv_heads == cfg.n_heads
    assert_engine_matches_reference(folder)


@pytest.mark.parametrize("form", ["rope_scaling", "rope_parameters"])
def test_rope_frequencies_match_transformers(form: str) -> None:
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    raw = {"hidden_size": 3072, "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128,
           "intermediate_size": 8192, "num_hidden_layers": 28, "vocab_size": 156940}
    if form == "rope_scaling":
        raw |= {"rope_theta": 500000.0, "rope_scaling": scaling}
    else:
        raw |= {"rope_parameters": {"rope_theta": 500000.0, **scaling}}
    rope = RopeConfig.from_hf(raw)
    expected, _ = ROPE_INIT_FUNCTIONS["llama3"](HFLlamaConfig(**raw), "cpu")
    torch.testing.assert_close(rope_inv_freq(rope, 128), expected, rtol=1e-6, atol=0)


def test_unsupported_config_or_missing_weights_is_refused(tmp_path: Path) -> None:
    cfg = llama_config("tiny")
    (tmp_path / "config.json").write_text(json.dumps(cfg | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))
    with pytest.raises(EngineError, match="rope_type 'yarn'"):
        LlamaConfig.from_folder(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(EngineError, match=r"no model\.safetensors"):
        load_transformer(tmp_path, dtype=torch.float32, device="cpu")
    weights = llama_weights(cfg, seed=0)
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(EngineError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_transformer(tmp_path, dtype=torch.float32, device="cpu")
