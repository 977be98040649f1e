"""Tiny random models and tokenizers built in-process (no hub): deterministic from a seed."""

from __future__ import annotations

from pathlib import Path

import torch

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

_CORPUS = [
    "the quick brown fox jumps over the lazy dog", "hello world, hello slotserve",
    "continuous batching keeps every slot busy", "paged attention stores keys and values in blocks",
    "héllo wörld — naïve café 日本語 テキスト 🙂🚀", "def main():\n    return 42\n",
    "Ray Serve routes requests to replicas", "tokens stream back to the client one step at a time",
] * 20


def build_tokenizer(vocab_size: int = 384):
    """A byte-level BPE tokenizer with ChatML specials and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", chat_template=CHATML)


ARCH_CONFIGS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "llama3": ("LlamaConfig", "LlamaForCausalLM",
               {"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                    "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 64}}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
}


def make_model(arch: str = "llama", seed: int = 0, vocab_size: int = 512, hidden: int = 64, layers: int = 2,
               heads: int = 4, kv_heads: int = 2, tie: bool = False, max_pos: int = 1024):
    import transformers

    cfg_name, model_name, extra = ARCH_CONFIGS[arch]
    cfg = getattr(transformers, cfg_name)(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_pos,
        tie_word_embeddings=tie, bos_token_id=0, eos_token_id=2, pad_token_id=0, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(cfg).eval()
    with torch.no_grad():  # random init is tiny; widen it so greedy paths differ between prompts
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.5 / p.shape[1] ** 0.5 * 4)
    return model


def make_model_dir(path: Path, arch: str = "llama", seed: int = 0, with_tokenizer: bool = True, **kw) -> Path:
    """Save a tiny random model (and optionally a tokenizer) as an HF directory."""
    path = Path(path)
    model = make_model(arch, seed, **kw)
    model.save_pretrained(path, safe_serialization=True)
    if with_tokenizer:
        build_tokenizer().save_pretrained(path)
    return path


LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_lora_dir(base: Path, path: Path, rank: int = 4, seed: int = 0, modules=LORA_MODULES,
                  alpha: float | None = None, scale: float = 0.3, **config) -> Path:
    """A PEFT LoRA adapter of ``base`` with random A and B (PEFT starts B at zero, which would make
    every adapter the base model), saved as ``peft`` saves it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    lora = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 2 * rank, target_modules=list(modules),
                      lora_dropout=0.0, **config)
    peft_model = get_peft_model(model, lora)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * scale / p.shape[-1] ** 0.5)
    peft_model.save_pretrained(path)
    return Path(path)
