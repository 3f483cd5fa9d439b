"""Seeded random-weight stand-ins for the real checkpoints, in their real on-disk formats.

- `tiny-orpheus/`: Hugging Face Llama folder: config.json (Llama-3 rope_scaling, GQA, tied
  embeddings, the full Orpheus vocabulary of 156940 so real token ids apply),
  model.safetensors (seeded random weights), tokenizer.json + tokenizer_config.json (a small
  byte-level BPE trained on built-in text, with the Llama-3/Orpheus special tokens at their
  real ids).
- `tiny-snac/`: config.json + pytorch_model.bin, the real snac_24khz architecture with seeded
  random weights.

`scripts/make_tiny_models.py` is the command line; the server calls `write_tiny_models` when
no real weights are present. Deterministic for a given seed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB_SIZE = 156940
BOS_ID = 128000
EOT_ID = 128009

LLAMA_PRESETS: dict[str, dict] = {
    "tiny": {"hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2},
    # Head size 64: TensorRT-LLM's attention plugin takes head sizes 32..256 only (the tiny preset has 16).
    "tiny-trt": {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2},
    "100m": {"hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8,
             "num_attention_heads": 8, "num_key_value_heads": 2},
    # The shapes of canopylabs/orpheus-3b-0.1-ft (Llama-3.2-3B): weight values do not change speed, so the
    # GPU benchmarks measure this with random weights. 6.6 GB in bf16: write it with device="cuda".
    "3b": {"hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28,
           "num_attention_heads": 24, "num_key_value_heads": 8},
}

SNAC_24KHZ_CONFIG = {
    "sampling_rate": 24000,
    "encoder_dim": 48,
    "encoder_rates": [2, 4, 8, 8],
    "decoder_dim": 1024,
    "decoder_rates": [8, 8, 4, 2],
    "attn_window_size": None,
    "codebook_size": 4096,
    "codebook_dim": 8,
    "vq_strides": [4, 2, 1],
    "noise": True,
    "depthwise": True,
}

TRAINING_TEXT = """\
Hello there, how are you doing today? I'm doing well, thank you for asking.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
She sells sea shells by the sea shore, and the shells she sells are surely seashells.
It was the best of times, it was the worst of times, it was the age of wisdom.
Streaming speech synthesis turns text into audio while the text is still being read.
Numbers like 1, 2, 3, 42 and 2026 appear in text; so do dates, times and prices: $9.99.
tara: leah: jess: leo: dan: mia: zac: zoe: <laugh> <chuckle> <sigh> <cough> <sniffle> <groan> <yawn> <gasp>
What time is it? Can you hear me now? Let's meet at the station at half past seven.
A voice agent answers quickly, listens carefully and never talks over anybody.
"""

# Llama-3 reserves 128000..128255; Orpheus adds 128256..128265 and the audio tokens after.
SPECIAL_TOKENS: dict[int, str] = {
    128000: "<|begin_of_text|>",
    128001: "<|end_of_text|>",
    128009: "<|eot_id|>",
    128256: "<custom_token_0>",
    128257: "<custom_token_1>",  # start_of_speech
    128258: "<custom_token_2>",  # end_of_speech
    128259: "<custom_token_3>",  # start_of_human
    128260: "<custom_token_4>",  # end_of_human
    128261: "<custom_token_5>",  # start_of_ai
    128262: "<custom_token_6>",  # end_of_ai
    128263: "<custom_token_7>",  # pad
}


def build_tokenizer(vocab_size: int = 1000) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAINING_TEXT.splitlines() * 4, trainer=trainer)
    return tok


def special_token_names() -> dict[int, str]:
    """Every id 128000..128265 as an added token, like the real Llama-3/Orpheus tokenizer
    (its model vocabulary ends at 127999, so added tokens land on their real ids)."""
    names = {i: f"<|reserved_special_token_{i - 128000}|>" for i in range(128000, 128256)}
    names.update({128256 + k: f"<custom_token_{k}>" for k in range(10)})
    names.update(SPECIAL_TOKENS)
    return names


def write_tokenizer(out: Path) -> None:
    tok = build_tokenizer()
    data = json.loads(tok.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    # Pad the BPE vocabulary with unreachable filler entries up to Llama-3's 128000.
    for i in range(len(vocab), BOS_ID):
        vocab[f"<|filler_{i}|>"] = i
    data["added_tokens"] = [
        {"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i, s in sorted(special_token_names().items())
    ]
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}},
                 {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 1}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [BOS_ID],
                                                 "tokens": ["<|begin_of_text|>"]}},
    }
    (out / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "pad_token": "<custom_token_7>",
        "add_bos_token": True,
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
    }, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps({
        "bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "pad_token": "<custom_token_7>",
    }, indent=2))


def llama_config(preset: str) -> dict:
    p = LLAMA_PRESETS[preset]
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": p["hidden_size"],
        "intermediate_size": p["intermediate_size"],
        "num_hidden_layers": p["num_hidden_layers"],
        "num_attention_heads": p["num_attention_heads"],
        "num_key_value_heads": p["num_key_value_heads"],
        "head_dim": p["hidden_size"] // p["num_attention_heads"],
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "factor": 32.0,
            "high_freq_factor": 4.0,
            "low_freq_factor": 1.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
        "tie_word_embeddings": True,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOT_ID,
        "pad_token_id": 128263,
        "torch_dtype": "float32",
    }


def llama_weights(cfg: dict, seed: int, *, device: str = "cpu",
                  dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Seeded random weights with the names and shapes of a Hugging Face Llama checkpoint.

    Drawn on `device` in `dtype` (a 3B model draws in seconds on a GPU, minutes on a CPU) and
    returned on the CPU, ready to save."""
    gen = torch.Generator(device).manual_seed(seed)
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def rand(*shape: int, std: float) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device, dtype=dtype) * std).cpu()

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rand(v, d, std=1.0)}
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        w[pre + "self_attn.q_proj.weight"] = rand(nh * hd, d, std=d**-0.5)
        w[pre + "self_attn.k_proj.weight"] = rand(nkv * hd, d, std=d**-0.5)
        w[pre + "self_attn.v_proj.weight"] = rand(nkv * hd, d, std=d**-0.5)
        w[pre + "self_attn.o_proj.weight"] = rand(d, nh * hd, std=(nh * hd) ** -0.5)
        w[pre + "mlp.gate_proj.weight"] = rand(f, d, std=d**-0.5)
        w[pre + "mlp.up_proj.weight"] = rand(f, d, std=d**-0.5)
        w[pre + "mlp.down_proj.weight"] = rand(d, f, std=f**-0.5)
        w[pre + "input_layernorm.weight"] = 1.0 + rand(d, std=0.1)
        w[pre + "post_attention_layernorm.weight"] = 1.0 + rand(d, std=0.1)
    w["model.norm.weight"] = 1.0 + rand(d, std=0.1)
    return {k: t.contiguous() for k, t in w.items()}


def write_llama(out: Path, preset: str, seed: int, *, device: str = "cpu", dtype: torch.dtype = torch.float32) -> None:
    out.mkdir(parents=True, exist_ok=True)
    cfg = llama_config(preset)
    cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": BOS_ID, "eos_token_id": 128258, "pad_token_id": 128263}, indent=2))
    save_file(llama_weights(cfg, seed, device=device, dtype=dtype), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    write_tokenizer(out)


def write_snac(out: Path, seed: int) -> None:
    from snac import SNAC

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = SNAC(**SNAC_24KHZ_CONFIG).eval()
    (out / "config.json").write_text(json.dumps(SNAC_24KHZ_CONFIG, indent=2))
    torch.save(model.state_dict(), out / "pytorch_model.bin")


def write_tiny_models(out: Path, *, seed: int = 0, preset: str = "tiny", name: str | None = None,
                      snac: bool = True, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Path:
    """Write OUT/<name> (Llama) and, unless snac=False, OUT/tiny-snac. Returns the Llama folder."""
    name = name or ("tiny-orpheus" if preset == "tiny" else f"orpheus-{preset}")
    write_llama(out / name, preset, seed, device=device, dtype=dtype)
    if snac:
        write_snac(out / "tiny-snac", seed)
    return out / name


LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_LORA_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_lora_adapter(out: Path, base: Path, *, seed: int, rank: int, alpha: float | None = None,
                       targets: tuple[str, ...] = LORA_TARGETS, prompt_name: str | None = None,
                       description: str = "", dtype: torch.dtype = torch.float32) -> Path:
    """One seeded random LoRA adapter for the Llama folder `base`, in PEFT's on-disk format
    (adapter_config.json + adapter_model.safetensors, the names PEFT saves), plus a voice.json.

    Unlike a freshly initialised PEFT adapter (B = 0), B is random too, so the adapter changes the
    model's output as a trained voice would."""
    cfg = json.loads((base / "config.json").read_text())
    d, f = cfg["hidden_size"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or d // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    shapes = {"q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
              "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d)}
    alpha = float(2 * rank if alpha is None else alpha)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(cfg["num_hidden_layers"]):
        for proj in targets:
            n_in, n_out = shapes[proj]
            key = f"base_model.model.model.layers.{layer}.{_LORA_PARENT[proj]}.{proj}"
            # scale * B A then has entries of about the base weight's size (n_in ** -0.5).
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, n_in, generator=gen) * n_in**-0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(n_out, rank, generator=gen) * (rank**-0.5 * rank / alpha)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: t.to(dtype).contiguous() for k, t in tensors.items()}, str(out / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base),
        "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0, "target_modules": sorted(targets),
        "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
        "modules_to_save": None, "layers_to_transform": None, "inference_mode": True,
    }, indent=2))
    (out / "voice.json").write_text(json.dumps({
        "prompt_name": prompt_name or out.name,
        "description": description or f"tiny random LoRA voice (rank {rank})",
        "sampling": {"temperature": 0.6, "top_p": 0.9},
    }, indent=2))
    return out


def write_lora_adapters(out: Path, base: Path, count: int, *, seed: int = 0) -> list[Path]:
    """`count` adapters OUT/voice0.. for `base`: ranks 8, 4, 2, 8, ... (smaller ranks exercise the pool's
    padding) and every third one on attention only (q, k, v, o)."""
    ranks = (8, 4, 2)
    written = []
    for i in range(count):
        targets = LORA_TARGETS[:4] if i % 3 == 2 else LORA_TARGETS
        written.append(write_lora_adapter(out / f"voice{i}", base, seed=seed * 1000 + i, rank=ranks[i % 3],
                                          targets=targets))
    return written
